"""The decode step's two small kernels around the GEMVs and the attention: `add_rms_norm` (h += RMSNorm(y), Gemma2/3's
norm of a sub-block's output before the residual add; `gemv` also normalises x once through it) and `greedy_emit`
(argmax and the step's bookkeeping in one launch)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, interpreter_enabled, next_power_of_2, use_triton
from ..jit_helpers import rms_weight
from .config import Norm, Rows, rows_of


# ---------------------------------------------------------------------------------------- add + RMSNorm
@triton.jit
def _add_rms_norm_kernel(h, y, norm, N, GEMMA_NORM: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr = True):
    """h += RMSNorm(y) a row (ADD), or h = RMSNorm(y); h, y: `Rows`, norm: a `Norm`, N columns."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    yv = tl.load(y.ptr + row * y.stride + cols, mask=mask, other=0.0)
    dt = yv.dtype
    yf = yv.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=0) / N + norm.eps)
    w = tl.load(norm.weight + cols, mask=mask, other=0.0).to(tl.float32)
    normed = rms_weight(yf * rstd, w, norm.offset, dt, GEMMA_NORM)
    if ADD:
        hv = tl.load(h.ptr + row * h.stride + cols, mask=mask, other=0.0)
        normed = (hv.to(tl.float32) + normed.to(tl.float32)).to(dt)
    tl.store(h.ptr + row * h.stride + cols, normed, mask=mask)


def add_rms_norm(h: torch.Tensor, y: torch.Tensor, norm: tuple) -> torch.Tensor:
    """h += RMSNorm(y) in place (h, y [M, N]); norm (weight [N], eps, offset) as in `gemv`."""
    if not torch.is_tensor(h) or not torch.is_tensor(y) or h.dim() != 2 or y.shape != h.shape:
        raise ValueError(
            f"h and y must be 2-D tensors of one shape; got {getattr(h, 'shape', None)} and {getattr(y, 'shape', None)}"
        )
    if h.dtype != y.dtype:
        raise ValueError(f"y must have h's dtype {h.dtype}; got {y.dtype}")
    check_dtype("h", h)
    weight, eps, offset = norm
    if weight.shape != (h.shape[1],):
        raise ValueError(f"norm weight must have shape ({h.shape[1]},); got {tuple(weight.shape)}")
    if h.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("h and y must be contiguous along their last dimension")
    if not use_triton(h, y):
        from ..norms import rms_norm_reference

        h.copy_(h + rms_norm_reference(y, weight, eps, offset))
        return h
    return launch_rms_norm(h, y, norm, add=True)


def launch_rms_norm(h: torch.Tensor, y: torch.Tensor, norm: tuple, add: bool) -> torch.Tensor:
    """h (+)= RMSNorm(y) by `_add_rms_norm_kernel`, the arguments checked by the caller."""
    weight, eps, offset = norm
    _add_rms_norm_kernel[(h.shape[0],)](
        rows_of(h),
        rows_of(y),
        Norm(weight, float(eps), float(offset)),
        h.shape[1],
        GEMMA_NORM=float(offset) != 0.0,
        BLOCK=next_power_of_2(h.shape[1]),
        ADD=add,
        num_warps=8,
    )
    return h


# ------------------------------------------------------------------------------------ greedy step emit
class EmitState(NamedTuple):
    """What `_greedy_emit_kernel` updates, in order (device tensors)."""

    finished: torch.Tensor  # [B] int8 (the bool flags)
    done_at: torch.Tensor  # [B] the step each row finished at
    count: torch.Tensor  # [1] this step's output column
    eos: torch.Tensor  # [N_EOS] the stop tokens (-1: unused entries)
    pad: torch.Tensor  # [1] the token of finished rows
    out: Rows  # [B, length] the generated tokens
    tok: torch.Tensor  # [B] the next input token
    pos: torch.Tensor  # [B] the next position


