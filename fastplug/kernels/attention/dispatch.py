"""The public entry points: `attention` (checks its arguments; flash-attn's cu_seqlens for packed rows) and
`flash_attention` (no checks, for callers that built their arguments, the model integration), and the choice of
what runs.

`attention` dispatches: torch SDPA (cuDNN / flash) where it covers the case and measured faster (plain
causal or full attention on CUDA in bf16/fp16, no softcap, no window, not packed), the Triton kernel
otherwise; the torch reference on tensors Triton cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._utils import use_triton
from .config import _check_inputs, _problem
from .ops import FlashAttention, _flash_attention_op
from .reference import _reference
from .varlen import bounds_from_cu_seqlens


def _normalise_window(window: int | None, causal: bool, T: int, S: int) -> int | None:
    """None where the window hides nothing (so the cheaper kernels and SDPA stay eligible)."""
    if window is None:
        return None
    if causal and window >= S:
        return None
    if not causal and window >= max(T, S):
        return None
    return window


def _sdpa_suits(q, k, causal, window, softcap, varlen, sinks=None) -> bool:
    """SDPA covers plain causal (T == S) or full attention without sinks; measured faster there (`python -m
    fastplug.bench micro`)."""
    return (
        sinks is None
        and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and softcap is None
        and window is None
        and not varlen
        and (not causal or q.shape[2] == k.shape[2])
        and q.shape[3] <= 256
    )


def _sdpa(q, k, v, causal, scale):
    # torch's own backend choice (cuDNN on Hopper): FlashAttention-2 forced instead cost the host the same and
    # the GPU more (`python scripts/host_overhead.py`; docs/benchmarks/kernels.md, "attention, host and layout notes").
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def flash_attention(
    q, k, v, *, causal=True, sliding_window=None, softcap=None, scale=None, doc_start=None, doc_end=None, sinks=None
) -> torch.Tensor:
    """The dispatcher without the input checks, for callers that built their arguments (the model
    integration): per-token document bounds (B, T) int32 from `packed_bounds`, or None; sinks (Hq,) or None."""
    if torch.is_autocast_enabled(q.device.type):  # like SDPA under autocast: compute in the autocast dtype
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    T, S = q.shape[2], k.shape[2]
    scale = float(q.shape[3] ** -0.5 if scale is None else scale)
    window = _normalise_window(sliding_window, causal, T, S)
    softcap = None if softcap is None else float(softcap)
    varlen = doc_start is not None
    if not use_triton(q, k, v):
        return _reference(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks)
    if _sdpa_suits(q, k, causal, window, softcap, varlen, sinks):
        return _sdpa(q, k, v, causal, scale)
    if T == 0 or S == 0:
        return q.new_zeros(q.shape[0], T, q.shape[1], q.shape[3])
    if torch.compiler.is_compiling():
        return _flash_attention_op(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks)[0]
    return FlashAttention.apply(q, k, v, _problem(q, k, causal, window, softcap, scale), doc_start, doc_end, sinks)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [softcapped] [masked]) v for q (B, Hq, T, D), k/v (B, Hkv, S, D); returns
    (B, T, Hq, D). Hq % Hkv == 0 (GQA/MQA), head_dim up to 256, fp32/fp16/bf16 with fp32 accumulation.

    causal: query i sees keys j <= i + S - T (bottom-right aligned). sliding_window W: causal keys with
    i - W < j <= i (transformers' convention); not causal, |i - j| <= W. softcap c: scores become
    c * tanh(scores / c) before the softmax (Gemma2). scale: default head_dim ** -0.5.
    cu_seqlens (int32, n + 1): q/k/v are packed rows (1, H, total, D) of n documents that never attend to each
    other; max_seqlen is accepted for flash-attn compatibility and not needed (the grid covers the packed row).
    Checking cu_seqlens syncs with the host once; `flash_attention` with `packed_bounds` does not.
    sinks (Hq,), any float dtype: per-head logits that join each row's softmax denominator (gpt-oss), differentiable.
    """
    _check_inputs(q, k, v, causal, sliding_window, softcap, scale, cu_seqlens, max_seqlen, sinks)
    start = end = None
    if cu_seqlens is not None:
        start, end = bounds_from_cu_seqlens(cu_seqlens, q.shape[2])
    return flash_attention(
        q,
        k,
        v,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        scale=scale,
        doc_start=start,
        doc_end=end,
        sinks=sinks,
    )
