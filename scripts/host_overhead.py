"""Host time per call of fastplug's ops on a CUDA machine: where a step's Python and dispatch time goes.

At tiny widths the GPU keeps up, so the time per call is the host's (launch, dispatch, autograd, our checks);
at Llama-1B widths it shows whether an op is host-bound. Each row: host µs per call (before the sync) and
wall µs per call (with it). The fused LoRA rows run with separate base matmuls and with stacked bases (one
GEMM per q/k/v or gate/up group, `fastplug.models.stacking`). Run from the repo root on a GPU machine:

    python scripts/host_overhead.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

sys.path.insert(0, ".")
from fastplug.kernels import LoRAProjection, lora_mlp, lora_qkv, rms_norm, rope  # noqa: E402
from fastplug.kernels.attention import flash_attention  # noqa: E402
from fastplug.models import stacking  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU (TRITON_INTERPRET=1): a smoke run of the tiny rows
DT = torch.bfloat16


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


@triton.jit
def _copy(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def per_call_us(fn, n: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter()
    sync()
    return (issued - start) / n * 1e6, (time.perf_counter() - start) / n * 1e6


def projection(out: int, inp: int, rank: int = 16) -> LoRAProjection:
    """A frozen bf16 base with peft's default fp32 adapters."""
    return LoRAProjection(
        torch.randn(out, inp, device=DEV, dtype=DT) * 0.02,
        None,
        (torch.randn(rank, inp, device=DEV) * 0.02).requires_grad_(),
        (torch.randn(out, rank, device=DEV) * 0.02).requires_grad_(),
        1.0,
    )


def lora_rows(batch: int, tokens: int, hidden: int, q_out: int, kv_out: int, inter: int, head_dim: int = 64):
    """Fused LoRA QKV (with RoPE in the node) and MLP, forward+backward, separate and stacked bases."""
    q, k, v = projection(q_out, hidden), projection(kv_out, hidden), projection(kv_out, hidden)
    gate, up, down = projection(inter, hidden), projection(inter, hidden), projection(hidden, inter)
    x = torch.randn(batch, tokens, hidden, device=DEV, dtype=DT, requires_grad=True)
    cos = torch.randn(batch, tokens, head_dim, device=DEV, dtype=DT)
    sin = torch.randn_like(cos)
    attention, mlp = nn.Module(), nn.Module()  # owners of the two stacked groups
    stacking.switch(attention, attention, ())()  # (no module names: the groups are the views below)
    stacking.switch(mlp, mlp, ())()
    qkv_stack, gu_stack = stacking.stacked_base(attention, [q, k, v]), stacking.stacked_base(mlp, [gate, up])
    grads_qkv = [torch.randn(batch, tokens, n, device=DEV, dtype=DT) for n in (q_out, kv_out, kv_out)]
    grad_mlp = torch.randn(batch, tokens, hidden, device=DEV, dtype=DT)

    def qkv(stacked):
        return lambda: torch.autograd.backward(lora_qkv(x, q, k, v, (cos, sin, head_dim), stacked), grads_qkv)

    def mlp_call(stacked):
        return lambda: lora_mlp(x, gate, up, down, stacked=stacked).backward(grad_mlp)

    return [
        ("lora_qkv + RoPE fwd+bwd", qkv(None)),
        ("lora_qkv + RoPE fwd+bwd, stacked bases", qkv(qkv_stack)),
        ("lora_mlp fwd+bwd", mlp_call(None)),
        ("lora_mlp fwd+bwd, stacked bases", mlp_call(gu_stack)),
    ]


def op_rows():
    """Single ops at tiny widths, against torch's dispatch of one op."""
    x = torch.randn(2, 32, 256, device=DEV, dtype=DT, requires_grad=True)
    w = torch.randn(256, device=DEV, dtype=DT, requires_grad=True)
    lin = torch.randn(256, 256, device=DEV, dtype=DT)
    buf = torch.zeros(64, device=DEV)
    q = torch.randn(2, 4, 32, 64, device=DEV, dtype=DT, requires_grad=True)
    k = torch.randn(2, 2, 32, 64, device=DEV, dtype=DT, requires_grad=True)
    v = torch.randn(2, 2, 32, 64, device=DEV, dtype=DT, requires_grad=True)
    cos = torch.randn(2, 32, 64, device=DEV, dtype=DT)
    sin = torch.randn_like(cos)
    return [
        ("torch add", lambda: x + 1),
        ("F.linear", lambda: F.linear(x, lin)),
        ("Triton launch (a 64-element copy)", lambda: _copy[(1,)](buf, 64, BLOCK=64)),
        ("rms_norm fwd", lambda: rms_norm(x, w, 1e-6)),
        ("rms_norm fwd+bwd", lambda: rms_norm(x, w, 1e-6).sum().backward()),
        ("flash_attention fwd+bwd", lambda: flash_attention(q, k, v, causal=True).sum().backward()),
        (
            "SDPA fwd+bwd",
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward(),
        ),
        ("rope fwd+bwd", lambda: sum(t.sum() for t in rope(q, k, cos, sin)).backward()),
    ]


def attention_rows(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int):
    """Causal GQA attention forward and fwd+bwd through SDPA with torch's choice of backend (what the dispatcher
    calls; cuDNN on Hopper), SDPA with FlashAttention-2 forced, and the Triton kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = sys.modules["fastplug.kernels.attention"]  # (the package's `attention` is the function)
    q = torch.randn(batch, heads, tokens, head_dim, device=DEV, dtype=DT, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, tokens, head_dim, device=DEV, dtype=DT, requires_grad=True) for _ in "kv")
    grad = torch.randn(batch, tokens, heads, head_dim, device=DEV, dtype=DT)
    scale = head_dim**-0.5

    def sdpa():
        return kernels._sdpa(q, k, v, True, scale)

    def flash2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa()

    def triton_kernel():
        return kernels.FlashAttention.apply(q, k, v, kernels._problem(q, k, True, None, None, scale), None, None)

    rows = []
    for name, fn in (
        ("SDPA, torch's choice", sdpa),
        ("SDPA, FlashAttention-2 forced", flash2),
        ("Triton flash kernel", triton_kernel),
    ):
        rows += [(f"attention fwd, {name}", fn), (f"attention fwd+bwd, {name}", lambda fn=fn: fn().backward(grad))]
    return rows


def main() -> None:
    calls = 300 if DEV == "cuda" else 3
    rows = [("tiny", name, *per_call_us(fn, calls)) for name, fn in op_rows()]
    shapes = [("tiny", (2, 32, 256, 256, 64, 512), calls)]
    if DEV == "cuda":
        shapes.append(("Llama-1B 4x2048", (4, 2048, 2048, 2048, 512, 8192), 30))
    for label, shape, n in shapes:
        rows += [(label, name, *per_call_us(fn, n)) for name, fn in lora_rows(*shape)]
    if DEV == "cuda":
        rows += [("Llama-1B 4x2048", name, *per_call_us(fn, 30)) for name, fn in attention_rows(4, 2048, 32, 8, 64)]
    print("\n| widths | op | host µs per call | wall µs per call |\n|---|---|---|---|")
    for label, name, host, wall in rows:
        print(f"| {label} | {name} | {host:,.1f} | {wall:,.1f} |")


if __name__ == "__main__":
    main()
