"""`python -m fastplug.bench.qlora`: the QLoRA rows of issue 15 in one run.

Micro rows from `micro.qlora_rows` (dequantization, batch-1 GEMV, 4-bit LoRA MLP against bitsandbytes and
peft + bitsandbytes), then end to end: a random-init Llama of 8B width (4 layers, vocab 128256) whose decoder
linears are bitsandbytes NF4 (double quant, bf16 compute), LoRA r=16 on all of them (peft's fp32 adapters),
non-reentrant checkpointing, fused AdamW, 2x4096 tokens: transformers + peft + bnb, then the same model
patched by fastplug, then Liger when installed. `--shape llama1b`: the e2e bench's Llama-1B preset at 4x2048
instead. `--quick`: tiny shapes on CPU (a smoke run). Markdown table last.
"""

from __future__ import annotations

import argparse
import time

import torch

from ._report import fmt, markdown_table

LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --shape: (the e2e bench's preset, batch, seq, name in the table)
SHAPES = {"llama8b_4l": ("llama8b_4l", 2, 4096, "Llama-8B width, 4 layers"), "llama1b": ("llama", 4, 2048, "Llama-1B shape")}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _to_4bit(model, device) -> None:
    """Every nn.Linear of the decoder layers becomes a bitsandbytes NF4 Linear4bit holding the same weight."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in LORA:
                lin = getattr(owner, name, None)
                if not isinstance(lin, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      quant_type="nf4", compress_statistics=True, device="meta")
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)._quantize(device)
                setattr(owner, name, q)


def e2e_rows(device, quick: bool, steps: int = 4, shape: str = "llama8b_4l") -> list[dict]:
    import peft
    import transformers

    import fastplug
    from fastplug import checkpointing

    from .e2e import MODELS
    from .micro import _liger

    device = torch.device(device)
    preset, batch, seq, shape_name = SHAPES[shape]
    config = transformers.LlamaConfig(**(TINY if quick else MODELS[preset]["full"]), use_cache=False)
    if quick:
        batch, seq = 2, 16
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    _to_4bit(model, device)
    checkpointing.enable_native(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2)]
    shape = "tiny" if quick else shape_name
    rows = []
    # Liger patches the instance for good (no restore): it runs last
    apply_liger = _liger("_apply_liger_kernel_to_instance")
    impls = ("transformers+peft+bnb", "fastplug") + (("liger",) if apply_liger is not None else ())
    for impl in impls:
        handle = fastplug.patch_model(model) if impl == "fastplug" else None
        if impl == "liger":
            apply_liger(model=model.get_base_model())
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for step in range(steps + 2):  # two warm-up steps (Triton compiles, cuBLAS picks)
            start = time.perf_counter()
            loss = model(input_ids=ids[step % 2], labels=ids[step % 2]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # syncs
            if step >= 2:
                times.append(time.perf_counter() - start)
        ms = 1e3 * sorted(times)[len(times) // 2]
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        note = "" if handle is None else "lora_fused " + str(handle.counts.get("lora_fused", 0))
        rows.append({"op": "e2e step", "shape": f"{shape}, {batch}x{seq} NF4", "impl": impl, "ms": ms,
                     "tok/s": batch * seq / ms * 1e3, "peak GiB": peak, "note": f"losses {losses[0]:.4f}.. {note}"})
        if handle is not None:
            handle.restore()
        del optimizer
    return rows


def main(argv=None) -> int:
    from .micro import qlora_rows

    parser = argparse.ArgumentParser(prog="python -m fastplug.bench.qlora")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-micro", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b_4l", help="the end-to-end model")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    parts = (None if args.no_micro else lambda: qlora_rows(device, args.quick),
             None if args.no_e2e else lambda: e2e_rows(device, args.quick, shape=args.shape))
    for part in parts:
        if part is None:
            continue
        try:
            rows += part()
        except Exception as error:  # keep the rows measured so far
            rows.append({"op": "error", "note": f"{type(error).__name__}: {error}"[:300]})
        for r in rows:
            print({k: v for k, v in r.items()}, flush=True)
    columns = ("op", "shape", "impl", "ms", "tok/s", "peak MiB", "peak GiB", "rel err", "note")
    print(markdown_table([{c: fmt(r.get(c)) if c not in ("op", "shape", "impl", "note") else r.get(c, "")
                           for c in columns} for r in rows], columns))
    return 1 if any(r["op"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
