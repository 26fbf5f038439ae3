"""The model path: load, add LoRA, generate with the unmerged adapters: `python examples/generate.py`.

A tiny Llama and a character-level tokenizer are saved to a temporary folder first (nothing is downloaded),
then loaded back the way a real checkpoint would be. On a GPU the decode step runs as a CUDA graph of
fastplug's decode kernels (fastplug.kernels.decode).
"""

import string
import tempfile

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastplug import FastModel
from fastplug.generate.api import graph_status
from fastplug.patch.engine import active_handle


def save_tiny_checkpoint(folder: str) -> None:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    # no pad token saved: from_pretrained gives the tokenizer one
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    ).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_checkpoint(folder)
        model, tokenizer = FastModel.from_pretrained(folder, max_seq_length=512)  # RoPE scaled 2x
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = FastModel.get_peft_model(model.to(device), r=8, random_state=0)
    print(active_handle(model).summary().splitlines()[0])

    # ... train here (Trainer(callbacks=[FastKernels()]), FastSFTTrainer, Lightning) ...

    FastModel.for_inference(model)
    tokenizer.padding_side = "left"  # fast_generate takes left-padded batches
    batch = tokenizer(["Hello", "The quick brown fox"], return_tensors="pt", padding=True).to(device)
    torch.manual_seed(0)
    out = model.fast_generate(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=24,
        do_sample=True,
        temperature=0.8,
        top_k=20,
    )
    for row in tokenizer.batch_decode(out, skip_special_tokens=True):
        print(repr(row))
    print("decode step:", graph_status(model))  # on a GPU: CUDA graph + fastplug's decode kernels
    FastModel.for_training(model)


if __name__ == "__main__":
    main()
