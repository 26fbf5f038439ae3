"""The torch reference (plain torch, fp32 math; float64 inputs are computed in float64, the full T x S matrix):
the path on tensors Triton cannot run, and the tests' oracle. `visible_keys` spells out the rule the kernels
apply (`tiles._row_bounds`)."""

from __future__ import annotations

import torch

from .config import _check_inputs
from .varlen import bounds_from_cu_seqlens


def visible_keys(
    T: int, S: int, causal: bool, window: int | None, doc_start=None, doc_end=None, device=None
) -> torch.Tensor:
    """Boolean (B or 1, 1, T, S): which keys each query sees; the rule the kernel applies, spelled out."""
    i = torch.arange(T, device=device)[:, None] + (S - T if causal else 0)
    j = torch.arange(S, device=device)[None, :]
    seen = torch.ones((T, S), dtype=torch.bool, device=device)
    if causal:
        seen &= j <= i
        if window is not None:
            seen &= j > i - window
    elif window is not None:
        seen &= (i - j).abs() <= window
    seen = seen[None, None]
    if doc_start is not None:
        seen = seen & (j[None, None] >= doc_start[:, None, :, None]) & (j[None, None] < doc_end[:, None, :, None])
    return seen


def _reference(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks=None):
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    qf = q.to(compute)
    kf = k.to(compute).repeat_interleave(group, dim=1)
    vf = v.to(compute).repeat_interleave(group, dim=1)
    scores = qf @ kf.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = visible_keys(q.shape[2], k.shape[2], causal, window, doc_start, doc_end, q.device)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:  # one more column per row: the sink's logit, dropped after the softmax
        column = sinks.to(compute)[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs @ vf
    return out.transpose(1, 2).to(q.dtype)


def attention_reference(
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
    """`attention` in plain torch (fp32 math, the full T x S matrix); same arguments and result."""
    _check_inputs(q, k, v, causal, sliding_window, softcap, scale, cu_seqlens, max_seqlen, sinks)
    start = end = None
    if cu_seqlens is not None:
        start, end = bounds_from_cu_seqlens(cu_seqlens, q.shape[2])
    scale = float(q.shape[3] ** -0.5 if scale is None else scale)
    return _reference(q, k, v, causal, sliding_window, softcap, scale, start, end, sinks)
