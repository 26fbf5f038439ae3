"""The gated activation of expert rows: h = act(gate) * up over the [gate, up] rows the gate_up GEMM makes.

What differs between MoE families is one spec, `GluSpec`, which every kernel applying it (the gate_up GEMM's
epilogue, `_glu_rows` here) reads through constexpr flags:
- the activation: silu, gelu_tanh, gelu (act(x) = x p(x), `jit_helpers.gate_factor`), or gpt-oss's clamped SwiGLU
  h = (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g) with g = min(gate, limit); the clamps' gradients are zero
  outside them, as torch.clamp's;
- the columns of a row: [gate | up] halves (transformers' concatenated gate_up_proj) or interleaved (gpt-oss: gate c
  at column 2c, up c at 2c + 1). Rows keep the weight's own column order, so the gradient rows need no reordering
  for dW, dX or the bias.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._utils import cdiv, next_power_of_2
from ..activations import ACTIVATIONS, gate_factor_torch
from ..jit_helpers import gate_factor, sigmoid_and_slope

MOE_ACTIVATIONS = ACTIVATIONS + ("clamped_swiglu",)
_CLAMPED = MOE_ACTIVATIONS.index("clamped_swiglu")
_BLOCK_ROWS = 16
_MAX_BLOCK_I = 256


class GluSpec(NamedTuple):
    """The gated activation of the experts (see the module docstring); build it with `glu_spec`."""

    act: int  # index into MOE_ACTIVATIONS
    interleaved: bool = False
    alpha: float = 1.0  # clamped_swiglu: the sigmoid's slope
    limit: float = 0.0  # clamped_swiglu: gate <= limit, |up| <= limit

    @property
    def name(self) -> str:
        return MOE_ACTIVATIONS[self.act]


def glu_spec(activation: str, *, interleaved: bool = False, alpha: float | None = None, limit: float | None = None):
    """A checked GluSpec: alpha and limit are clamped_swiglu's (both required there, refused elsewhere)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}; got {activation!r}")
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be a bool; got {interleaved!r}")
    clamped = activation == "clamped_swiglu"
    for name, x in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if clamped and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0):
            raise ValueError(f"{name} must be a finite number > 0 for clamped_swiglu; got {x!r}")
        if not clamped and x is not None:
            raise ValueError(f"{name} applies to activation 'clamped_swiglu' only; got it with {activation!r}")
    if clamped:
        return GluSpec(_CLAMPED, interleaved, float(alpha), float(limit))
    return GluSpec(MOE_ACTIVATIONS.index(activation), interleaved)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def glu_columns(cols, I, INTERLEAVED: tl.constexpr):
    """The columns of gate c and up c in a [gate, up] row of width 2I."""
    if INTERLEAVED:
        return 2 * cols, 2 * cols + 1
    return cols, cols + I


@triton.jit
def glu_terms(x, u, ACT: tl.constexpr, alpha, limit):
    """(h, dh/dgate, dh/dup) for fp32 gate x and up u (a forward kernel drops the derivatives' maths)."""
    if ACT == 3:  # clamped_swiglu (gpt-oss)
        g = tl.minimum(x, limit)
        s, ds = sigmoid_and_slope(alpha * g)
        act = g * s
        up = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        d_gate = tl.where(x <= limit, up * (s + alpha * g * ds), 0.0)
        d_up = tl.where((u >= -limit) & (u <= limit), act, 0.0)
        return act * up, d_gate, d_up
    p, dp = gate_factor(x, ACT)
    act = x * p
    return act * u, u * (p + x * dp), act