@triton.jit
def _greedy_emit_kernel(logits, V, s, N_EOS, BLOCK_EOS: tl.constexpr, BLOCK: tl.constexpr):
    """Row b's argmax over logits (`Rows`, V columns) and its step's bookkeeping in `s` (an `EmitState`)."""
    b = tl.program_id(0)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    idx = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits.ptr + b * logits.stride + cols, mask=cols < V, other=float("-inf"))
        x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest, as torch.argmax's does
        take = x > best  # strictly: the first index of the maximum stays
        idx = tl.where(take, cols, idx)
        best = tl.where(take, x, best)
    top = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == top, idx, 2147483647), axis=0)
    arg = tl.where(arg == 2147483647, 0, arg)
    fin = tl.load(s.finished + b) != 0
    count = tl.load(s.count)
    token = tl.where(fin, tl.load(s.pad), arg.to(tl.int64))
    e = tl.arange(0, BLOCK_EOS)
    eos = tl.load(s.eos + e, mask=e < N_EOS, other=-1)
    newly = (fin == 0) & (tl.sum((eos == token).to(tl.int32), axis=0) > 0)
    done = tl.load(s.done_at + b)
    tl.store(s.done_at + b, tl.where(newly, count, done))
    tl.store(s.finished + b, (fin | newly).to(tl.int8))
    tl.store(s.out.ptr + b * s.out.stride + count, token)
    tl.store(s.tok + b, token)
    tl.store(s.pos + b, tl.load(s.pos + b) + 1)


def greedy_emit(logits, finished, done_at, count, eos, pad, out, tok, pos) -> None:
    """One greedy decode step's bookkeeping for B rows, in place: token = argmax(logits) (pad where the row
    finished); a row whose token is in `eos` (-1: unused entries) finishes with done_at = count;
    out[:, count] = tok = token; pos += 1. count (1 element) is left to the caller to advance."""
    if not torch.is_tensor(logits) or logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be a 2-D float32 tensor with contiguous rows; got {getattr(logits, 'dtype', None)}"
        )
    b = logits.shape[0]
    if finished.dtype != torch.bool or finished.shape != (b,):
        raise ValueError(f"finished must be a bool tensor ({b},); got {finished.dtype} {tuple(finished.shape)}")
    for name, t, shape in (
        ("done_at", done_at, (b,)),
        ("tok", tok.reshape(-1), (b,)),
        ("pos", pos.reshape(-1), (b,)),
        ("count", count.reshape(-1), (1,)),
        ("pad", pad.reshape(-1), (1,)),
    ):
        if t.dtype != torch.long or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be an int64 tensor of shape {shape}; got {t.dtype} {tuple(t.shape)}")
    if eos.dtype != torch.long or eos.dim() != 1 or out.dtype != torch.long or out.shape[0] != b:
        raise ValueError("eos must be a 1-D int64 tensor and out an int64 tensor [B, length]")
    if not (tok.is_contiguous() and pos.is_contiguous() and eos.is_contiguous()):
        raise ValueError("tok, pos and eos must be contiguous")
    if not use_triton(logits):
        token = torch.where(finished, pad.reshape(()), logits.argmax(-1))
        newly = ~finished & (token[:, None] == eos).any(-1)
        done_at.copy_(torch.where(newly, count, done_at))
        finished.logical_or_(newly)
        out.index_copy_(1, count.reshape(1), token[:, None])
        tok.copy_(token.view(tok.shape))
        pos.add_(1)
        return
    state = EmitState(finished.view(torch.int8), done_at, count, eos, pad, rows_of(out), tok, pos)
    _greedy_emit_kernel[(b,)](
        rows_of(logits),
        logits.shape[1],
        state,
        eos.numel(),
        BLOCK_EOS=max(2, next_power_of_2(eos.numel())),
        BLOCK=2048 if not interpreter_enabled() else 64,
        num_warps=8,
    )
