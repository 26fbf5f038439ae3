"""Decode kernels for small batches (1-16 rows, one token each): what `fast_generate` runs per decode step.

At batch 1 a decoder layer is bound by reading its weights once, and a step of ~20 small kernels per layer is
bound by their launches. These kernels do a layer in ~5 launches (LoRA adds one per input):

- `gemv`: y = x W^T for a few rows of x, reading W once. Optionally, in the same kernel: RMSNorm of x (the
  norm before the projection: every program recomputes the row statistics of x, a few KiB from L2), up to
  three weights read as one output (q/k/v: one launch, no concatenated copy of the weights), bias, the
  unmerged LoRA term s (x A^T) B^T added in the epilogue (x A^T comes from a `gemv` over the A's), the gated
  activation act(x Wg^T) * (x Wu^T) (gate and up in one program: the hidden is the only output), the
  residual add y = r + x W^T, and the logits' softcap with fp32 output (the LM head). The weights may be
  bitsandbytes 4-bit ones (NF4/FP4, QLoRA bases): each tile is decoded from the packed bytes in registers.
- `decode_attention`: one new token per row over a static KV cache [B, Hkv, L, D], GQA-aware (a program
  serves the query heads of one key/value head), split over the cache (flash-decoding) with `attention_combine`
  merging the splits. q/k RMSNorm (Qwen3, Gemma3), RoPE at each row's position (from cos/sin tables), the
  write of the new key/value into the cache column `slot`, softcap and sliding windows are in the same kernel.
  The loop stops at the device-side `slot`: a captured graph reads only the filled part of the cache. A
  windowed layer's cache may be a ring of its last `window` columns (`ring=True`).
- `add_rms_norm`: h += RMSNorm(y) in place (Gemma2/3's norm of a sub-block's output before the residual add).
- `greedy_emit`: argmax of the logits and the bookkeeping of a decode step (pad for finished rows, EOS
  detection, the output column, the next input token, the position) in one launch.

Rounding follows the unfused modules (transformers' RMSNorm rounds before its weight, each projection's output
is rounded once, LoRA's x A^T is rounded before B, logits are rounded to the model dtype before the argmax),
so greedy tokens match theirs. Every kernel has a torch reference (`*_reference`), the path for tensors Triton
cannot run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import state, tuning
from .._utils import cdiv, check_dtype, interpreter_enabled, next_power_of_2, use_triton
from ..jit_helpers import dot, gate_factor, tanh
from ..quant import (
    GEMV_MAX_ROWS,
    LOOKUPS,
    _unpacked,
    block_scale,
    dequantize_4bit,
    dequantize_4bit_reference,
    gemv_config,
    is_4bit,
    launch_checked,
    words_row_sums,
)

ACTIVATIONS = {None: -1, "silu": 0, "gelu_tanh": 1, "gelu": 2}
MAX_SEGMENTS = 3
MAX_ROWS = 16  # the GEMV's dot path pads rows to 16; more rows go through cuBLAS
WORDS_MAX_ROWS = GEMV_MAX_ROWS  # rows of x the word-wise 4-bit loop takes (accumulators per thread grow with them)


def _precision(dtype: torch.dtype) -> str:
    if interpreter_enabled():
        return "upcast"
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


# ------------------------------------------------------------------------------------------------- GEMV
@triton.jit
def _load_x(
    x_ptr, stride_xm, rows, m_mask, k, k_mask, rstd, nw_ptr, offset, HAS_NORM: tl.constexpr, GEMMA_NORM: tl.constexpr
):
    """A [BLOCK_M, BLOCK_K] tile of x (normalised and rounded like the unfused RMSNorm), in x's dtype."""
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + k[None, :],
        mask=m_mask[:, None] & k_mask[None, :],
        other=0.0,
        eviction_policy="evict_last",
    )
    if HAS_NORM:
        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        h = x.to(tl.float32) * rstd[:, None]
        if GEMMA_NORM:
            x = (h * (offset + nw[None, :])).to(x.dtype)
        else:
            x = (h.to(x.dtype).to(tl.float32) * nw[None, :]).to(x.dtype)
    return x


# A 4-bit weight's fields other than its packed bytes, as one int64 row of addresses of `_packed_table` (one row
# a segment): the columns, in order.
Q4_ABSMAX, Q4_CODE, Q4_ABSMAX2, Q4_CODE2, Q4_OFFSET = (tl.constexpr(i) for i in range(5))
Q4_FIELDS = tl.constexpr(5)  # columns a row


@triton.jit
def _q4_row(q4_table, segment):
    """The row of `_packed_table` that describes segment `segment`'s 4-bit weight."""
    return q4_table + segment * Q4_FIELDS


@triton.jit
def _w4_fields(q4_row, NESTED: tl.constexpr):
    """absmax, code, absmax2, code2 and offset of a 4-bit weight, from its int64 row of `_packed_table`."""
    if NESTED:
        absmax_ptr = tl.load(q4_row + Q4_ABSMAX).to(tl.pointer_type(tl.uint8))
    else:
        absmax_ptr = tl.load(q4_row + Q4_ABSMAX).to(tl.pointer_type(tl.float32))
    code_ptr = tl.load(q4_row + Q4_CODE).to(tl.pointer_type(tl.float32))
    absmax2_ptr = tl.load(q4_row + Q4_ABSMAX2).to(tl.pointer_type(tl.float32))
    code2_ptr = tl.load(q4_row + Q4_CODE2).to(tl.pointer_type(tl.float32))
    offset_ptr = tl.load(q4_row + Q4_OFFSET).to(tl.pointer_type(tl.float32))
    return absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr


