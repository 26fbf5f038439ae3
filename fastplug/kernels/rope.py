"""Rotary position embedding with Hugging Face's rotate-half layout: x * cos + rotate_half(x) * sin.

q [B, Hq, T, D] and k [B, Hk, T, D] are usually `proj(x).view(B, T, H, D).transpose(1, 2)`: non-contiguous,
so the kernel reads and writes through the batch/head/token strides and the outputs keep the inputs' layout.
cos/sin are what the model's rotary embedding returns: [B, T, Dr] (B may be 1) or [T, Dr]. With Dr < D only the
first Dr dims rotate and the rest pass through (partial rotary).

One launch covers q and k: a program takes a block of tokens of one sequence, loads their cos/sin once and
applies them to every head of q and then of k (GQA: Hq != Hk). The backward is the same kernel: with
y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (halves 1, 2 of the rotated dims) the transpose is
dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1, i.e. the sine multipliers swap halves and change sign.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from . import tuning
from ._utils import (
    cdiv,
    check_dtype,
    check_same_device,
    keep_for_backward,
    kept_for_backward,
    made_by_autograd,
    next_power_of_2,
    promote_types,
    use_triton,
)

MAX_HEAD_DIM = 512


@dataclasses.dataclass(frozen=True)
class RopeConstants:
    """The constants `rope_config` builds a launch from (the defaults are what runs; scripts/tune_kernels.py
    measures others through `tuning.override("rope", functools.partial(rope_config, constants=...))`).

    A program covers BLOCK_T tokens x BLOCK_H heads x half a rotary dim at a time, about tile_elements
    elements per half; max_block_heads (a power of two, 0: no cap) caps BLOCK_H. split_heads gives every
    head block of q and of k its own program (grid axis 2) instead of one program walking q's heads then k's."""

    # split heads, 8192-element tiles, 8 warps: the fastest fwd+bwd of scripts/tune_kernels.py --ops rope
    # (docs/benchmarks/kernels.md, "rope")
    tile_elements: int = 8192
    num_warps: int = 8
    max_block_heads: int = 0
    split_heads: bool = True


ROPE_CONSTANTS = RopeConstants()


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One launch of `_rope_kernel`."""

    block_t: int  # tokens a program
    block_hq: int  # q heads a step (a power of two)
    block_hk: int  # k heads a step
    half_block: int  # half the rotary dim, padded to a power of two
    split_heads: bool  # a program per head block (grid axis 2) instead of one walking all heads
    num_warps: int


