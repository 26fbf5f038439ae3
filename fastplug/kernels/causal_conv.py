"""Causal depthwise 1-D convolution with SiLU, forward and backward: the short convolution of Gated DeltaNet
layers (Qwen3.5, Qwen3-Next), y[b, t, c] = silu(bias[c] + sum_j w[c, j] * x[b, t - (K - 1) + j, c]).

x is read as [B, T, C] (the projection's output as it lies, a column block of a wider one included), so the
(B, C, T) transposes transformers makes around nn.Conv1d are not needed. Tokens before the sequence's start
count as zeros (a prefill from an empty cache).

Forward saves only x. Backward recomputes the pre-activations, writes their gradient (a transient [B, T, C]
buffer in x's dtype, as torch's SiLU backward leaves it) and reduces dw and db, each program walking a range of
token tiles of one channel block with its share in registers and writing one fp32 partial row (a torch sum over
the programs finishes the reduction, no atomics); a second kernel takes dx from the shifted gradient rows.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tuning
from ._utils import (
    cdiv,
    check_dtype,
    check_same_device,
    keep_for_backward,
    kept_for_backward,
    next_power_of_2,
    num_sms,
    use_triton,
)

MAX_KERNEL_SIZE = 8

# ----------------------------------------------------------------------------------------------------
# 1. Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _pre_activation(X, W, B, rows, t, row_mask, cols, col_mask, sx_b, sx_t, seq_len, K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """bias + sum_j w[c, j] x[b, t - (K - 1) + j, c] on an fp32 [rows, cols] tile; rows are flattened (b, t)."""
    b = rows // seq_len
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1) + j
        ok = row_mask & (src >= 0)
        x = tl.load(
            X + (b * sx_b + src * sx_t)[:, None] + cols[None, :], mask=ok[:, None] & col_mask[None, :], other=0.0
        ).to(tl.float32)
        w = tl.load(W + cols * K + j, mask=col_mask, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit(do_not_specialize=["n_rows", "seq_len"])  # a new batch length compiles nothing
def _conv_fwd(
    X, W, B, Y, n_rows, n_cols, seq_len, sx_b, sx_t,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    rows = rows.to(tl.int64)
    t = rows % seq_len
    pre = _pre_activation(
        X, W, B, rows, t, row_mask, cols, col_mask, sx_b, sx_t, seq_len, K, HAS_BIAS, BLOCK_T, BLOCK_C
    )
    y = pre * tl.sigmoid(pre)
    tl.store(
        Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :]
    )


@triton.jit(do_not_specialize=["n_rows", "seq_len"])  # a new batch length compiles nothing
def _conv_bwd_pre(
    DY, X, W, B, DPRE, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols, seq_len, sx_b, sx_t, sdy_t, tiles_per_program,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # dpre[t] = dy[t] * silu'(pre[t]), written for _conv_bwd_dx;  dw[j] = sum_t dpre[t] x[t - (K - 1) + j];
    # db = sum_t dpre[t]. A program walks `tiles_per_program` token tiles of one channel block.
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    dw_acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)  # rows: the K taps (BLOCK_K, a power of two)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    taps = tl.arange(0, BLOCK_K)
    first = tl.program_id(0) * tiles_per_program
    for tile in range(first, first + tiles_per_program):
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row_mask = rows < n_rows
        rows = rows.to(tl.int64)
        t = rows % seq_len
        mask = row_mask[:, None] & col_mask[None, :]
        pre = _pre_activation(X, W, B, rows, t, row_mask, cols, col_mask, sx_b, sx_t, seq_len, K, HAS_BIAS, BLOCK_T,
                              BLOCK_C)  # fmt: skip
        dy = tl.load(DY + rows[:, None] * sdy_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(pre)
        dpre = dy * sig * (1.0 + pre * (1.0 - sig))
        tl.store(DPRE + rows[:, None] * n_cols + cols[None, :], dpre.to(DPRE.dtype.element_ty), mask=mask)
        b = rows // seq_len
        for i in tl.static_range(K):  # the taps' inputs again (L1/L2 hits): fewer registers than keeping them
            src = t - (K - 1) + i
            ok = row_mask & (src >= 0)
            x = tl.load(X + (b * sx_b + src * sx_t)[:, None] + cols[None, :], mask=ok[:, None] & col_mask[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            dw_acc += tl.where(taps[:, None] == i, tl.sum(dpre * x, axis=0)[None, :], 0.0)
        if HAS_BIAS:
            db_acc += tl.sum(dpre, axis=0)
    partial = tl.program_id(0).to(tl.int64) * K * n_cols
    tl.store(
        DW_PARTIAL + partial + cols[None, :] * K + taps[:, None], dw_acc, mask=col_mask[None, :] & (taps < K)[:, None]
    )
    if HAS_BIAS:
        tl.store(DB_PARTIAL + tl.program_id(0).to(tl.int64) * n_cols + cols, db_acc, mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "seq_len"])  # a new batch length compiles nothing
def _conv_bwd_dx(
    DPRE, W, DX, n_rows, n_cols, seq_len,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # dx[s] = sum_j w[j] dpre[s + (K - 1) - j], within s's sequence (dpre: [B * T, C], contiguous)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    rows = rows.to(tl.int64)
    t = rows % seq_len
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        ok = row_mask & (t + (K - 1) - j < seq_len)
        d = tl.load(DPRE + (rows + (K - 1) - j)[:, None] * n_cols + cols[None, :], mask=ok[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(W + cols * K + j, mask=col_mask, other=0.0).to(tl.float32)
        dx += d * w[None, :]
    tl.store(
        DX + rows[:, None] * n_cols + cols[None, :],
        dx.to(DX.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# ----------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """One launch of `_conv_fwd` (and `_conv_bwd_dx`) or of `_conv_bwd_pre`."""

    block_t: int  # tokens per tile
    block_c: int  # channels per tile (a power of two)
    num_warps: int
    programs_per_sm: int  # backward: programs per SM per channel block (each writes one partial row)


@functools.lru_cache(maxsize=64)
def conv_config(n_cols: int, *, backward: bool) -> ConvConfig:
    """Tiles of 16 tokens x up to 128 channels (backward's first kernel: 64, and a few persistent programs per
    channel block walking the token tiles): 94-140 registers a thread and no spills in sm_90's compile (ptxas -v)."""
    block_c = min(128, next_power_of_2(n_cols))
    if backward:
        return ConvConfig(block_t=16, block_c=min(64, block_c), num_warps=4, programs_per_sm=4)
    return ConvConfig(block_t=16, block_c=block_c, num_warps=4, programs_per_sm=0)


