"""The decode GEMV's `@triton.jit` kernel and the tuples it takes (its launcher is `gemv.gemv`).

`_gemv_kernel` computes y = [x W0^T | x W1^T | x W2^T] (or act(x W0^T) * x W1^T) for a few rows of x, one block
of output columns a program, with the norm before the projection, biases, LoRA, the residual and a softcap fused.
Its arguments are named tuples: at run time `GemvArgs` (x, the norm, three `Segment`s, ...), and four constexpr
tuples that specialise it: `GemvFlags` (what is fused), `Q4Format` (the 4-bit weights' format), `GemvTile` (tensor
cores or FMAs, the tile) and `WordsLoop` (the word-wise 4-bit loop); LOOKUP and PTX stay apart, since
`quant.launch_checked` may switch them after checking the compiled layouts.

Inside, a program reads its rows of x as an `XRows` and each weight's block of rows as a `WBlock`; one of three
accumulators sums x W^T over K: FMAs (1-16 rows), tensor-core dots (rows padded to 16), or the 4-bit word-wise loop
(`quant.words_row_sums`). A 4-bit weight's fields other than its packed bytes come from `q4_table`: one int64 row
of addresses a segment (`gemv._packed_table`), with the columns Q4_ABSMAX .. Q4_OFFSET.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..jit_helpers import dot, gate_factor, rms_weight, tanh
from ..quant.dequant import block_scale
from ..quant.gemv_kernels import words_row_sums
from .config import Norm, Rows

# ------------------------------------------------------------------------------------------- arguments


class Segment(NamedTuple):
    """One weight of a launch, as `_gemv_kernel` reads it."""

    w: torch.Tensor  # the weight [N, K] (4-bit: its packed bytes, or its words for the word-wise loop)
    stride_w: int  # its row stride (0 for 4-bit weights: rows are K elements apart)
    bias: torch.Tensor  # [N] (an unread pointer without biases)
    lora_b: torch.Tensor  # LoRA's B [N, rank] (an unread pointer without an adapter)
    rank: int  # 0: no adapter
    xa_col: int  # the first column of xa that belongs to this weight's adapter
    scaling: float
    n: int  # N (0: no such segment)


class GemvArgs(NamedTuple):
    """`_gemv_kernel`'s runtime arguments, in order."""

    x: Rows
    norm: Norm  # x itself and zeros without a norm
    segments: tuple  # MAX_SEGMENTS Segments
    q4_table: torch.Tensor | tuple  # int64 [segments, Q4_FIELDS] (`gemv._packed_table`), or one weight's fields
    # (Q4Format.FIELDS_AS_ARGS); x for dense weights
    lora_x: Rows  # xa = x A^T of every adapter
    residual: Rows  # out itself without one
    y: Rows
    M: int
    K: int
    row_words: int  # K // 8: a 4-bit row's 32-bit words (as an argument, Triton knows its divisibility)
    split_words: int  # the word-wise loop's words of a row a program reads: all of them, or one split of K
    blocks: tuple  # programs of segments 0 and 1
    softcap: float


class GemvFlags(NamedTuple):
    """Constexpr: what a launch fuses."""

    HAS_NORM: bool
    GEMMA_NORM: bool  # the norm's offset is not 0
    HAS_BIAS: bool
    HAS_LORA: bool
    ACT: int  # -1: none; else config.ACTIVATIONS' index (gate and up, y = act(g) * u)
    HAS_RES: bool
    SOFTCAP: bool


class Q4Format(NamedTuple):
    """Constexpr: the 4-bit weights' format (quant's `consts`); BLOCKSIZE_LOG2 0: dense weights. FIELDS_AS_ARGS: the
    one weight's fields come as a tuple of tensors (absmax, code, absmax2, code2, offset) in place of the table
    (kernel parameters, not loads: the one-row loop keeps its registers)."""

    BLOCKSIZE_LOG2: int
    BLOCKSIZE2_LOG2: int
    NESTED: bool
    FIELDS_AS_ARGS: bool = False


Q4_DENSE = Q4Format(0, 0, False)


class GemvTile(NamedTuple):
    """Constexpr: the tile paths' launch (`DecodeGemvConfig` and the dtype's dot precision)."""

    USE_DOT: bool
    PRECISION: str
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    BLOCK_R: int  # LoRA ranks, padded