def rope_config(
    n_heads_q: int,
    n_heads_k: int,
    tokens: int,
    rot_dim: int,
    dtype: torch.dtype | None = None,
    *,
    constants: RopeConstants | None = None,
) -> RopeConfig:
    """The launch for q [B, n_heads_q, tokens, D] and k [B, n_heads_k, tokens, D] rotated over rot_dim dims."""
    tune = constants or ROPE_CONSTANTS
    half_block = next_power_of_2(rot_dim // 2)
    heads_cap = max(1, tune.tile_elements // half_block)
    if tune.max_block_heads:
        heads_cap = min(heads_cap, tune.max_block_heads)
    block_hq = min(next_power_of_2(max(n_heads_q, 1)), heads_cap)
    block_hk = min(next_power_of_2(max(n_heads_k, 1)), heads_cap)
    block_t = min(max(1, tune.tile_elements // (block_hq * half_block)), next_power_of_2(tokens))
    return RopeConfig(block_t, block_hq, block_hk, half_block, tune.split_heads, tune.num_warps)


class Operand(NamedTuple):
    """q, k or an output [B, H, T, D] as the kernel reads or writes it: its pointer and its batch, head and token
    strides (the head dim's is 1)."""

    ptr: torch.Tensor
    stride_b: int
    stride_h: int
    stride_t: int


class Angles(NamedTuple):
    """cos and sin [B or 1, T, Dr], read with one pair of strides (stride_b 0: one table for every sequence)."""

    cos: torch.Tensor
    sin: torch.Tensor
    stride_b: int
    stride_t: int


class HeadDims(NamedTuple):
    """Constexpr: the dims of a head, the first ROT_DIM rotating in two halves of HALF, the rest copied; HALF_BLOCK
    and PASS_BLOCK are those two widths padded to powers of two."""

    HALF: int
    ROT_DIM: int
    HEAD_DIM: int
    HALF_BLOCK: int
    PASS_BLOCK: int


class Tile(NamedTuple):
    """Constexpr: tokens a program, q and k heads a step, and whether each head block has its own program."""

    BLOCK_T: int
    BLOCK_HQ: int
    BLOCK_HK: int
    SPLIT_HEADS: bool


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _rotate_heads(X, Y, b, t, t_mask, h_start, h_end, c1, c2, m1, m2, DIMS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Y = rotate(X) (`Operand`s) for heads [h_start, h_end) at tokens t [BLOCK_T, 1, 1]; c*/m* are
    [BLOCK_T, 1, HALF_BLOCK]; DIMS: `HeadDims`."""
    HALF: tl.constexpr = DIMS.HALF
    ROT_DIM: tl.constexpr = DIMS.ROT_DIM
    HEAD_DIM: tl.constexpr = DIMS.HEAD_DIM
    HALF_BLOCK: tl.constexpr = DIMS.HALF_BLOCK
    PASS_BLOCK: tl.constexpr = DIMS.PASS_BLOCK
    d = tl.arange(0, HALF_BLOCK)[None, None, :]
    x_base = X.ptr + b * X.stride_b + t * X.stride_t
    y_base = Y.ptr + b * Y.stride_b + t * Y.stride_t
    for h0 in range(h_start, h_end, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        row_mask = t_mask & (h < h_end)
        x_row = x_base + h * X.stride_h
        y_row = y_base + h * Y.stride_h
        mask = row_mask & (d < HALF)
        x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + d, (x1 * c1 + x2 * m1).to(Y.ptr.dtype.element_ty), mask=mask)
        tl.store(y_row + HALF + d, (x2 * c2 + x1 * m2).to(Y.ptr.dtype.element_ty), mask=mask)
        if ROT_DIM < HEAD_DIM:  # dims past the rotary ones are copied unchanged
            p = ROT_DIM + tl.arange(0, PASS_BLOCK)[None, None, :]
            pass_mask = row_mask & (p < HEAD_DIM)
            x_pass = tl.load(x_row + p, mask=pass_mask, other=0.0)
            tl.store(y_row + p, x_pass.to(Y.ptr.dtype.element_ty), mask=pass_mask)


@triton.jit(do_not_specialize=["n_tokens"])  # a new batch length compiles nothing
def _rope_kernel(
    Q,
    K,
    Q_OUT,
    K_OUT,
    CS,
    n_tokens,
    n_heads_q,
    n_heads_k,
    DIMS: tl.constexpr,
    TILE: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Q, K, Q_OUT, K_OUT: `Operand`s; CS: `Angles`; DIMS, TILE: `HeadDims`, `Tile`. BACKWARD: the transpose (the
    sine multipliers swap halves and change sign)."""
    # constexpr fields bound by name: Triton 3.6 hands a tuple's field on as a plain value (docs/contributing.md)
    HALF: tl.constexpr = DIMS.HALF
    HALF_BLOCK: tl.constexpr = DIMS.HALF_BLOCK
    BLOCK_T: tl.constexpr = TILE.BLOCK_T
    BLOCK_HQ: tl.constexpr = TILE.BLOCK_HQ
    BLOCK_HK: tl.constexpr = TILE.BLOCK_HK
    b = tl.program_id(1).to(tl.int64)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    t_mask = t < n_tokens
    d = tl.arange(0, HALF_BLOCK)[None, None, :]
    cs_mask = t_mask & (d < HALF)
    cs_offset = b * CS.stride_b + t * CS.stride_t + d
    c1 = tl.load(CS.cos + cs_offset, mask=cs_mask, other=0.0).to(tl.float32)
    c2 = tl.load(CS.cos + cs_offset + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    s1 = tl.load(CS.sin + cs_offset, mask=cs_mask, other=0.0).to(tl.float32)
    s2 = tl.load(CS.sin + cs_offset + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        m1 = s2
        m2 = -s1
    else:
        m1 = -s1
        m2 = s2
    # Heads [q_start, q_end) of q and [k_start, k_end) of k: all of both, or (SPLIT_HEADS) one block of one.
    q_start = 0
    q_end = n_heads_q
    k_start = 0
    k_end = n_heads_k
    if TILE.SPLIT_HEADS:
        block = tl.program_id(2)
        n_blocks_q = tl.cdiv(n_heads_q, BLOCK_HQ)
        q_start = tl.minimum(block * BLOCK_HQ, n_heads_q)
        q_end = tl.minimum(q_start + BLOCK_HQ, n_heads_q)
        k_start = tl.maximum(block - n_blocks_q, 0) * BLOCK_HK
        k_end = tl.where(block >= n_blocks_q, tl.minimum(k_start + BLOCK_HK, n_heads_k), 0)
    _rotate_heads(Q, Q_OUT, b, t, t_mask, q_start, q_end, c1, c2, m1, m2, DIMS, BLOCK_HQ)
    _rotate_heads(K, K_OUT, b, t, t_mask, k_start, k_end, c1, c2, m1, m2, DIMS, BLOCK_HK)


# --------------------------------------------------------------------------------------------- launchers
def _check_inputs(q, k, cos, sin) -> None:
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, tokens, head_dim]; got shape {tuple(x.shape)}")
        check_dtype(name, x)
    check_dtype("cos", cos)
    check_dtype("sin", sin)
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}; got {k.dtype}")
    if sin.dtype != cos.dtype:
        raise ValueError(f"sin must have cos's dtype {cos.dtype}; got {sin.dtype}")
    batch, _, tokens, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, tokens, head_dim):
        raise ValueError(
            f"k must have q's batch, tokens and head_dim ({batch}, {tokens}, {head_dim}) in dims 0, 2, 3; "
            f"got shape {tuple(k.shape)}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be at most {MAX_HEAD_DIM}; got {head_dim}")
    if cos.dim() not in (2, 3) or cos.shape[-2] != tokens or (cos.dim() == 3 and cos.shape[0] not in (1, batch)):
        raise ValueError(
            f"cos must have shape [{batch} or 1, {tokens}, rotary_dim] or [{tokens}, rotary_dim]; "
            f"got {tuple(cos.shape)}"
        )
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise ValueError(f"cos's last dim (rotary_dim) must be even and in [2, head_dim={head_dim}]; got {rot_dim}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}; got {tuple(sin.shape)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _empty_in_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor shaped like x [B, H, T, D] with x's order of batch/head/token strides and unit D stride."""
    order = sorted(range(3), key=lambda i: x.stride(i), reverse=True) + [3]
    out = torch.empty([x.shape[i] for i in order], dtype=dtype, device=x.device)
    return out.permute([order.index(i) for i in range(4)])


def _operand(x: torch.Tensor) -> Operand:
    return Operand(x, x.stride(0), x.stride(1), x.stride(2))


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> Angles:
    """cos and sin with cos's strides (sin's are the same); batch stride 0 for a [T, Dr] or [1, T, Dr] table."""
    if cos.dim() == 2 or cos.shape[0] == 1:
        return Angles(cos, sin, 0, cos.stride(-2))
    return Angles(cos, sin, cos.stride(0), cos.stride(1))


def _launch_args(head_dim: int, rot_dim: int, cfg: RopeConfig, backward: bool) -> dict:
    """The constexprs of a launch over heads of head_dim dims, the first rot_dim rotating: DIMS, TILE, BACKWARD."""
    return dict(
        DIMS=HeadDims(rot_dim // 2, rot_dim, head_dim, cfg.half_block, next_power_of_2(max(head_dim - rot_dim, 1))),
        TILE=Tile(cfg.block_t, cfg.block_hq, cfg.block_hk, cfg.split_heads),
        BACKWARD=backward,
    )


def _rope_launch(
    q, k, cos, sin, q_dtype, k_dtype, backward: bool, out: tuple | None = None, config: RopeConfig | None = None
):
    """out: (q_out, k_out) to write, in q and k's shapes with unit last stride (q and k themselves: in place, for
    a caller that owns them); q_dtype/k_dtype are then theirs."""
    if out is not None and any(t.stride(-1) != 1 for t in out):
        raise ValueError("RoPE into given buffers needs buffers with unit last stride")
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    cos, sin = _unit_last_stride(cos), _unit_last_stride(sin)
    if cos.stride() != sin.stride():  # the kernel reads both with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    if out is not None:  # in place too: each program loads both halves of its rows before it stores them
        q_out, k_out = out
    else:
        q_out, k_out = _empty_in_layout(q, q_dtype), _empty_in_layout(k, k_dtype)
    batch, n_heads_q, tokens, head_dim = q.shape
    n_heads_k = k.shape[1]
    if q.numel() + k.numel() == 0:
        return q_out, k_out
    rot_dim = cos.shape[-1]
    cfg = config or tuning.pick("rope", rope_config, n_heads_q, n_heads_k, tokens, rot_dim, q.dtype)
    grid = (cdiv(tokens, cfg.block_t), batch)
    if cfg.split_heads:
        grid += (cdiv(n_heads_q, cfg.block_hq) + cdiv(n_heads_k, cfg.block_hk),)
    _rope_kernel[grid](
        _operand(q),
        _operand(k),
        _operand(q_out),
        _operand(k_out),
        _angles(cos, sin),
        tokens,
        n_heads_q,
        n_heads_k,
        **_launch_args(head_dim, rot_dim, cfg, backward),
        num_warps=cfg.num_warps,
    )
    return q_out, k_out


def rope_projections(
    yq: torch.Tensor,
    yk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch: int,
    head_dim: int,
    *,
    backward: bool = False,
    inplace: bool = False,
    out: tuple | None = None,
):
    """RoPE on the q/k projection outputs themselves, rows [batch * T, heads * head_dim] (no autograd): for
    callers that own those buffers, e.g. the fused LoRA QKV node, which rotates its outputs in place in
    forward (no second copy of q and k) and un-rotates the incoming gradients in backward. Returns the
    rotated rows in the same layout: in yq/yk's own memory (inplace), in `out` = (rows for q, rows for k),
    e.g. column blocks of one [batch * T, width] buffer (any row stride, unit last stride), or new buffers."""
    if inplace:
        out = (yq, yk)
    tokens = yq.shape[0] // batch

    def heads(rows, written: bool):  # [B, H, T, D]; rows written to must be views (unit last stride: they are)
        if written and rows.stride(-1) != 1:
            raise ValueError("RoPE into given buffers needs rows with unit last stride")
        shaped = rows.view(batch, tokens, -1, head_dim) if written else rows.reshape(batch, tokens, -1, head_dim)
        return shaped.transpose(1, 2)

    q4, k4 = heads(yq, inplace), heads(yk, inplace)
    out4 = None if out is None else (heads(out[0], True), heads(out[1], True))
    q4, k4 = _rope_launch(q4, k4, cos, sin, yq.dtype, yk.dtype, backward, out=out4)
    if out is not None:
        return out
    return q4.transpose(1, 2).reshape(yq.shape), k4.transpose(1, 2).reshape(yk.shape)


# ---------------------------------------------------------------------------------------------- autograd
def _output_dtypes(q, k, cos) -> tuple[torch.dtype, torch.dtype]:
    # As in transformers (q * cos promotes): bf16 q with fp32 cos gives fp32.
    return promote_types(q.dtype, cos.dtype), promote_types(k.dtype, cos.dtype)


class RotaryEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, inplace):
        keep_for_backward(ctx, (cos, sin))
        ctx.input_dtypes, ctx.inplace = (q.dtype, k.dtype), inplace
        if not inplace:
            return _rope_launch(q, k, cos, sin, *_output_dtypes(q, k, cos), False)
        _rope_launch(q, k, cos, sin, q.dtype, k.dtype, False, out=(q, k))
        # Autograd cannot mark two views modified in one Function (q and k are usually transposed views):
        # the outputs alias q and k instead, and the bumped version makes any other saver of them raise.
        increment_version((q, k))
        ctx.save_for_backward(q, k)  # the buffers backward writes the gradients into (recomputed when checkpointed)
        return q, k

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = kept_for_backward(ctx)
        out = ctx.saved_tensors if ctx.inplace else None
        grad_q, grad_k = _rope_launch(grad_q, grad_k, cos, sin, *ctx.input_dtypes, True, out=out)
        if out is not None:  # a graph kept for another backward that saved q_rot or k_rot fails loudly there
            increment_version(out)
        return grad_q, grad_k, None, None, None


# ------------------------------------------------------------------------------------------- public API
def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot), as transformers' apply_rotary_pos_emb (rotate-half; partial rotary when Dr < D).

    inplace=True: the rotated values go into q's and k's own buffers (the returned tensors alias them), and
    backward writes q's and k's gradients into those same buffers: no memory above the inputs, for q and k
    that nothing else reads, and q_rot/k_rot that only their consumer reads (attention, which is done with
    them when this backward runs), such as fresh projection outputs. Another autograd node that saved q or
    k, or saved q_rot or k_rot in a graph kept for a second backward, raises instead of reading other
    values. Ignored (new buffers, as without it) for leaves and views of leaves, for cos/sin that would
    promote q's dtype, for q or k not dense in their last dim, and on the reference path and under
    torch.compile."""
    _check_inputs(q, k, cos, sin)
    # The kernel gives no gradient for cos/sin; the rare caller that trains them gets the torch path.
    if not use_triton(q, k, cos, sin) or cos.requires_grad or sin.requires_grad:
        return rope_reference(q, k, cos, sin)
    if torch.compiler.is_compiling():
        return _rope_op(q, k, cos, sin)
    return RotaryEmbedding.apply(q, k, cos, sin, inplace and _rotatable_in_place(q, k, cos))


def _rotatable_in_place(q, k, cos) -> bool:
    return all(t.stride(-1) == 1 and made_by_autograd(t) for t in (q, k)) and _output_dtypes(q, k, cos) == (
        q.dtype,
        k.dtype,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot_dim = cos.shape[-1]

    def apply(x):
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        y = x_rot * cos + _rotate_half(x_rot) * sin
        return torch.cat((y, x_pass.to(y.dtype)), dim=-1) if x_pass.shape[-1] else y

    return apply(q), apply(k)


# ------------------------------------------------------------------------------- registered operators
# What torch.compile traces; eager calls keep the autograd Function (less host time per call).
@torch.library.custom_op(
    "fastplug::rope",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor cos, Tensor sin, bool backward, ScalarType q_dtype, ScalarType k_dtype) "
    "-> (Tensor, Tensor)",
)
def _rope_launch_op(q, k, cos, sin, backward, q_dtype, k_dtype):
    return _rope_launch(q, k, cos, sin, q_dtype, k_dtype, backward)


@_rope_launch_op.register_fake
def _(q, k, cos, sin, backward, q_dtype, k_dtype):
    return _empty_in_layout(_unit_last_stride(q), q_dtype), _empty_in_layout(_unit_last_stride(k), k_dtype)


def _rope_op(q, k, cos, sin):
    return _rope_launch_op(q, k, cos, sin, False, *_output_dtypes(q, k, cos))


def _setup_rope(ctx, inputs, output):
    q, k, cos, sin, *_ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.input_dtypes = (q.dtype, k.dtype)


def _rope_backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = _rope_launch_op(grad_q, grad_k, cos, sin, True, *ctx.input_dtypes)
    return grad_q, grad_k, None, None, None, None, None


_rope_launch_op.register_autograd(_rope_backward, setup_context=_setup_rope)
