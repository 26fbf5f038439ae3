"""Supervised fine-tuning with TRL and fastplug's kernels: `python examples/trl_sft.py` (no arguments).

A tiny Llama and a character-level tokenizer are built here, nothing is downloaded. On a GPU the Triton
kernels run; on a CPU the same code takes the kernels' torch reference path. The patch summary is printed
when training starts, the losses after it.
"""

import string
import tempfile

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, plus pad/eos/bos/unk."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def common_args(output_dir: str) -> dict:
    on_gpu = torch.cuda.is_available()
    return dict(
        output_dir=output_dir, max_steps=10, per_device_train_batch_size=8, learning_rate=2e-3, logging_steps=1,
        report_to="none", save_strategy="no", max_length=64, seed=0, disable_tqdm=True, bf16=on_gpu, use_cpu=not on_gpu,
    )  # fmt: skip


def main():
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig

    from fastplug import KernelOptions
    from fastplug.integrations.trl import FastSFTTrainer

    tokenizer = char_tokenizer()
    texts = [f"{i} plus {i} is {2 * i}; {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(256)]
    trainer = FastSFTTrainer(
        model=tiny_llama(tokenizer),
        args=SFTConfig(**common_args(tempfile.mkdtemp(prefix="fastplug_sft_"))),
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
        options=KernelOptions(),  # everything suitable on; e.g. KernelOptions(lora=False) to opt out
    )
    trainer.train()  # prints the patch summary, restores the model when it returns (or raises)
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print("losses:", losses)


if __name__ == "__main__":
    main()