class WordsLoop(NamedTuple):
    """Constexpr: the word-wise 4-bit loop (`quant.words_row_sums`; a `quant.GemvConfig`'s nb and sub, in 32-bit
    words); NB 0: the tile paths."""

    NB: int
    SUBW: int
    EVEN: bool  # every weight's rows fill whole blocks, and K whole chunks
    # K split over program_id(1), each program's fp32 sums written unrounded to its slice of y (summed by
    # `_sum_splits_kernel`); only a plain product (nothing fused), where few row blocks leave SMs idle
    SPLIT: bool = False


WORDS_OFF = WordsLoop(0, 0, False)


class XRows(NamedTuple):
    """A program's rows of x, inside the kernel: x, its M rows of K columns, the row indices and their mask, 1/rms
    of each row (zeros without a norm), the norm, and for the word-wise loop the 32-bit words of a weight row and
    of this program's split of K."""

    x: Rows
    M: int
    K: int
    rows: tl.tensor
    m_mask: tl.tensor
    rstd: tl.tensor
    norm: Norm
    row_words: int
    split_words: int


class WBlock(NamedTuple):
    """A program's block of one weight's rows, inside the kernel: the weight, its row stride, its row of q4_table,
    the row indices n and their mask."""

    w: torch.Tensor
    stride_w: int
    q4_row: tl.tensor
    n: tl.tensor
    n_mask: tl.tensor