@triton.jit
def _w4_tile(
    data_ptr,
    q4_row,
    n,
    n_mask,
    k,
    k_mask,
    K,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
):
    """W[n, k] of a bitsandbytes 4-bit weight (fp32; zero outside the masks), decoded from its packed bytes:
    element e = n K + k is the high nibble of byte e // 2 when e is even, scaled by its block's absmax."""
    absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr = _w4_fields(q4_row, NESTED)
    mask = n_mask[:, None] & k_mask[None, :]
    elem = n.to(tl.int64)[:, None] * K + k[None, :]
    packed = tl.load(data_ptr + (elem >> 1), mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    nibble = (packed >> ((1 - (elem & 1)) * 4).to(tl.int32)) & 15
    scale = block_scale(
        elem >> BLOCKSIZE_LOG2, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED
    )
    return tl.where(mask, tl.load(code_ptr + nibble) * scale, 0.0)


@triton.jit
def _gemv_acc_words(
    x_ptr,
    stride_xm,
    M,
    words_ptr,
    q4_row,
    n,
    n_mask,
    K,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    WORDS_NB: tl.constexpr,
    WORDS_SUBW: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """x[rows] W[n]^T on a 4-bit weight read as 32-bit words (`quant.words_row_sums`: the GEMV's word-wise loop,
    table by warp shuffle where compiled, each nibble looked up once for all rows): fp32 [BLOCK_M, BLOCK_N]. The
    weight is not rounded to x's dtype first (the tile path rounds it, as a dequantization would)."""
    absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr = _w4_fields(q4_row, NESTED)
    kw = K // 8
    if EVEN:  # whole chunks of 128 words or more a row: the 16-byte word loads are aligned (Triton cannot see it)
        kw = tl.multiple_of(kw, 16)
    total = words_row_sums(
        x_ptr,
        words_ptr,
        absmax_ptr,
        code_ptr,
        absmax2_ptr,
        code2_ptr,
        offset_ptr,
        n.to(tl.int64) * kw,
        n_mask,
        0,
        kw,
        BLOCKSIZE_LOG2,
        BLOCKSIZE2_LOG2,
        NESTED,
        WORDS_NB,
        WORDS_SUBW,
        LOOKUP,
        PTX,
        EVEN,
        M,
        stride_xm,
        BLOCK_M,
    )
    if BLOCK_M == 1:
        total = total[None, :]
    return total


@triton.jit
def _gemv_acc_fma(
    x_ptr,
    stride_xm,
    rows,
    m_mask,
    rstd,
    nw_ptr,
    offset,
    w_ptr,
    stride_w,
    q4_row,
    n,
    n_mask,
    K,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x[rows] W[n]^T over all of K, fp32 [BLOCK_M, BLOCK_N]: products summed per lane, reduced once at the end."""
    if BLOCK_M == 1:  # 2-D tiles only: x broadcasts along W's rows
        acc = _gemv_acc_one_row(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            BLOCK_N,
            BLOCK_K,
        )
    else:
        acc = _gemv_acc_rows(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    return acc


@triton.jit
def _w_x_block(
    x_ptr,
    stride_xm,
    rows,
    m_mask,
    rstd,
    nw_ptr,
    offset,
    w_ptr,
    stride_w,
    q4_row,
    n,
    n_mask,
    K,
    k0,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The weight tile [BLOCK_N, BLOCK_K] (streamed: read once) and the x tile at columns k0.. (normalised)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < K
    if BLOCKSIZE_LOG2 > 0:  # a bitsandbytes 4-bit weight, rounded to x's dtype as its dequantization would be
        w = _w4_tile(w_ptr, q4_row, n, n_mask, k, k_mask, K, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED).to(
            x_ptr.dtype.element_ty
        )
    else:
        w = tl.load(
            w_ptr + n.to(tl.int64)[:, None] * stride_w + k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    x = _load_x(x_ptr, stride_xm, rows, m_mask, k, k_mask, rstd, nw_ptr, offset, HAS_NORM, GEMMA_NORM)
    return w, x


@triton.jit
def _gemv_acc_one_row(
    x_ptr,
    stride_xm,
    rows,
    m_mask,
    rstd,
    nw_ptr,
    offset,
    w_ptr,
    stride_w,
    q4_row,
    n,
    n_mask,
    K,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = _w_x_block(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            k0,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            BLOCK_K,
        )
        acc2 += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
    return tl.sum(acc2, axis=1)[None, :]


@triton.jit
def _gemv_acc_rows(
    x_ptr,
    stride_xm,
    rows,
    m_mask,
    rstd,
    nw_ptr,
    offset,
    w_ptr,
    stride_w,
    q4_row,
    n,
    n_mask,
    K,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = _w_x_block(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            k0,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            BLOCK_K,
        )
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return tl.sum(acc3, axis=2)


@triton.jit
def _gemv_acc_dot(
    x_ptr,
    stride_xm,
    rows,
    m_mask,
    rstd,
    nw_ptr,
    offset,
    w_ptr,
    stride_w,
    q4_row,
    n,
    n_mask,
    K,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x[rows] W[n]^T over all of K, fp32 [BLOCK_M, BLOCK_N], on the tensor cores (rows padded to BLOCK_M)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = _w_x_block(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            k0,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            BLOCK_K,
        )
        acc += dot(x.to(w.dtype), tl.trans(w), PRECISION)
    return acc


@triton.jit
def _lora_term(acc, xa_ptr, stride_xam, xa_off, rows, m_mask, b_ptr, r, n, n_mask, scaling, BLOCK_R: tl.constexpr):
    """round(acc) + s (xa B^T) for this segment's rank r (0: no adapter, round(acc) alone)."""
    ridx = tl.arange(0, BLOCK_R)
    r_mask = ridx < r
    xa = tl.load(
        xa_ptr + rows[:, None] * stride_xam + xa_off + ridx[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0
    ).to(tl.float32)
    b = tl.load(b_ptr + n[:, None] * r + ridx[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(
        tl.float32
    )
    return acc + scaling * tl.sum(xa[:, None, :] * b[None, :, :], axis=2)


@triton.jit
def _gemv_segment(
    x,
    rows,
    m_mask,
    rstd,
    norm,
    segment,
    q4_row,
    lora_x,
    n,
    K,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WORDS_NB: tl.constexpr,
    WORDS_SUBW: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One projection's output block, fp32, rounded as the unfused layer rounds (base, then + LoRA). The tuples
    are `_gemv_kernel`'s; q4_row: the segment's row of `_packed_table` (4-bit weights).
    WORDS_NB > 0: 1-8 rows of x on 4-bit weights, by `_gemv_acc_words` (w_ptr: the packed bytes as int32)."""
    x_ptr, stride_xm = x
    nw_ptr, _, offset = norm
    w_ptr, stride_w, bias_ptr, b_ptr, r, xa_off, scaling, N = segment
    xa_ptr, stride_xam = lora_x
    n_mask = n < N
    if WORDS_NB > 0:
        tl.static_assert(not HAS_NORM, "the word-wise path takes x normalised already")
        acc = _gemv_acc_words(
            x_ptr,
            stride_xm,
            tl.sum(m_mask.to(tl.int32), axis=0),
            w_ptr,
            q4_row,
            n,
            n_mask,
            K,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            WORDS_NB,
            WORDS_SUBW,
            LOOKUP,
            PTX,
            EVEN,
            BLOCK_M,
        )
    elif USE_DOT:
        acc = _gemv_acc_dot(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    else:
        acc = _gemv_acc_fma(
            x_ptr,
            stride_xm,
            rows,
            m_mask,
            rstd,
            nw_ptr,
            offset,
            w_ptr,
            stride_w,
            q4_row,
            n,
            n_mask,
            K,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_LORA:
        acc = _lora_term(acc, xa_ptr, stride_xam, xa_off, rows, m_mask, b_ptr, r, n, n_mask, scaling, BLOCK_R)
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    return acc


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
    blocks,
    softcap,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WORDS_NB: tl.constexpr = 0,
    WORDS_SUBW: tl.constexpr = 0,
    LOOKUP: tl.constexpr = 0,
    PTX: tl.constexpr = False,
    EVEN: tl.constexpr = False,
):
    """y = [x W0^T | x W1^T | x W2^T] (or act(x W0^T) * x W1^T with ACT), see `gemv`. The arguments, as `gemv`
    builds them (`_GemvArgs`): x (x_ptr, stride_xm); norm (weight_ptr, eps, offset); segments: three
    (w_ptr, stride_w, bias_ptr, lora_b_ptr, rank, xa_col, scaling, n) (unused ones n = 0); q4_table: int64
    [segments, Q4_FIELDS] addresses of the 4-bit weights' fields (`_packed_table`); lora_x (xa_ptr, stride_xam);
    residual (res_ptr, stride_rm); y (y_ptr, stride_ym); blocks: the programs of segments 0 and 1."""
    x_ptr, stride_xm = x
    nw_ptr, eps, offset = norm
    n0 = segments[0][7]
    n1 = segments[1][7]
    nb0, nb1 = blocks
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:  # the row statistics of x, recomputed by every program (K elements per row, from L2)
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(
                x_ptr + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0
            ).to(tl.float32)
            sq += xk * xk
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
    if ACT >= 0:  # gate (segment 0) and up (segment 1) of the same hidden columns; the output is act(g) * u
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        g = _gemv_segment(
            x,
            rows,
            m_mask,
            rstd,
            norm,
            segments[0],
            _q4_row(q4_table, 0),
            lora_x,
            n,
            K,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            HAS_BIAS,
            HAS_LORA,
            USE_DOT,
            PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            BLOCK_R,
            WORDS_NB,
            WORDS_SUBW,
            LOOKUP,
            PTX,
            EVEN,
        )
        # up has gate's shape: segment 1 with segment 0's n (as before the tuples)
        w1, sw1, bias1, lb1, r1, xo1, s1, _ = segments[1]
        u = _gemv_segment(
            x,
            rows,
            m_mask,
            rstd,
            norm,
            (w1, sw1, bias1, lb1, r1, xo1, s1, n0),
            _q4_row(q4_table, 1),
            lora_x,
            n,
            K,
            HAS_NORM,
            GEMMA_NORM,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            HAS_BIAS,
            HAS_LORA,
            USE_DOT,
            PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            BLOCK_R,
            WORDS_NB,
            WORDS_SUBW,
            LOOKUP,
            PTX,
            EVEN,
        )
        p, _ = gate_factor(g, ACT)
        out = g * p * u
        cols = n
        n_mask = n < n0
    else:
        if pid < nb0:
            n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            out = _gemv_segment(
                x,
                rows,
                m_mask,
                rstd,
                norm,
                segments[0],
                _q4_row(q4_table, 0),
                lora_x,
                n,
                K,
                HAS_NORM,
                GEMMA_NORM,
                BLOCKSIZE_LOG2,
                BLOCKSIZE2_LOG2,
                NESTED,
                HAS_BIAS,
                HAS_LORA,
                USE_DOT,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                BLOCK_R,
                WORDS_NB,
                WORDS_SUBW,
                LOOKUP,
                PTX,
                EVEN,
            )
            n_mask = n < n0
            cols = n
        elif pid < nb0 + nb1:
            n = (pid - nb0) * BLOCK_N + tl.arange(0, BLOCK_N)
            out = _gemv_segment(
                x,
                rows,
                m_mask,
                rstd,
                norm,
                segments[1],
                _q4_row(q4_table, 1),
                lora_x,
                n,
                K,
                HAS_NORM,
                GEMMA_NORM,
                BLOCKSIZE_LOG2,
                BLOCKSIZE2_LOG2,
                NESTED,
                HAS_BIAS,
                HAS_LORA,
                USE_DOT,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                BLOCK_R,
                WORDS_NB,
                WORDS_SUBW,
                LOOKUP,
                PTX,
                EVEN,
            )
            n_mask = n < n1
            cols = n0 + n
        else:
            n = (pid - nb0 - nb1) * BLOCK_N + tl.arange(0, BLOCK_N)
            out = _gemv_segment(
                x,
                rows,
                m_mask,
                rstd,
                norm,
                segments[2],
                _q4_row(q4_table, 2),
                lora_x,
                n,
                K,
                HAS_NORM,
                GEMMA_NORM,
                BLOCKSIZE_LOG2,
                BLOCKSIZE2_LOG2,
                NESTED,
                HAS_BIAS,
                HAS_LORA,
                USE_DOT,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                BLOCK_R,
                WORDS_NB,
                WORDS_SUBW,
                LOOKUP,
                PTX,
                EVEN,
            )
            n_mask = n < segments[2][7]
            cols = n0 + n1 + n
    res_ptr, stride_rm = residual
    y_ptr, stride_ym = y
    dt = x_ptr.dtype.element_ty
    out = out.to(dt).to(tl.float32)
    if HAS_RES:
        r = tl.load(
            res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0
        )
        out = (r.to(tl.float32) + out).to(dt).to(tl.float32)
    if SOFTCAP:  # transformers' order, each op rounded: tanh(logits / cap) * cap
        out = (out / softcap).to(dt).to(tl.float32)
        out = tanh(out, CLAMP=True).to(dt).to(tl.float32)
        out = (out * softcap).to(dt).to(tl.float32)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        out.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


class DecodeGemvConfig(NamedTuple):
    """One launch of the decode GEMV's tile paths (`_gemv_kernel`): tensor cores or not, the [BLOCK_M, BLOCK_N,
    BLOCK_K] tile, warps. The word-wise 4-bit loop takes its tile from `quant.gemv_config` instead. Built by
    `decode_gemv_config`; scripts override it through `kernels.tuning` under the name "decode_gemv" (a config,
    or a callable with decode_gemv_config's signature); a plain 5-tuple in this order is taken too."""

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def decode_gemv_config(m: int, n: int, k: int, glu: bool, itemsize: int = 2) -> DecodeGemvConfig:
    """The tile for m rows of x, n outputs (the widest weight), k inputs of itemsize bytes; glu: gate and up."""
    # The best of `python -m fastplug.bench.generate --kernels` on Llama-1B and Gemma2-2B projections (docs/
    # benchmarks/kernels.md, "decode GEMV"): one row, 8 rows x 512 columns a step, 1024 columns and 8 warps for
    # long rows (K >= 4096); 8 rows, 16 x 32 x 256 tensor-core tiles (the gated pair too).
    if m == 1:
        block_n = max(1, min(8, next_power_of_2(n)))
        if k >= 4096:
            return DecodeGemvConfig(False, 1, block_n, 1024, 8)
        return DecodeGemvConfig(False, 1, block_n, min(512, max(16, next_power_of_2(k))), 4)
    # fp32 tiles are twice as wide in bytes: 256 columns overflow Hopper's shared memory with the pipelined
    # 4-bit decode, where 64 fit.
    return DecodeGemvConfig(True, 16, 32, min(256 if itemsize <= 2 else 64, max(16, next_power_of_2(k))), 4)


_gemv_config = decode_gemv_config  # the name fastplug.bench.generate imports


def gemv(
    x: torch.Tensor,
    weights,
    *,
    norm: tuple | None = None,
    biases=None,
    lora=None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    config: DecodeGemvConfig | tuple | None = None,
    words: bool | None = None,
) -> torch.Tensor:
    """y = [x W0^T | x W1^T | x W2^T] for x [M, K] (M <= 16) and up to three weights [N_i, K], in one launch.

    norm: (weight [K], eps, offset): x is RMSNorm'ed first (offset 0: transformers' Llama RMSNorm, weight times
    the rounded normalised x; else Gemma's (offset + weight) in fp32). biases: one per weight, or None.
    lora: (xa [M, sum r], [B_i [N_i, r_i] or None], [scaling_i]): adds s_i xa_i B_i^T, xa_i the columns of xa
    that belong to weight i, in order (weights without an adapter have None and own no columns).
    activation ('silu', 'gelu_tanh', 'gelu'): exactly two weights (gate, up) of one shape; y = act(g) * u.
    residual [M, N]: y = residual + the projection (`out` may be `residual` itself: in place).
    out_dtype: torch.float32 for logits; softcap: tanh(y / cap) * cap, rounded like transformers.
    The weights may instead all be bitsandbytes 4-bit weights of one format (`packed_reason`), decoded from
    their packed bytes in the kernel and rounded to x's dtype (the dtype the whole product then runs in).
    With up to WORDS_MAX_ROWS rows of x (the decode step) they are read as 32-bit words instead, the 4-bit GEMV's
    loop (`words`: None picks it where the kernels run compiled on CUDA and the format allows; True asks for it),
    products of the unrounded weight in fp32, x normalised first by one more launch: a 16-byte load per thread
    and a warp-shuffle table, each nibble looked up once for all rows, where the decoded tile takes a byte load,
    a table load and a scale per element (an order of magnitude faster, and ahead of bitsandbytes' GEMV:
    docs/benchmarks/kernels.md, "decode GEMV"). More rows, or weights the loop cannot read, are dequantized and
    read dense.
    """
    weights = list(weights)
    if not 1 <= len(weights) <= MAX_SEGMENTS:
        raise ValueError(f"weights must hold 1 to {MAX_SEGMENTS} matrices; got {len(weights)}")
    if not torch.is_tensor(x) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [rows, K]; got {getattr(x, 'shape', type(x).__name__)}")
    check_dtype("x", x)
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows; got {m}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension")
    reason = packed_reason(weights)
    if reason:
        raise ValueError(f"weights: {reason}")
    entries = [_unpacked(w) for w in weights] if is_4bit(weights[0]) else None  # quant's cached fields
    packs = [e.packed for e in entries] if entries else None
    dtype = x.dtype if packs else weights[0].dtype
    for i, w in enumerate(weights):
        shape = packs[i].shape if packs else (tuple(w.shape) if torch.is_tensor(w) and w.dim() == 2 else None)
        if shape is None or shape[1] != k:
            raise ValueError(f"weights[{i}] must be a 2-D tensor [N, {k}]; got {getattr(w, 'shape', None)}")
        if packs:
            continue
        if w.dtype != dtype:
            raise ValueError(f"weights[{i}] must have weights[0]'s dtype {dtype}; got {w.dtype}")
        if w.stride(1) != 1:
            raise ValueError(f"weights[{i}] must be contiguous along its last dimension")
    if not packs:
        check_dtype("weights", weights[0])
    if x.dtype != dtype:
        raise ValueError(f"x must have the weights' dtype {dtype}; got {x.dtype}")
    act = ACTIVATIONS.get(activation, None) if activation in ACTIVATIONS else None
    if act is None:
        raise ValueError(f"activation must be one of {[a for a in ACTIVATIONS if a]} or None; got {activation!r}")
    ns = [p.shape[0] for p in packs] if packs else [w.shape[0] for w in weights]
    if act >= 0 and (len(weights) != 2 or ns[0] != ns[1]):
        raise ValueError(
            f"activation {activation!r} needs two weights (gate, up) of one shape; got shapes "
            f"{[tuple(w.shape) for w in weights]}"
        )
    n_out = ns[0] if act >= 0 else sum(ns)
    if norm is not None:
        nw, eps, offset = norm
        if not torch.is_tensor(nw) or nw.shape != (k,):
            raise ValueError(f"norm weight must have shape ({k},); got {getattr(nw, 'shape', None)}")
    else:
        nw, eps, offset = x, 0.0, 0.0  # an unread pointer
    if biases is not None:
        biases = list(biases)
        if len(biases) != len(weights) or any(b is None for b in biases):
            raise ValueError("biases must hold one bias per weight (or be None)")
        for i, (b, n) in enumerate(zip(biases, ns)):
            if b.shape != (n,) or b.dtype != dtype:
                raise ValueError(
                    f"biases[{i}] must be a {dtype} tensor of shape ({n},); got {b.dtype} {tuple(b.shape)}"
                )
    seg_b = [x] * MAX_SEGMENTS  # unread pointers where a weight has no adapter
    ranks, offs, scales = [0] * MAX_SEGMENTS, [0] * MAX_SEGMENTS, [0.0] * MAX_SEGMENTS
    xa = x
    if lora is not None:
        xa, bs, scalings = lora
        bs, scalings = list(bs), list(scalings)
        if len(bs) != len(weights) or len(scalings) != len(weights):
            raise ValueError("lora must give one B (or None) and one scaling per weight")
        col = 0
        for i, (b, n) in enumerate(zip(bs, ns)):
            if b is None:
                continue
            if b.dim() != 2 or b.shape[0] != n or b.dtype != dtype or not b.is_contiguous():
                raise ValueError(
                    f"lora B[{i}] must be a contiguous {dtype} tensor [{n}, r]; got {b.dtype} {tuple(b.shape)}"
                )
            seg_b[i], ranks[i], offs[i], scales[i] = b, b.shape[1], col, float(scalings[i])
            col += b.shape[1]
        if xa.dim() != 2 or tuple(xa.shape) != (m, col) or xa.dtype != dtype or xa.stride(1) != 1:
            raise ValueError(
                f"lora xa must be a {dtype} tensor [{m}, {col}] (x A^T of every adapter); got "
                f"{xa.dtype} {tuple(xa.shape)}"
            )
    if residual is not None and (tuple(residual.shape) != (m, n_out) or residual.stride(1) != 1):
        raise ValueError(f"residual must have shape ({m}, {n_out}), contiguous rows; got {tuple(residual.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0; got {softcap}")
    out_dtype = out_dtype or dtype
    if out is None:
        out = torch.empty(m, n_out, device=x.device, dtype=out_dtype)
    elif tuple(out.shape) != (m, n_out) or out.stride(1) != 1:
        raise ValueError(f"out must have shape ({m}, {n_out}), contiguous rows; got {tuple(out.shape)}")
    if not use_triton(x, weights[0]):
        return _write(
            out,
            gemv_reference(
                x,
                weights,
                norm=norm,
                biases=biases,
                lora=lora,
                activation=activation,
                residual=residual,
                out_dtype=out_dtype,
                softcap=softcap,
            ),
        )
    tile = _words_tile(x, entries, ns, k, act >= 0, words)
    if packs and tile is None and m > 1:
        # Dequantized (into new buffers, one launch a weight) and read dense: much faster at 2-8 rows than decoding
        # the 4-bit tiles (docs/benchmarks/kernels.md, "decode GEMV") (whose per-element table and scale loads the
        # pipeliner stages in shared memory; 256 columns of them overflowed it at batch 8 of Llama-1B NF4).
        weights, entries, packs = [dequantize_4bit(w, dtype=dtype) for w in weights], None, None
    if config is None:
        config = tuning.pick("decode_gemv", decode_gemv_config, m, max(ns), k, act >= 0, x.element_size())
    use_dot, block_m, block_n, block_k, warps = DecodeGemvConfig(*config)
    if use_dot and block_m < 16:
        raise ValueError("config: the dot path needs BLOCK_M >= 16")
    if tile is not None and norm is not None:
        # normalised once, by one more launch: fused, every program of the word-wise loop would redo the norm's
        # conversions for its rows (2.5x the product alone: docs/benchmarks/kernels.md, "decode GEMV")
        x, norm = _launch_rms_norm(torch.empty_like(x), x, norm, add=False), None
        nw, eps, offset = x, 0.0, 0.0
    consts = dict(WORDS_NB=0)
    if packs:  # the kernel reads the packed bytes; the rest of each weight's fields through one table
        seg_w, strides, q4 = [p.data for p in packs], [0] * len(packs), _packed_table(entries)
        q4_consts = entries[0].consts
        if tile is not None:
            seg_w, block_n, use_dot = [e.words for e in entries], tile.block_n, False
            block_m, warps = next_power_of_2(m), tile.num_warps
            aligned = x.data_ptr() % 16 == 0 and (m == 1 or x.stride(0) % 8 == 0)
            consts = dict(
                WORDS_NB=tile.nb,
                WORDS_SUBW=tile.sub,
                LOOKUP=LOOKUPS[tile.lookup],
                PTX=tile.lookup == "shfl" and x.dtype == torch.bfloat16 and aligned,
                EVEN=all(n % block_n == 0 for n in ns) and k // 8 % (tile.nb * tile.sub) == 0,
            )
    else:
        seg_w, strides, q4 = weights, [w.stride(0) for w in weights], x
        q4_consts = dict(BLOCKSIZE_LOG2=0, BLOCKSIZE2_LOG2=0, NESTED=False)
    seg_w = seg_w + [seg_w[0]] * (MAX_SEGMENTS - len(seg_w))
    strides = strides + [0] * (MAX_SEGMENTS - len(strides))
    seg_n = ns + [0] * (MAX_SEGMENTS - len(ns))
    seg_bias = (biases or [x]) + [x] * (MAX_SEGMENTS - len(biases or [x]))
    blocks = [cdiv(n, block_n) for n in seg_n]
    grid = (blocks[0] if act >= 0 else sum(blocks),)
    res = residual if residual is not None else out
    segments = tuple(
        tuple(_Segment(seg_w[i], strides[i], seg_bias[i], seg_b[i], ranks[i], offs[i], scales[i], seg_n[i]))
        for i in range(MAX_SEGMENTS)
    )
    args = tuple(
        _GemvArgs(
            x=(x, x.stride(0)),
            norm=(nw, float(eps), float(offset)),
            segments=segments,
            q4_table=q4,
            lora_x=(xa, xa.stride(0)),
            residual=(res, res.stride(0)),
            y=(out, out.stride(0)),
            M=m,
            K=k,
            blocks=(blocks[0], blocks[1]),
            softcap=float(softcap or 1.0),
        )
    )
    consts.update(
        HAS_NORM=norm is not None,
        GEMMA_NORM=norm is not None and float(offset) != 0.0,
        HAS_BIAS=biases is not None,
        HAS_LORA=lora is not None,
        ACT=act,
        HAS_RES=residual is not None,
        SOFTCAP=softcap is not None,
        USE_DOT=use_dot,
        PRECISION=_precision(dtype),
        **q4_consts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=max(16, next_power_of_2(max(ranks))),
        num_warps=warps,
    )
    launch_checked(_gemv_kernel, grid, args, consts, dict(LOOKUP=LOOKUPS["gather"], PTX=False))
    return out


class _Segment(NamedTuple):
    """One weight of a `gemv` launch, as `_gemv_kernel` reads it (passed as a plain tuple, in this order)."""

    w: torch.Tensor  # the weight [N, K] (4-bit: its packed bytes, or its words for the word-wise loop)
    stride_w: int  # its row stride (0 for 4-bit weights: rows are K elements apart)
    bias: torch.Tensor  # [N] (an unread pointer without biases)
    lora_b: torch.Tensor  # LoRA's B [N, rank] (an unread pointer without an adapter)
    rank: int  # 0: no adapter
    xa_col: int  # the first column of xa that belongs to this weight's adapter
    scaling: float
    n: int  # N (0: no such segment)


class _GemvArgs(NamedTuple):
    """`_gemv_kernel`'s runtime arguments, in order (passed as plain tuples)."""

    x: tuple  # (x, row stride)
    norm: tuple  # (RMSNorm weight, eps, offset); x and zeros without a norm
    segments: tuple  # MAX_SEGMENTS _Segment tuples
    q4_table: torch.Tensor  # int64 [segments, Q4_FIELDS] (`_packed_table`); x for dense weights
    lora_x: tuple  # (xa = x A^T of every adapter, row stride)
    residual: tuple  # (residual, row stride); out itself without one
    y: tuple  # (out, row stride)
    M: int
    K: int
    blocks: tuple  # programs of segments 0 and 1
    softcap: float


def _words_tile(x, entries, ns, k, glu: bool, words: bool | None):
    """The word-wise tile (a quant.GemvConfig) for up to WORDS_MAX_ROWS rows of x on 4-bit weights, or None.
    `words`: None where compiled on CUDA and the weights allow, True asks for it (an error where they do not),
    False never."""
    if words is False or entries is None or x.shape[0] > WORDS_MAX_ROWS:
        if words:
            raise ValueError(f"words=True takes at most {WORDS_MAX_ROWS} rows of x and 4-bit weights")
        return None
    if words is None and not (x.is_cuda and not interpreter_enabled()):
        return None
    blocksize = entries[0].packed.blocksize
    if k % 8 or blocksize < 8 or any(e.words is None for e in entries):
        if words:
            raise ValueError("words=True takes K a multiple of 8, blocksize >= 8 and word-aligned packed bytes")
        return None
    # as many programs as row blocks (gate/up: one per block of both)
    tile = gemv_config(x.shape[0], ns[0] if glu else sum(ns), k, blocksize, x.device, words=True)
    if glu and x.shape[0] == 1:  # a program holds rows of both weights: half the words a step, the same registers
        tile = tile._replace(nb=max(1, tile.nb // 2))
    return tile


def _packed_format(entry) -> tuple:
    return (*entry.consts.values(), entry.packed.absmax.dtype)


def packed_reason(weights) -> str | None:
    """Why `gemv` cannot read these weights in one launch as far as 4 bits go (None: it can): a 4-bit
    weight among dense ones, or 4-bit weights of different blocksizes or double quantization."""
    packed = [is_4bit(w) for w in weights]
    if not any(packed):
        return None
    if not all(packed):
        return "4-bit and dense weights mixed in one launch"
    formats = {_packed_format(_unpacked(w)) for w in weights}
    if len(formats) > 1:
        return (
            "4-bit weights of different formats (log2 blocksize, log2 nested blocksize, nested, absmax "
            f"dtype): {formats}"
        )
    return None


# the addresses of absmax, code, absmax2, code2 and offset of each 4-bit weight (a graph replays its launches
# with the table it captured: the same addresses give the same table, made once, on the device)
_PACKED_TABLES: dict[tuple, torch.Tensor] = state.register_cache("decode.packed_tables", {})


def _packed_table(entries) -> torch.Tensor:
    # args: data, absmax, code, absmax2, code2, offset (quant's pointer arguments, unused ones filled in)
    rows = [tuple(t.data_ptr() for t in e.args[1:]) for e in entries]
    device = entries[0].packed.data.device
    key = (device, *rows)
    table = _PACKED_TABLES.get(key)
    if table is None:
        table = _PACKED_TABLES[key] = torch.tensor(rows, dtype=torch.int64).to(device)
    return table


def _write(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    out.copy_(value)
    return out


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


def gemv_reference(
    x, weights, *, norm=None, biases=None, lora=None, activation=None, residual=None, out_dtype=None, softcap=None
) -> torch.Tensor:
    """gemv in torch, the unfused modules' maths and rounding (fp32 products)."""
    from ..norms import rms_norm_reference

    dtype = x.dtype
    if norm is not None:
        x = rms_norm_reference(x, *norm)
    outs = []
    xa_col = 0
    for i, w in enumerate(weights):
        if is_4bit(w):  # rounded to x's dtype, as the kernel's tile
            w = dequantize_4bit_reference(w, dtype)
        y = _round(x.float() @ w.float().t() + (biases[i].float() if biases is not None else 0.0), dtype)
        if lora is not None and lora[1][i] is not None:
            b = lora[1][i]
            xa = lora[0][:, xa_col : xa_col + b.shape[1]].float()
            xa_col += b.shape[1]
            y = _round(y + lora[2][i] * (xa @ b.float().t()), dtype)
        outs.append(y)
    if activation is not None:
        g, u = outs
        act = {
            "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "gelu": torch.nn.functional.gelu,
        }[activation]
        y = _round(act(g) * u, dtype)
    else:
        y = torch.cat(outs, dim=1)
    if residual is not None:
        y = _round(residual.float() + y, dtype)
    if softcap is not None:
        y = _round(y / softcap, dtype)
        y = _round(torch.tanh(y), dtype)
        y = _round(y * softcap, dtype)
    return y.to(out_dtype or dtype)


# -------------------------------------------------------------------------------------------- attention
@triton.jit
def _rope_half(x1, x2, c1, c2, s1, s2):
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _head_norm(x1, x2, w_ptr, half, h_mask, eps, offset, D, dt, GEMMA_NORM: tl.constexpr):
    """RMSNorm over a head's D values held as two halves (rows: heads), rounded like the module."""
    w1 = tl.load(w_ptr + half, mask=h_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + D // 2, mask=h_mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    y1 = x1 * rstd[:, None]
    y2 = x2 * rstd[:, None]
    if GEMMA_NORM:
        y1 = y1 * (offset + w1[None, :])
        y2 = y2 * (offset + w2[None, :])
    else:
        y1 = y1.to(dt).to(tl.float32) * w1[None, :]
        y2 = y2.to(dt).to(tl.float32) * w2[None, :]
    return y1.to(dt).to(tl.float32), y2.to(dt).to(tl.float32)


@triton.jit
def _decode_attention_kernel(
    qkv_ptr,
    stride_qkv,
    cos_ptr,
    sin_ptr,
    stride_rope,
    pos_ptr,
    qn_ptr,
    kn_ptr,
    norm_eps,
    norm_offset,
    k_cache,
    v_cache,
    stride_cb,
    stride_ch,
    stride_cl,
    valid_ptr,
    stride_valid,
    slot_ptr,
    o_ptr,
    stride_o,
    part_o,
    part_ml,
    H,
    HKV,
    G,
    D,
    L,
    window,
    scaling,
    softcap,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    RING: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    kvh = bh % HKV
    dt = k_cache.dtype.element_ty
    slot = tl.load(slot_ptr).to(tl.int32)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    # a head's D values as two halves: rotate_half pairs i with i + D/2
    half = tl.arange(0, BLOCK_H)
    h_mask = half < D // 2
    g = tl.arange(0, BLOCK_G)
    g_mask = g < G
    qg_mask = g_mask[:, None] & h_mask[None, :]
    row = qkv_ptr + b * stride_qkv
    q_off = (kvh * G + g)[:, None] * D + half[None, :]  # this kv head's query heads
    q1 = tl.load(row + q_off, mask=qg_mask, other=0.0).to(tl.float32)
    q2 = tl.load(row + q_off + D // 2, mask=qg_mask, other=0.0).to(tl.float32)
    k_off = H * D + kvh * D + half[None, :]
    k1 = tl.load(row + k_off, mask=h_mask[None, :], other=0.0).to(tl.float32)
    k2 = tl.load(row + k_off + D // 2, mask=h_mask[None, :], other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        q1, q2 = _head_norm(q1, q2, qn_ptr, half, h_mask, norm_eps, norm_offset, D, dt, GEMMA_NORM)
        k1, k2 = _head_norm(k1, k2, kn_ptr, half, h_mask, norm_eps, norm_offset, D, dt, GEMMA_NORM)
    rope = pos * stride_rope + half
    c1 = tl.load(cos_ptr + rope, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + rope + D // 2, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + rope, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + rope + D // 2, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    q1, q2 = _rope_half(q1, q2, c1, c2, s1, s2)
    q1 = q1.to(dt)
    q2 = q2.to(dt)
    cache_b = b.to(tl.int64) * stride_cb + kvh.to(tl.int64) * stride_ch
    # a ring holds absolute column c at c % L; a full cache at c (slot < L)
    write = slot % L
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, tl.minimum(slot + 1, L))
    if (write >= lo) & (write < lo + CHUNK):  # this split owns the new column: write it, then read it back
        k1, k2 = _rope_half(k1, k2, c1, c2, s1, s2)
        v_off = (H + HKV) * D + kvh * D + half[None, :]
        v1 = tl.load(row + v_off, mask=h_mask[None, :], other=0.0)
        v2 = tl.load(row + v_off + D // 2, mask=h_mask[None, :], other=0.0)
        dst = cache_b + write.to(tl.int64) * stride_cl + half[None, :]
        tl.store(k_cache + dst, k1.to(dt), mask=h_mask[None, :])
        tl.store(k_cache + dst + D // 2, k2.to(dt), mask=h_mask[None, :])
        tl.store(v_cache + dst, v1.to(dt), mask=h_mask[None, :])
        tl.store(v_cache + dst + D // 2, v2.to(dt), mask=h_mask[None, :])
        tl.debug_barrier()
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, BLOCK_H], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, BLOCK_H], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_S):
        cols = start + tl.arange(0, BLOCK_S)
        c_mask = cols < hi
        kv_mask = c_mask[:, None] & h_mask[None, :]
        offs = cache_b + cols.to(tl.int64)[:, None] * stride_cl + half[None, :]
        kt1 = tl.load(k_cache + offs, mask=kv_mask, other=0.0)
        kt2 = tl.load(k_cache + offs + D // 2, mask=kv_mask, other=0.0)
        vt1 = tl.load(v_cache + offs, mask=kv_mask, other=0.0)
        vt2 = tl.load(v_cache + offs + D // 2, mask=kv_mask, other=0.0)
        s = (dot(q1, tl.trans(kt1), PRECISION) + dot(q2, tl.trans(kt2), PRECISION)) * scaling
        if SOFTCAP:
            s = tanh(s / softcap, CLAMP=True) * softcap
        if RING:  # the absolute column each ring slot holds now (negative: not written yet)
            held = slot - (slot - cols + L) % L
            ok = tl.load(valid_ptr + b * stride_valid + held, mask=c_mask & (held >= 0), other=0) != 0
        else:
            ok = tl.load(valid_ptr + b * stride_valid + cols, mask=c_mask, other=0) != 0
        ok = (ok | (cols == write)) & c_mask
        if WINDOW:  # a ring is exactly the window: nothing to mask
            ok = ok & (cols > slot - window)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m_i - base)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(dt)
        acc1 = acc1 * alpha[:, None] + dot(p, vt1, PRECISION)
        acc2 = acc2 * alpha[:, None] + dot(p, vt2, PRECISION)
        m_i = m_new
    heads = kvh * G + g
    if SPLITS == 1:
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        dst = o_ptr + b * stride_o + heads[:, None] * D + half[None, :]
        tl.store(dst, (acc1 * inv[:, None]).to(dt), mask=qg_mask)
        tl.store(dst + D // 2, (acc2 * inv[:, None]).to(dt), mask=qg_mask)
    else:
        part = (b * H + heads) * SPLITS + split  # [B, H, SPLITS] rows
        dst = part_o + part.to(tl.int64)[:, None] * D + half[None, :]
        tl.store(dst, acc1, mask=qg_mask)
        tl.store(dst + D // 2, acc2, mask=qg_mask)
        tl.store(part_ml + part * 2, m_i, mask=g_mask)
        tl.store(part_ml + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _attention_combine_kernel(
    part_o, part_ml, o_ptr, stride_o, H, D, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    sp = tl.arange(0, BLOCK_SPLITS)
    s_mask = sp < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    row = bh * SPLITS + sp
    m = tl.load(part_ml + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml + row * 2 + 1, mask=s_mask, other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(s_mask & (m > float("-inf")), tl.exp(m - top), 0.0)
    acc = tl.load(
        part_o + row.to(tl.int64)[:, None] * D + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + b * stride_o + h * D + d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def _attention_splits(length: int, chunk: int | None) -> tuple[int, int]:
    chunk = chunk or (length if length <= 256 else 128)
    chunk = max(16, next_power_of_2(chunk)) if chunk < length else length
    return chunk, cdiv(length, chunk)


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: int,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
    ring: bool = False,
    qk_norm: tuple | None = None,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of attention for B rows: returns o [B, heads * D] and writes the new key/value.

    qkv [B, (heads + 2 Hkv) D]: this token's projections (q heads, then k, then v; before RoPE). k_cache,
    v_cache [B, Hkv, L, D]: column `slot` (a 1-element device tensor) receives the rotated key and the value;
    the token attends to columns 0..slot where `valid` [B, L] (bool) is set (column slot always), and with a
    window to the last `window` columns (column j for slot i when i - window < j <= i). ring: the cache holds
    only the last `window` columns (L == window), absolute column c at c % window, and `valid` [B, positions]
    stays per absolute column. pos [B] (or [B, 1]): each row's position, indexing the RoPE tables
    cos, sin [positions, D]. qk_norm: (q weight [D], k weight [D], eps, offset) for per-head q/k RMSNorm
    before RoPE. chunk: cache columns per split program (flash-decoding).
    """
    for name, t in (
        ("qkv", qkv),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("valid", valid),
        ("slot", slot),
        ("pos", pos),
        ("cos", cos),
        ("sin", sin),
    ):
        if not torch.is_tensor(t):
            raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be [B, Hkv, L, D] of one shape; got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    check_dtype("k_cache", k_cache)
    b, hkv, length, d = k_cache.shape
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have one layout, contiguous along D")
    if not isinstance(heads, int) or heads < 1 or heads % hkv:
        raise ValueError(f"heads must be a positive multiple of the cache's {hkv} key/value heads; got {heads}")
    if d % 2:
        raise ValueError(f"head dim (the cache's last size) must be even for RoPE; got {d}")
    if qkv.dim() != 2 or tuple(qkv.shape) != (b, (heads + 2 * hkv) * d) or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [{b}, {(heads + 2 * hkv) * d}] (q, k, v heads of this token); got {tuple(qkv.shape)}"
        )
    if qkv.dtype != k_cache.dtype:
        raise ValueError(f"qkv must have the cache's dtype {k_cache.dtype}; got {qkv.dtype}")
    if ring and window != length:
        raise ValueError(f"a ring cache holds `window` columns: window must be the cache's {length}; got {window!r}")
    if (
        valid.dtype != torch.bool
        or valid.dim() != 2
        or valid.shape[0] != b
        or valid.shape[1] < length
        or (not ring and valid.shape[1] != length)
        or valid.stride(1) != 1
    ):
        expected = f"[{b}, >= {length}]" if ring else f"[{b}, {length}]"
        raise ValueError(
            f"valid must be a bool tensor {expected}, contiguous rows; got {valid.dtype} {tuple(valid.shape)}"
        )
    if slot.numel() != 1 or slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot must be a 1-element integer tensor; got {slot.dtype} {tuple(slot.shape)}")
    pos = pos.reshape(-1)
    if pos.numel() != b or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pos must hold {b} integer positions; got {pos.dtype} {tuple(pos.shape)}")
    if (
        cos.dim() != 2
        or cos.shape[1] != d
        or sin.shape != cos.shape
        or cos.stride(1) != 1
        or sin.stride() != cos.stride()
    ):
        raise ValueError(
            f"cos and sin must be [positions, {d}] tables of one layout; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0; got {softcap}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None; got {window!r}")
    if qk_norm is not None:
        qn, kn, _, _ = qk_norm
        if qn.shape != (d,) or kn.shape != (d,):
            raise ValueError(f"qk_norm weights must have shape ({d},); got {tuple(qn.shape)}, {tuple(kn.shape)}")
    if out is None:
        out = torch.empty(b, heads * d, device=qkv.device, dtype=qkv.dtype)
    if not use_triton(qkv, k_cache):
        return _write(
            out,
            decode_attention_reference(
                qkv,
                k_cache,
                v_cache,
                valid,
                slot,
                pos,
                cos,
                sin,
                heads=heads,
                scaling=scaling,
                softcap=softcap,
                window=window,
                ring=ring,
                qk_norm=qk_norm,
            ),
        )
    chunk, splits = _attention_splits(length, chunk)
    group = heads // hkv
    block_g = max(16, next_power_of_2(group))
    block_h = max(16, next_power_of_2(d // 2))
    block_s = max(16, min(64 if d <= 128 else 32, next_power_of_2(chunk)))
    if splits > 1:
        part_o = torch.empty(b * heads * splits, d, device=qkv.device, dtype=torch.float32)
        part_ml = torch.empty(b * heads * splits, 2, device=qkv.device, dtype=torch.float32)
    else:
        part_o = part_ml = out
    qn, kn, eps, offset = qk_norm if qk_norm is not None else (cos, cos, 0.0, 0.0)
    _decode_attention_kernel[(b * hkv, splits)](
        qkv,
        qkv.stride(0),
        cos,
        sin,
        cos.stride(0),
        pos,
        qn,
        kn,
        float(eps),
        float(offset),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        valid.view(torch.uint8),
        valid.stride(0),
        slot,
        out,
        out.stride(0),
        part_o,
        part_ml,
        heads,
        hkv,
        group,
        d,
        length,
        int(window or 0),
        float(scaling),
        float(softcap or 1.0),
        CHUNK=chunk,
        SPLITS=splits,
        HAS_QK_NORM=qk_norm is not None,
        GEMMA_NORM=qk_norm is not None and float(offset) != 0.0,
        SOFTCAP=softcap is not None,
        WINDOW=window is not None and not ring,
        RING=ring,
        PRECISION=_precision(qkv.dtype),
        BLOCK_G=block_g,
        BLOCK_H=block_h,
        BLOCK_S=block_s,
        num_warps=4,
    )
    if splits > 1:
        _attention_combine_kernel[(b * heads,)](
            part_o,
            part_ml,
            out,
            out.stride(0),
            heads,
            d,
            SPLITS=splits,
            BLOCK_SPLITS=next_power_of_2(splits),
            BLOCK_D=next_power_of_2(d),
            num_warps=4,
        )
    return out


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention_reference(
    qkv,
    k_cache,
    v_cache,
    valid,
    slot,
    pos,
    cos,
    sin,
    *,
    heads,
    scaling,
    softcap=None,
    window=None,
    ring=False,
    qk_norm=None,
) -> torch.Tensor:
    """decode_attention in torch (fp32 maths, q/k rounded to the cache dtype as the unfused path rounds)."""
    from ..norms import rms_norm_reference

    b, hkv, length, d = k_cache.shape
    dtype = k_cache.dtype
    q, k, v = qkv.view(b, heads + 2 * hkv, d).split([heads, hkv, hkv], dim=1)
    if qk_norm is not None:
        qn, kn, eps, offset = qk_norm
        q, k = rms_norm_reference(q, qn, eps, offset), rms_norm_reference(k, kn, eps, offset)
    p = pos.reshape(-1).long()
    c, s = cos[p].float()[:, None], sin[p].float()[:, None]
    q = _rotate(q.float(), c, s).to(dtype)
    k = _rotate(k.float(), c, s).to(dtype)
    col = int(slot.reshape(-1)[0])
    k_cache[:, :, col % length] = k
    v_cache[:, :, col % length] = v
    if ring:
        held = ring_columns(col, length, qkv.device)
        allowed = (held >= 0)[None] & valid.gather(1, held.clamp(min=0)[None].expand(b, -1))
        allowed = allowed | (held == col)[None]
    else:
        cols = torch.arange(length, device=qkv.device)
        allowed = (valid | (cols == col)[None]) & (cols <= col)[None]
        if window is not None:
            allowed = allowed & (cols > col - window)[None]
    group = heads // hkv
    keys = k_cache.float().repeat_interleave(group, dim=1)  # [B, H, L, D]
    values = v_cache.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhl,bhld->bhd", probs, values).reshape(b, heads * d).to(dtype)


def ring_columns(slot, window: int, device=None) -> torch.Tensor:
    """The absolute cache column each slot of a `window`-column ring holds once column `slot` (an int or a
    device tensor) is written there: the latest c <= slot with c % window == the ring slot; negative: none yet."""
    ring = torch.arange(window, device=device if device is not None else getattr(slot, "device", None))
    return slot - (slot - ring) % window


# ---------------------------------------------------------------------------------------- add + RMSNorm
@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    stride_h,
    y_ptr,
    stride_y,
    w_ptr,
    N,
    eps,
    offset,
    GEMMA_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr = True,
):
    """h += RMSNorm(y) a row (ADD), or h = RMSNorm(y)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    dt = y.dtype
    yf = y.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA_NORM:
        normed = (yf * rstd * (offset + w)).to(dt)
    else:
        normed = ((yf * rstd).to(dt).to(tl.float32) * w).to(dt)
    if ADD:
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        normed = (h.to(tl.float32) + normed.to(tl.float32)).to(dt)
    tl.store(h_ptr + row * stride_h + cols, normed, mask=mask)


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
    return _launch_rms_norm(h, y, norm, add=True)


def _launch_rms_norm(h: torch.Tensor, y: torch.Tensor, norm: tuple, add: bool) -> torch.Tensor:
    weight, eps, offset = norm
    _add_rms_norm_kernel[(h.shape[0],)](
        h,
        h.stride(0),
        y,
        y.stride(0),
        weight,
        h.shape[1],
        float(eps),
        float(offset),
        GEMMA_NORM=float(offset) != 0.0,
        BLOCK=next_power_of_2(h.shape[1]),
        ADD=add,
        num_warps=8,
    )
    return h


# ------------------------------------------------------------------------------------ greedy step emit
@triton.jit
def _greedy_emit_kernel(
    logits_ptr,
    stride_l,
    V,
    finished_ptr,
    done_ptr,
    count_ptr,
    eos_ptr,
    pad_ptr,
    out_ptr,
    stride_out,
    tok_ptr,
    pos_ptr,
    N_EOS,
    BLOCK_EOS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    idx = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride_l + cols, mask=cols < V, other=float("-inf"))
        x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest, as torch.argmax's does
        take = x > best  # strictly: the first index of the maximum stays
        idx = tl.where(take, cols, idx)
        best = tl.where(take, x, best)
    top = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == top, idx, 2147483647), axis=0)
    arg = tl.where(arg == 2147483647, 0, arg)
    fin = tl.load(finished_ptr + b) != 0
    count = tl.load(count_ptr)
    token = tl.where(fin, tl.load(pad_ptr), arg.to(tl.int64))
    e = tl.arange(0, BLOCK_EOS)
    eos = tl.load(eos_ptr + e, mask=e < N_EOS, other=-1)
    newly = (fin == 0) & (tl.sum((eos == token).to(tl.int32), axis=0) > 0)
    done = tl.load(done_ptr + b)
    tl.store(done_ptr + b, tl.where(newly, count, done))
    tl.store(finished_ptr + b, (fin | newly).to(tl.int8))
    tl.store(out_ptr + b * stride_out + count, token)
    tl.store(tok_ptr + b, token)
    tl.store(pos_ptr + b, tl.load(pos_ptr + b) + 1)


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
    _greedy_emit_kernel[(b,)](
        logits,
        logits.stride(0),
        logits.shape[1],
        finished.view(torch.int8),
        done_at,
        count,
        eos,
        pad,
        out,
        out.stride(0),
        tok,
        pos,
        eos.numel(),
        BLOCK_EOS=max(2, next_power_of_2(eos.numel())),
        BLOCK=2048 if not interpreter_enabled() else 64,
        num_warps=8,
    )