def _config(n_cols: int, backward: bool) -> ConvConfig:
    return tuning.pick("causal_conv", conv_config, n_cols, backward=backward)


def _strides(x: torch.Tensor) -> tuple[int, int]:
    return x.stride(0), x.stride(1)


def _conv_forward(x, weight, bias):
    B, T, C = x.shape
    K = weight.shape[1]
    cfg = _config(C, backward=False)
    y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    grid = (cdiv(B * T, cfg.block_t), cdiv(C, cfg.block_c))
    _conv_fwd[grid](
        x, weight, bias if bias is not None else weight, y, B * T, C, T, *_strides(x),
        K=K, HAS_BIAS=bias is not None, BLOCK_T=cfg.block_t, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y


def _conv_backward(dy, x, weight, bias, need_dw: bool):
    """(dx in x's dtype, dw and db in fp32 or None): the pre-activations' gradient (in x's dtype, as torch's SiLU
    backward leaves it) with the weight and bias grads, then dx from it."""
    B, T, C = x.shape
    K = weight.shape[1]
    cfg = _config(C, backward=True)
    dy = dy if dy.stride(-1) == 1 and dy.stride(0) == T * dy.stride(1) else dy.contiguous()
    tiles = cdiv(B * T, cfg.block_t)
    col_blocks = cdiv(C, cfg.block_c)
    programs = max(1, min(tiles, cdiv(num_sms(x.device) * cfg.programs_per_sm, col_blocks)))
    per_program = cdiv(tiles, programs)
    programs = cdiv(tiles, per_program)
    dpre = torch.empty((B * T, C), dtype=x.dtype, device=x.device)
    dw_partial = torch.empty((programs, C, K), dtype=torch.float32, device=x.device)
    db_partial = torch.empty((programs, C), dtype=torch.float32, device=x.device) if bias is not None else None
    _conv_bwd_pre[(programs, col_blocks)](
        dy, x, weight, bias if bias is not None else weight, dpre, dw_partial,
        db_partial if db_partial is not None else dw_partial, B * T, C, T, *_strides(x), dy.stride(1), per_program,
        K=K, BLOCK_K=next_power_of_2(K), HAS_BIAS=bias is not None, BLOCK_T=cfg.block_t, BLOCK_C=cfg.block_c,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    dx = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    fwd = _config(C, backward=False)
    _conv_bwd_dx[(cdiv(B * T, fwd.block_t), cdiv(C, fwd.block_c))](
        dpre, weight, dx, B * T, C, T, K=K, BLOCK_T=fwd.block_t, BLOCK_C=fwd.block_c, num_warps=fwd.num_warps
    )
    dw = dw_partial.sum(0) if need_dw else None
    db = db_partial.sum(0) if db_partial is not None else None
    return dx, dw, db


def _check(x, weight, bias, activation):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a [batch, tokens, channels] tensor; got {getattr(x, 'shape', type(x).__name__)}")
    check_dtype("x", x)
    C = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(
            f"weight must have shape ({C}, kernel_size) (nn.Conv1d's weight squeezed); got "
            f"{tuple(getattr(weight, 'shape', ()))}"
        )
    if not 1 <= weight.shape[1] <= MAX_KERNEL_SIZE:
        raise ValueError(f"kernel_size must be in [1, {MAX_KERNEL_SIZE}]; got {weight.shape[1]}")
    check_dtype("weight", weight)
    if bias is not None:
        check_dtype("bias", bias)
        if tuple(bias.shape) != (C,):
            raise ValueError(f"bias must have shape ({C},); got {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    if activation != "silu":
        raise ValueError(f"activation must be 'silu'; got {activation!r}")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride in its last (channel) dim")


# ----------------------------------------------------------------------------------------------------
# 3. Autograd function
# ----------------------------------------------------------------------------------------------------


class CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        w = weight.contiguous()
        keep_for_backward(ctx, (weight, w, bias))
        ctx.save_for_backward(x)
        return _conv_forward(x, w, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        weight, w, bias = kept_for_backward(ctx)
        dx, dw, db = _conv_backward(dy, x, w, bias, ctx.needs_input_grad[1])
        dw = dw.to(weight.dtype).view(weight.shape) if dw is not None else None
        db = db.to(bias.dtype) if db is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db


# ----------------------------------------------------------------------------------------------------
# 4. Public function and reference
# ----------------------------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    """silu(causal depthwise conv1d) of x [B, T, C] (unit channel stride) with weight [C, K] (and bias [C]); the
    result [B, T, C] in x's dtype, as transformers' `causal_conv1d_fn` on the transposed input, from zeros
    before each sequence."""
    _check(x, weight, bias, activation)
    if x.numel() == 0 or not use_triton(x, weight, bias):
        return causal_conv1d_reference(x, weight, bias, activation)
    if torch.compiler.is_compiling():
        return _causal_conv1d_op(x, weight, bias)
    return CausalConv1d.apply(x, weight, bias)


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    """The same maths as transformers' torch path: nn.functional.conv1d in the weight's dtype, then SiLU."""
    T, C, K = x.shape[1], x.shape[2], weight.shape[1]
    out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=K - 1, groups=C)
    return F.silu(out[:, :, :T]).to(x.dtype).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------
# 5. Registered operator (what torch.compile traces)
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fastplug::causal_conv1d", mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
)
def _causal_conv1d_op(x, weight, bias):
    return _conv_forward(x, weight.contiguous(), bias)


@_causal_conv1d_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape)


@torch.library.custom_op(
    "fastplug::causal_conv1d_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor weight, Tensor? bias) -> (Tensor, Tensor, Tensor)",
)
def _causal_conv1d_backward_op(dy, x, weight, bias):
    dx, dw, db = _conv_backward(dy, x, weight.contiguous(), bias, True)
    return dx, dw.to(weight.dtype).view(weight.shape), x.new_empty(0) if db is None else db.to(bias.dtype)


@_causal_conv1d_backward_op.register_fake
def _(dy, x, weight, bias):
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape),
        x.new_empty(0) if bias is None else bias.new_empty(bias.shape),
    )


def _setup_conv(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _conv_op_backward(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = _causal_conv1d_backward_op(dy, x, weight, bias)
    return dx, dw, db if bias is not None else None


_causal_conv1d_op.register_autograd(_conv_op_backward, setup_context=_setup_conv)