# ----------------------------------------------------------------------------------------------- tiles
@triton.jit
def _load_x(xr, k, k_mask, F: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of x at columns k (normalised and rounded like the unfused RMSNorm), in x's
    dtype."""
    x = tl.load(
        xr.x.ptr + xr.rows[:, None] * xr.x.stride + k[None, :],
        mask=xr.m_mask[:, None] & k_mask[None, :],
        other=0.0,
        eviction_policy="evict_last",
    )
    if F.HAS_NORM:
        nw = tl.load(xr.norm.weight + k, mask=k_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = rms_weight(x.to(tl.float32) * xr.rstd[:, None], nw[None, :], xr.norm.offset, x.dtype, F.GEMMA_NORM)
    return x


# A 4-bit weight's fields other than its packed bytes, as one int64 row of addresses of `_packed_table` (one row
# a segment): the columns, in order.
Q4_ABSMAX, Q4_CODE, Q4_ABSMAX2, Q4_CODE2, Q4_OFFSET = (tl.constexpr(i) for i in range(5))
Q4_FIELDS = tl.constexpr(5)  # columns a row


@triton.jit
def _q4_row(q4_table, segment, Q4: tl.constexpr):
    """The row of `_packed_table` that describes segment `segment`'s 4-bit weight (the fields themselves where
    Q4.FIELDS_AS_ARGS)."""
    row = q4_table
    if not Q4.FIELDS_AS_ARGS:
        row = q4_table + segment * Q4_FIELDS
    return row


@triton.jit
def _w4_fields(q4_row, Q4: tl.constexpr):
    """absmax, code, absmax2, code2 and offset of a 4-bit weight, from its int64 row of `_packed_table`, or the
    fields themselves (Q4.FIELDS_AS_ARGS)."""
    if Q4.FIELDS_AS_ARGS:
        absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr = q4_row
    else:
        if Q4.NESTED:
            absmax_ptr = tl.load(q4_row + Q4_ABSMAX).to(tl.pointer_type(tl.uint8))
        else:
            absmax_ptr = tl.load(q4_row + Q4_ABSMAX).to(tl.pointer_type(tl.float32))
        code_ptr = tl.load(q4_row + Q4_CODE).to(tl.pointer_type(tl.float32))
        absmax2_ptr = tl.load(q4_row + Q4_ABSMAX2).to(tl.pointer_type(tl.float32))
        code2_ptr = tl.load(q4_row + Q4_CODE2).to(tl.pointer_type(tl.float32))
        offset_ptr = tl.load(q4_row + Q4_OFFSET).to(tl.pointer_type(tl.float32))
    return absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr


@triton.jit
def _w4_tile(wb, k, k_mask, K, Q4: tl.constexpr):
    """W[n, k] of a bitsandbytes 4-bit weight (fp32; zero outside the masks), decoded from its packed bytes:
    element e = n K + k is the high nibble of byte e // 2 when e is even, scaled by its block's absmax."""
    absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr = _w4_fields(wb.q4_row, Q4)
    mask = wb.n_mask[:, None] & k_mask[None, :]
    elem = wb.n.to(tl.int64)[:, None] * K + k[None, :]
    packed = tl.load(wb.w + (elem >> 1), mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    nibble = (packed >> ((1 - (elem & 1)) * 4).to(tl.int32)) & 15
    scale = block_scale(
        elem >> Q4.BLOCKSIZE_LOG2, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, Q4.BLOCKSIZE2_LOG2, Q4.NESTED
    )
    return tl.where(mask, tl.load(code_ptr + nibble) * scale, 0.0)


@triton.jit
def _w_x_block(xr, wb, k0, F: tl.constexpr, Q4: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] (streamed: read once) and the x tile at columns k0.. (normalised)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < xr.K
    if Q4.BLOCKSIZE_LOG2 > 0:  # a bitsandbytes 4-bit weight, rounded to x's dtype as its dequantization would be
        w = _w4_tile(wb, k, k_mask, xr.K, Q4).to(xr.x.ptr.dtype.element_ty)
    else:
        w = tl.load(
            wb.w + wb.n.to(tl.int64)[:, None] * wb.stride_w + k[None, :],
            mask=wb.n_mask[:, None] & k_mask[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    x = _load_x(xr, k, k_mask, F)
    return w, x


# ------------------------------------------------------------------------------------------ accumulators
@triton.jit
def _gemv_acc_words(
    xr, wb, Q4: tl.constexpr, WORDS: tl.constexpr, LOOKUP: tl.constexpr, PTX: tl.constexpr, BLOCK_M: tl.constexpr
):
    """x[rows] W[n]^T on a 4-bit weight read as 32-bit words (`quant.words_row_sums`: the GEMV's word-wise loop,
    table by warp shuffle where compiled, each nibble looked up once for all rows), over the words of this
    program's split of K (`xr.row_words` a row, `xr.split_words` a split): fp32 [BLOCK_M, BLOCK_N]. The weight is not
    rounded to x's dtype first (the tile path rounds it, as a dequantization would)."""
    absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr = _w4_fields(wb.q4_row, Q4)
    kw = xr.row_words
    if WORDS.EVEN:  # whole chunks of 128 words or more a row: the 16-byte word loads are aligned (Triton cannot see it)
        kw = tl.multiple_of(kw, 16)
    # the loop's start a run-time value even without a split, and the words a row an argument (not K // 8): either
    # way round, the one-row loop took more registers (scripts/decode_ptx.py --family gemv4bit)
    start = tl.program_id(1) * xr.split_words
    total = words_row_sums(
        xr.x.ptr,
        wb.w,
        absmax_ptr,
        code_ptr,
        absmax2_ptr,
        code2_ptr,
        offset_ptr,
        wb.n.to(tl.int64) * kw,
        wb.n_mask,
        start,
        tl.minimum(start + xr.split_words, kw),
        Q4.BLOCKSIZE_LOG2,
        Q4.BLOCKSIZE2_LOG2,
        Q4.NESTED,
        WORDS.NB,
        WORDS.SUBW,
        LOOKUP,
        PTX,
        WORDS.EVEN,
        xr.M,
        xr.x.stride,
        BLOCK_M,
    )
    if BLOCK_M == 1:
        total = total[None, :]
    return total


@triton.jit
def _gemv_acc_fma(xr, wb, F: tl.constexpr, Q4: tl.constexpr, TILE: tl.constexpr):
    """x[rows] W[n]^T over all of K, fp32 [BLOCK_M, BLOCK_N]: products summed per lane, reduced once at the end."""
    if TILE.BLOCK_M == 1:  # 2-D tiles only: x broadcasts along W's rows
        acc = _gemv_acc_one_row(xr, wb, F, Q4, TILE)
    else:
        acc = _gemv_acc_rows(xr, wb, F, Q4, TILE)
    return acc


@triton.jit
def _gemv_acc_one_row(xr, wb, F: tl.constexpr, Q4: tl.constexpr, TILE: tl.constexpr):
    acc2 = tl.full([TILE.BLOCK_N, TILE.BLOCK_K], 0.0, dtype=tl.float32)
    for k0 in range(0, xr.K, TILE.BLOCK_K):
        w, x = _w_x_block(xr, wb, k0, F, Q4, TILE.BLOCK_K)
        acc2 += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
    return tl.sum(acc2, axis=1)[None, :]


@triton.jit
def _gemv_acc_rows(xr, wb, F: tl.constexpr, Q4: tl.constexpr, TILE: tl.constexpr):
    acc3 = tl.full([TILE.BLOCK_M, TILE.BLOCK_N, TILE.BLOCK_K], 0.0, dtype=tl.float32)
    for k0 in range(0, xr.K, TILE.BLOCK_K):
        w, x = _w_x_block(xr, wb, k0, F, Q4, TILE.BLOCK_K)
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return tl.sum(acc3, axis=2)


@triton.jit
def _gemv_acc_dot(xr, wb, F: tl.constexpr, Q4: tl.constexpr, TILE: tl.constexpr):
    """x[rows] W[n]^T over all of K, fp32 [BLOCK_M, BLOCK_N], on the tensor cores (rows padded to BLOCK_M)."""
    PRECISION: tl.constexpr = TILE.PRECISION  # a str field goes on as an argument only so (Triton 3.6)
    acc = tl.full([TILE.BLOCK_M, TILE.BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, xr.K, TILE.BLOCK_K):
        w, x = _w_x_block(xr, wb, k0, F, Q4, TILE.BLOCK_K)
        acc += dot(x.to(w.dtype), tl.trans(w), PRECISION)
    return acc


# ----------------------------------------------------------------------------------------------- kernel
@triton.jit
def _lora_term(acc, xr, lora_x, seg, wb, BLOCK_R: tl.constexpr):
    """round(acc) + s (xa B^T) for this segment's rank r (0: no adapter, round(acc) alone)."""
    ridx = tl.arange(0, BLOCK_R)
    r_mask = ridx < seg.rank
    xa = tl.load(
        lora_x.ptr + xr.rows[:, None] * lora_x.stride + seg.xa_col + ridx[None, :],
        mask=xr.m_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    b = tl.load(
        seg.lora_b + wb.n[:, None] * seg.rank + ridx[None, :], mask=wb.n_mask[:, None] & r_mask[None, :], other=0.0
    ).to(tl.float32)
    return acc + seg.scaling * tl.sum(xa[:, None, :] * b[None, :, :], axis=2)


@triton.jit
def _gemv_segment(
    xr,
    seg,
    q4_table,
    index,
    n,
    N,
    lora_x,
    F: tl.constexpr,
    Q4: tl.constexpr,
    TILE: tl.constexpr,
    WORDS: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
):
    """One projection's output block at rows n (< N) of segment `seg` (number `index`), fp32, rounded as the
    unfused layer rounds (base, then + LoRA); the constexprs are `_gemv_kernel`'s. q4_table: `_packed_table`, or
    the one 4-bit weight's fields (`_q4_row`). WORDS.NB > 0: 1-8 rows of x on 4-bit weights, by `_gemv_acc_words`
    (seg.w: the packed bytes as int32 words)."""
    wb = WBlock(seg.w, seg.stride_w, _q4_row(q4_table, index, Q4), n, n < N)
    if WORDS.NB > 0:
        tl.static_assert(not F.HAS_NORM, "the word-wise path takes x normalised already")
        acc = _gemv_acc_words(xr, wb, Q4, WORDS, LOOKUP, PTX, TILE.BLOCK_M)
    elif TILE.USE_DOT:
        acc = _gemv_acc_dot(xr, wb, F, Q4, TILE)
    else:
        acc = _gemv_acc_fma(xr, wb, F, Q4, TILE)
    if WORDS.SPLIT:  # a split's partial sums: rounded once, when the splits are summed
        return acc
    dt = xr.x.ptr.dtype.element_ty
    if F.HAS_BIAS:
        acc += tl.load(seg.bias + n, mask=wb.n_mask, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(dt).to(tl.float32)
    if F.HAS_LORA:
        acc = _lora_term(acc, xr, lora_x, seg, wb, TILE.BLOCK_R)
        acc = acc.to(dt).to(tl.float32)
    return acc


@triton.jit
def _row_rstd(x, K, rows, m_mask, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1/rms of each row of x (K elements a row; recomputed by every program, from L2)."""
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(
            x.ptr + rows[:, None] * x.stride + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0
        ).to(tl.float32)
        sq += xk * xk
    return 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit
def _gemv_kernel(
    x,
    norm,
    segments,
    q4_table,
    lora_x,
    residual,
    y,
    M,
    K,
    row_words,
    split_words,
    blocks,
    softcap,
    F: tl.constexpr,
    Q4: tl.constexpr,
    TILE: tl.constexpr,
    WORDS: tl.constexpr,
    LOOKUP: tl.constexpr = 0,
    PTX: tl.constexpr = False,
):
    """y = [x W0^T | x W1^T | x W2^T] (or act(x W0^T) * x W1^T with F.ACT), see `gemv`, or with WORDS.SPLIT one
    split of K's fp32 sums of x W0^T into y's slice program_id(1). The runtime arguments are `GemvArgs`' fields,
    segments three `Segment`s (unused ones n = 0); F, Q4, TILE, WORDS: `GemvFlags`, `Q4Format`, `GemvTile`,
    `WordsLoop`; LOOKUP, PTX: the word-wise loop's table lookup (`quant.LOOKUPS`) and inline PTX."""
    n0 = segments[0].n
    n1 = segments[1].n
    n2 = segments[2].n
    nb0, nb1 = blocks
    pid = tl.program_id(0)
    rows = tl.arange(0, TILE.BLOCK_M)
    m_mask = rows < M
    rstd = tl.full([TILE.BLOCK_M], 0.0, dtype=tl.float32)
    if F.HAS_NORM:
        rstd = _row_rstd(x, K, rows, m_mask, norm.eps, TILE.BLOCK_M, TILE.BLOCK_K)
    xr = XRows(x, M, K, rows, m_mask, rstd, norm, row_words, split_words)
    if F.ACT >= 0:  # gate (segment 0) and up (segment 1) of the same hidden columns; the output is act(g) * u
        n = pid * TILE.BLOCK_N + tl.arange(0, TILE.BLOCK_N)
        g = _gemv_segment(xr, segments[0], q4_table, 0, n, n0, lora_x, F, Q4, TILE, WORDS, LOOKUP, PTX)
        # up: segment 1, gate's shape
        u = _gemv_segment(xr, segments[1], q4_table, 1, n, n0, lora_x, F, Q4, TILE, WORDS, LOOKUP, PTX)
        p, _ = gate_factor(g, F.ACT)
        out = g * p * u
        cols = n
        n_mask = n < n0
    elif Q4.FIELDS_AS_ARGS:  # one weight: one segment's code (three copies of the word-wise loop cost registers)
        n = pid * TILE.BLOCK_N + tl.arange(0, TILE.BLOCK_N)
        out = _gemv_segment(xr, segments[0], q4_table, 0, n, n0, lora_x, F, Q4, TILE, WORDS, LOOKUP, PTX)
        n_mask = n < n0
        cols = n
    else:
        if pid < nb0:
            n = pid * TILE.BLOCK_N + tl.arange(0, TILE.BLOCK_N)
            out = _gemv_segment(xr, segments[0], q4_table, 0, n, n0, lora_x, F, Q4, TILE, WORDS, LOOKUP, PTX)
            n_mask = n < n0
            cols = n
        elif pid < nb0 + nb1:
            n = (pid - nb0) * TILE.BLOCK_N + tl.arange(0, TILE.BLOCK_N)
            out = _gemv_segment(xr, segments[1], q4_table, 1, n, n1, lora_x, F, Q4, TILE, WORDS, LOOKUP, PTX)
            n_mask = n < n1
            cols = n0 + n
        else:
            n = (pid - nb0 - nb1) * TILE.BLOCK_N + tl.arange(0, TILE.BLOCK_N)
            out = _gemv_segment(xr, segments[2], q4_table, 2, n, n2, lora_x, F, Q4, TILE, WORDS, LOOKUP, PTX)
            n_mask = n < n2
            cols = n0 + n1 + n
    y_at = y.ptr + rows[:, None] * y.stride + cols[None, :]
    if WORDS.SPLIT:  # this split's fp32 sums, unrounded, into its [M, N] slice of y (fp32)
        tl.static_assert(
            not (F.HAS_BIAS or F.HAS_LORA or F.ACT >= 0 or F.HAS_RES or F.SOFTCAP), "a split fuses nothing"
        )
        y_at += tl.program_id(1) * M * y.stride
    else:
        dt = x.ptr.dtype.element_ty
        out = out.to(dt).to(tl.float32)
        if F.HAS_RES:
            r = tl.load(
                residual.ptr + rows[:, None] * residual.stride + cols[None, :],
                mask=m_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            out = (r.to(tl.float32) + out).to(dt).to(tl.float32)
        if F.SOFTCAP:  # transformers' order, each op rounded: tanh(logits / cap) * cap
            out = (out / softcap).to(dt).to(tl.float32)
            out = tanh(out, CLAMP=True).to(dt).to(tl.float32)
            out = (out * softcap).to(dt).to(tl.float32)
    tl.store(y_at, out.to(y.ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum_s part[s, i] in fp32, rounded once to out's dtype (the word-wise loop's splits of K)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
