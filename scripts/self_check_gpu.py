"""What the patch-time self-check costs and finds on a GPU, at real widths (issue 33).

    python scripts/self_check_gpu.py [--models llama1b,llama8b,qwen3moe] [--layers8b 32]

For each model (random init, bf16 base, peft LoRA r=16 on every linear): patch_model's wall time with the
self-check off, then on with an empty Triton cache (the check's kernels compiled: "cold"), then on again
(kernels compiled, verdict forgotten: "warm"); the check's largest patched-vs-original difference against
its bound. Prints one markdown table last.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-self-check-"))

import torch  # noqa: E402
import transformers  # noqa: E402

from fastplug import patch_model  # noqa: E402
from fastplug.patch import self_check  # noqa: E402

SHAPES = {
    "llama1b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    "llama8b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
    ),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=64,
            num_experts_per_tok=8,
            vocab_size=151936,
        ),
    ),
}


def build(name: str, layers8b: int):
    from peft import LoraConfig, get_peft_model

    config_name, model_name, kwargs = SHAPES[name]
    if name == "llama8b":
        kwargs = {**kwargs, "num_hidden_layers": layers8b}
    config = getattr(transformers, config_name)(**kwargs, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(config).to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + (
        [] if "moe" in name else ["gate_proj", "up_proj", "down_proj"]
    )
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=targets))


def timed_patch(model, **options):
    torch.cuda.synchronize()
    start = time.perf_counter()
    handle = patch_model(model, **options)
    torch.cuda.synchronize()
    return handle, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama1b,llama8b,qwen3moe")
    parser.add_argument("--layers8b", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        model = build(name, args.layers8b)
        handle, off = timed_patch(model, self_check=False)
        handle.restore()
        self_check.forget()
        handle, cold = timed_patch(model)
        report = handle.check
        print(handle.summary(), flush=True)
        handle.restore()
        self_check.forget()
        handle, warm = timed_patch(model)
        warm_seconds = handle.check.seconds
        handle.restore()
        declined = "; ".join(f"{k}: {why}" for k, why in report.declined) or "none"
        rows.append(
            f"| {name} | {off:.3f} | {cold:.2f} | {warm:.3f} | {warm_seconds:.3f} "
            f"| {report.worst:.1e} ({report.where}) "
            f"| {report.bound:.0e} | {declined} |"
        )
        del model, handle
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(
        "| model | patch, check off (s) | check on, cold Triton cache (s) | check on, warm (s) | check alone, warm (s) "
        "| largest difference | bound | declined |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