@triton.jit(do_not_specialize=["M"])  # a new batch length compiles nothing
def _glu_rows(
    dh_ptr,
    gu_ptr,
    rw_ptr,
    dgu_ptr,
    drw_ptr,
    M,
    I,
    stride_dh,
    stride_gu,
    stride_dgu,
    alpha,
    limit,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """gu: [gate, up] rows [M, 2I]. Forward (BACKWARD off): h [M, I] into dh_ptr's buffer. Backward: dh is
    d(unweighted h) [M, I]; writes dgu = rw * d[gate, up] (gu's column order), drw = <dh, h> and (STORE_H) h into
    dh's buffer (each element is read before this program overwrites it)."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = rows < M
    if BACKWARD:
        rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        dot = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_I):
        cols = c0 + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols[None, :] < I)
        gate_col, up_col = glu_columns(cols, I, INTERLEAVED)
        x = tl.load(gu_ptr + rows[:, None] * stride_gu + gate_col[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rows[:, None] * stride_gu + up_col[None, :], mask=mask, other=0.0).to(tl.float32)
        h, d_gate, d_up = glu_terms(x, u, ACT, alpha, limit)
        h_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        if BACKWARD:
            g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(g * h, 1)
            if STORE_H:
                tl.store(h_ptrs, h.to(dh_ptr.dtype.element_ty), mask=mask)
            gw = g * rw[:, None]
            dgu_row = dgu_ptr + rows[:, None] * stride_dgu
            tl.store(dgu_row + gate_col[None, :], (gw * d_gate).to(dgu_ptr.dtype.element_ty), mask=mask)
            tl.store(dgu_row + up_col[None, :], (gw * d_up).to(dgu_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(h_ptrs, h.to(dh_ptr.dtype.element_ty), mask=mask)
    if BACKWARD:
        tl.store(drw_ptr + rows, dot, mask=row_ok)


# --------------------------------------------------------------------------------------------- launchers
def _launch(dh, gu, rw, dgu, drw, spec: GluSpec, backward: bool, store_h: bool) -> None:
    M, I = dh.shape
    if M and I:
        _glu_rows[(cdiv(M, _BLOCK_ROWS),)](
            dh,
            gu,
            rw,
            dgu,
            drw,
            M,
            I,
            dh.stride(0),
            gu.stride(0),
            dgu.stride(0),
            spec.alpha,
            spec.limit,
            ACT=spec.act,
            INTERLEAVED=spec.interleaved,
            BACKWARD=backward,
            STORE_H=store_h,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_I=min(_MAX_BLOCK_I, next_power_of_2(I)),
        )


def glu_rows_forward(gu: torch.Tensor, spec: GluSpec) -> torch.Tensor:
    """h [M, I] in gu's dtype from [gate, up] rows gu [M, 2I] (unit column stride); no autograd."""
    M, I = gu.shape[0], gu.shape[1] // 2
    h = torch.empty((M, I), dtype=gu.dtype, device=gu.device)
    _launch(h, gu, h, h, h, spec, backward=False, store_h=False)
    return h


def glu_rows_backward(dh: torch.Tensor, gu: torch.Tensor, rw: torch.Tensor, spec: GluSpec, store_h: bool = True):
    """(dgu, h, drw): dgu = rw * d[gate, up] in gu's column order, drw = <dh, h> (fp32); h is written into dh's
    buffer (owned by the caller) when store_h, else h is None."""
    dgu = torch.empty_like(gu)
    drw = torch.empty(dh.shape[0], dtype=torch.float32, device=dh.device)
    _launch(dh, gu, rw, dgu, drw, spec, backward=True, store_h=store_h)
    return dgu, (dh if store_h else None), drw


def glu_rows_reference(gu: torch.Tensor, spec: GluSpec) -> torch.Tensor:
    """h for [gate, up] rows gu in plain torch (in gu's dtype, at least fp32 maths for 16-bit inputs)."""
    I = gu.shape[-1] // 2
    gate, up = (gu[..., 0::2], gu[..., 1::2]) if spec.interleaved else (gu[..., :I], gu[..., I:])
    x, u = gate.to(torch.promote_types(gu.dtype, torch.float32)), up.to(torch.promote_types(gu.dtype, torch.float32))
    if spec.act == _CLAMPED:
        g = x.clamp(max=spec.limit)
        h = g * torch.sigmoid(spec.alpha * g) * (u.clamp(-spec.limit, spec.limit) + 1)
    else:
        h = x * gate_factor_torch(x, spec.name)[0] * u
    return h.to(gu.dtype)
