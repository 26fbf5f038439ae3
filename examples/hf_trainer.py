"""Fine-tune a small Llama-shaped model with LoRA and fastplug's kernels in a Hugging Face Trainer.

    python examples/hf_trainer.py                 # random-init model, local arithmetic data ("12+34=46")
    python examples/hf_trainer.py --model PATH    # a local checkpoint (and its tokenizer) instead
    python examples/hf_trainer.py --steps 50

The only fastplug line is `callbacks=[FastKernels()]`. Nothing is downloaded. On a machine without a GPU it
runs the kernels' torch reference path (and says so); on a GPU, the Triton kernels.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from fastplug import FastKernels

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of the arithmetic task, built locally with the `tokenizers` library."""
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + list("0123456789+="))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def arithmetic_dataset(tokenizer, n: int, seed: int) -> list[dict]:
    """'a+b=' prompts with the sum as the answer; only the answer (and end token) is learned."""
    rng = random.Random(seed)
    rows, length = [], 16
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = [tokenizer.bos_token_id] + tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
        answer = tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + answer)[:length]
        pad = length - len(ids)
        labels = [-100] * len(prompt) + answer
        rows.append(
            {
                "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels[:length] + [-100] * pad),
            }
        )
    return rows


def small_llama(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="path of a local checkpoint (default: a small random Llama)")
    parser.add_argument("--steps", type=int, default=100)
    # FastKernels prints its patch summary, with the kernel path (Triton on GPU, torch reference on CPU),
    # when training starts; tokens/s and peak GPU memory join the Trainer's logs.
    args = parser.parse_args()

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        tokenizer = char_tokenizer()
        model = small_llama(len(tokenizer))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=16,
            learning_rate=2e-3,
            warmup_steps=10,
            lr_scheduler_type="cosine",
            logging_steps=max(1, args.steps // 10),
            save_strategy="no",
            report_to=[],
            bf16=cuda and torch.cuda.is_bf16_supported(),
            seed=0,
            disable_tqdm=True,
        )
        fast = FastKernels()
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=arithmetic_dataset(tokenizer, 4000, seed=0),
            callbacks=[fast],
        )
        trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    print("\nstep  loss    tokens/s" + ("  peak GPU GiB" if cuda else ""))
    for h in logs:
        memory = f"  {h['peak_gpu_memory_gib']:>12.2f}" if "peak_gpu_memory_gib" in h else ""
        print(f"{h['step']:>4}  {h['loss']:.4f}  {h.get('tokens_per_second', float('nan')):>8.0f}{memory}")
    print(f"\nloss: first {logs[0]['loss']:.4f} -> last {logs[-1]['loss']:.4f}")
    print(f"model restored after training: {not any('forward' in vars(m) for m in model.modules())}")


if __name__ == "__main__":
    main()
