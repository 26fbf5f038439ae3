"""Flash attention, forward and backward: causal or not, sliding window, logit softcap (Gemma2), GQA/MQA,
head_dim up to 256 (any size: the head dim is padded to a power of two by masking), packed rows (varlen),
attention sinks (gpt-oss: a learned logit per head that joins each row's softmax denominator and adds no value).

Layout as transformers' attention functions receive it: q (B, Hq, T, D), k/v (B, Hkv, S, D), any strides;
the output is (B, T, Hq, D) like `sdpa_attention_forward` returns it. GQA reads k/v head `h // (Hq // Hkv)`
and never repeats k/v in memory; dK/dV programs loop over the query heads of their group, so no atomics.

Which keys a query row sees is one rule, `_row_bounds`: query i (causal: at position p = i + S - T,
bottom-right aligned like flash-attn, so a decode step with a cache sees every cached key; else p = i)
sees keys first(i)..last(i):
  causal:              j <= p; with sliding_window W: p - W < j <= p (transformers' `sliding_window_overlay`
                       on top of `causal_mask_function`, masking_utils of transformers 5.17 to 5.23; Mistral,
                       Qwen2/3, Gemma2/3 and Mixtral all build their sliding masks from it);
  not causal + window: |p - j| <= W (transformers' `sliding_window_bidirectional_overlay`);
  packed rows:         also doc_start(i) <= j < doc_end(i), the document of token i.
Both bounds grow with i, so the keys of a query block split into blocks every row sees in full (no mask
work), edge blocks (masked) and blocks nobody sees (never loaded): the same split serves causal, window and
document boundaries. Backward mirrors it per key block (rows that see the key form an interval too).

Varlen: packed documents lie in one row, q (1, Hq, total, D), k/v (1, Hkv, total, D), `cu_seqlens` int32
(n+1) gives their boundaries. Internally every token carries its document's [start, end), so the grid runs
over the packed row as if it were one sequence and needs no max_seqlen and no host sync; the model
integration builds those bounds straight from position_ids (`packed_bounds`).

Sinks: the forward starts each row's online softmax at the sink (running max = the sink's logit, sum = 1) instead
of an empty one, so the log-sum-exp it keeps includes the sink and the backward's recomputed probabilities are the
sink-normalised ones with no change to the backward kernels (the sink carries no value, so delta = rowsum(dO * O)
stays its own term); the sink's gradient, -sum over rows of p_sink * delta, is one reduction over [B, H, T].

Forward keeps the output and the log-sum-exp (base 2, fp32); backward recomputes the probabilities in two
kernels and no T x S matrix is ever in memory. The dQ kernel runs first, one program per query block: it forms
delta = rowsum(dO * O) for its rows (stored for the next kernel; no launch of its own) and accumulates dQ over
the key blocks its rows see (3 matrix products per tile: S, dP, dQ). The dK/dV kernel, one program per key
block, loops over the query heads of its GQA group and the query blocks that see the key block (4 products:
S, dV, dP, dK), with query rows on the MMA's M dimension so that k and v stay B operands in shared memory.
7 products where a single pass needs 5, but deterministic (no atomics): a single pass that added each tile's
dQ share with fp32 atomics (commit 782a4de) measured several times slower with triton 3.6
(docs/benchmarks/kernels.md, "attention, host and layout notes"): the PTX has one scalar atom.add.f32 per
element. Tiles are read through TMA descriptors where AttentionTables.tma says they measured faster and the strides
allow (unit stride along the head dim, 16-byte aligned rows; rows past the end and the padded head dim come
back as zeros), else through masked pointer loads. fp32 accumulation; fp32 inputs use IEEE fp32 dots (no TF32).

`attention` dispatches: torch SDPA (cuDNN / flash) where it covers the case and measured faster (plain
causal or full attention on CUDA in bf16/fp16, no softcap, no window, not packed), the Triton kernel
otherwise; the torch reference on tensors Triton cannot run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tuning
from ._utils import cdiv, check_dtype, check_same_device, next_power_of_2, use_triton
from .jit_helpers import dot

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

# ----------------------------------------------------------------------------------------------------
# 1. Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _row_bounds(rows, T, S, window, START, END, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """First and last key (inclusive) each query row sees; START/END point at this batch row's doc bounds."""
    pos = rows
    if CAUSAL:
        pos = rows + (S - T)
    first = tl.zeros_like(rows)
    last = tl.zeros_like(rows) + (S - 1)
    if CAUSAL:
        last = tl.minimum(last, pos)
        if HAS_WINDOW:
            first = tl.maximum(first, pos - window + 1)
    elif HAS_WINDOW:
        first = tl.maximum(first, pos - window)
        last = tl.minimum(last, pos + window)
    if VARLEN:
        valid = rows < T
        first = tl.maximum(first, tl.load(START + rows, mask=valid, other=0))
        last = tl.minimum(last, tl.load(END + rows, mask=valid, other=0) - 1)
    return first, last


@triton.jit
def _key_bounds(cols, T, S, window, START, END, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """First and last query row (inclusive) that sees each key: `_row_bounds` solved for the row."""
    shift = 0
    if CAUSAL:
        shift = S - T
    first = tl.zeros_like(cols)
    last = tl.zeros_like(cols) + (T - 1)
    if CAUSAL:
        first = tl.maximum(first, cols - shift)
        if HAS_WINDOW:
            last = tl.minimum(last, cols - shift + window - 1)
    elif HAS_WINDOW:
        first = tl.maximum(first, cols - shift - window)
        last = tl.minimum(last, cols - shift + window)
    if VARLEN:  # q and k share the packing (T == S)
        valid = cols < S
        first = tl.maximum(first, tl.load(START + cols, mask=valid, other=0))
        last = tl.minimum(last, tl.load(END + cols, mask=valid, other=0) - 1)
    return first, last


@triton.jit
def _block_split(first, last, valid, n_max, BLOCK: tl.constexpr):
    """Given per-row [first, last] ranges over the other axis, the block-aligned loop limits a <= b <= c <= e:
    [a, b) and [c, e) need masking, every row sees all of [b, c)."""
    lo_need = tl.min(tl.where(valid, first, n_max), axis=0)
    hi_need = tl.max(tl.where(valid, last, -1), axis=0) + 1
    lo_full = tl.max(tl.where(valid, first, 0), axis=0)
    hi_full = tl.min(tl.where(valid, last, n_max), axis=0) + 1
    a = (lo_need // BLOCK) * BLOCK
    e = tl.maximum(hi_need, a)
    b = tl.minimum(tl.maximum((lo_full + BLOCK - 1) // BLOCK * BLOCK, a), e)
    c = tl.minimum(tl.maximum((hi_full // BLOCK) * BLOCK, b), e)
    return a, b, c, e


@triton.jit
def _rows_of(X, n, head_dim, stride_n, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """What `_tile` reads a (n, head_dim) matrix through: a TMA descriptor (rows past n and columns past head_dim
    come back as zeros) or the pointer itself."""
    if TMA:  # one return: the compiler wants one type out of a function, whichever branch the constexpr takes
        rows = tl.make_tensor_descriptor(X, shape=[n, head_dim], strides=[stride_n, 1], block_shape=[BLOCK, BLOCK_D])
    else:
        rows = X
    return rows


@triton.jit
def _tile(X, start, n, stride_n, stride_d, d, d_mask, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """Rows start..start+BLOCK of a (n, head_dim) matrix, zeros outside it."""
    if TMA:
        tile = X.load([start, 0])
    else:
        idx = start + tl.arange(0, BLOCK)
        tile = tl.load(
            X + idx[:, None] * stride_n + d[None, :] * stride_d, mask=(idx < n)[:, None] & d_mask[None, :], other=0.0
        )
    return tile


@triton.jit
def _scores(qk, qk_scale, cap_scale, HAS_SOFTCAP: tl.constexpr):
    """Scores in base-2 units, and tanh of the softcap (for backward's chain rule; qk itself otherwise)."""
    if HAS_SOFTCAP:
        # tanh from exp: no tanh in tl (libdevice's does not run under the interpreter); exact enough in fp32.
        # tanh(20) is 1 in fp32: the clamp only keeps exp finite.
        u = qk * qk_scale
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(u, 20.0)) + 1.0)
        return t * cap_scale, t
    return qk * qk_scale, qk


@triton.jit
def _fwd_loop(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    stride_ks,
    stride_kd,
    stride_vs,
    stride_vd,
    lo,
    hi,
    rows,
    first,
    last,
    S,
    d,
    d_mask,
    qk_scale,
    cap_scale,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _tile(K, start, S, stride_ks, stride_kd, d, d_mask, BLOCK_N, TMA)
        v = _tile(V, start, S, stride_vs, stride_vd, d, d_mask, BLOCK_N, TMA)
        qk = dot(q, tl.trans(k), PRECISION)
        if HAS_SOFTCAP:
            s, _ = _scores(qk, qk_scale, cap_scale, HAS_SOFTCAP)
            scale = 1.0
        else:  # scaled inside the exponent below: one FMA per score (scale > 0, so the max commutes with it)
            s, scale = qk, qk_scale
        if MASKED:
            seen = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    START,
    END,
    SINKS,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    n_heads,
    group,
    T,
    S,
    head_dim,
    window,
    qk_scale,
    cap_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the last query blocks see the most keys: run them first
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row_valid = rows < T
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    START += b.to(tl.int64) * T
    END += b.to(tl.int64) * T
    q = _tile(
        _rows_of(Q, T, head_dim, stride_qt, BLOCK_M, BLOCK_D, TMA),
        pid_m * BLOCK_M,
        T,
        stride_qt,
        stride_qd,
        d,
        d_mask,
        BLOCK_M,
        TMA,
    )
    K = _rows_of(K, S, head_dim, stride_ks, BLOCK_N, BLOCK_D, TMA)
    V = _rows_of(V, S, head_dim, stride_vs, BLOCK_N, BLOCK_D, TMA)
    first, last = _row_bounds(rows, T, S, window, START, END, CAUSAL, HAS_WINDOW, VARLEN)
    a, b_, c, e = _block_split(first, last, row_valid, S, BLOCK_N)

    # A finite start for the running max: a row whose first key blocks are all masked keeps alpha = 1, p = 0.
    # With a sink the row starts from it: max = its logit (base 2), sum = exp2(0) = 1, no value.
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _fwd_loop(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        a,
        b_,
        rows,
        first,
        last,
        S,
        d,
        d_mask,
        qk_scale,
        cap_scale,
        True,
        HAS_SOFTCAP,
        PRECISION,
        BLOCK_N,
        TMA,
    )
    acc, m_i, l_i = _fwd_loop(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        b_,
        c,
        rows,
        first,
        last,
        S,
        d,
        d_mask,
        qk_scale,
        cap_scale,
        False,
        HAS_SOFTCAP,
        PRECISION,
        BLOCK_N,
        TMA,
    )
    acc, m_i, l_i = _fwd_loop(
        acc,
        m_i,
        l_i,
        q,
        K,
        V,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        c,
        e,
        rows,
        first,
        last,
        S,
        d,
        d_mask,
        qk_scale,
        cap_scale,
        True,
        HAS_SOFTCAP,
        PRECISION,
        BLOCK_N,
        TMA,
    )
    l_i = tl.where(row_valid, l_i, 1.0)  # rows past T saw nothing; they are not stored
    acc = acc / l_i[:, None]
    O += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(
        O + rows[:, None] * stride_ot + d[None, :] * stride_od,
        acc.to(O.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )
    tl.store(LSE + bh.to(tl.int64) * T + rows, m_i + tl.log2(l_i), mask=row_valid)


@triton.jit
def _dkdv_loop(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    stride_qt,
    stride_qd,
    stride_dot,
    stride_dod,
    lo,
    hi,
    cols,
    T,
    S,
    window,
    START,
    END,
    d,
    d_mask,
    qk_scale,
    cap_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TMA: tl.constexpr,
):
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_valid = rows < T
        q = _tile(Q, start, T, stride_qt, stride_qd, d, d_mask, BLOCK_M, TMA)
        do = _tile(DO, start, T, stride_dot, stride_dod, d, d_mask, BLOCK_M, TMA)
        lse = tl.load(LSE + rows, mask=row_valid, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=row_valid, other=0.0)
        # Query rows along dim 0 as in the forward: k and v are only ever B operands, so they stay in shared
        # memory. Keys along dim 0 (k, v as A operands) held them in registers next to the fp32 dK/dV and
        # spilled and ran slower (`python scripts/attention_gpu.py --sweep`; docs/benchmarks/kernels.md).
        qk = dot(q, tl.trans(k), PRECISION)
        s, t = _scores(qk, qk_scale, cap_scale, HAS_SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            first, last = _row_bounds(rows, T, S, window, START, END, CAUSAL, HAS_WINDOW, VARLEN)
            seen = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None]) & row_valid[:, None]
            p = tl.where(seen, p, 0.0)
        dv += dot(tl.trans(p.to(do.dtype)), do, PRECISION)
        dp = dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dk += dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    START,
    END,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_dob,
    stride_dot,
    stride_doh,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dks,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvs,
    stride_dvd,
    n_heads,
    n_kv_heads,
    group,
    T,
    S,
    head_dim,
    window,
    qk_scale,
    cap_scale,
    ds_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    col_valid = cols < S
    kv_mask = col_valid[:, None] & d_mask[None, :]
    k = tl.load(
        K
        + b.to(tl.int64) * stride_kb
        + hk.to(tl.int64) * stride_kh
        + cols[:, None] * stride_ks
        + d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + b.to(tl.int64) * stride_vb
        + hk.to(tl.int64) * stride_vh
        + cols[:, None] * stride_vs
        + d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    START += b.to(tl.int64) * T
    END += b.to(tl.int64) * T
    first, last = _key_bounds(cols, T, S, window, START, END, CAUSAL, HAS_WINDOW, VARLEN)
    a, b_, c, e = _block_split(first, last, col_valid, T, BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(group):  # the query heads sharing this k/v head: summed here, no atomics
        h = hk * group + g
        Qh = _rows_of(
            Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh, T, head_dim, stride_qt, BLOCK_M, BLOCK_D, TMA
        )
        DOh = _rows_of(
            DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh,
            T,
            head_dim,
            stride_dot,
            BLOCK_M,
            BLOCK_D,
            TMA,
        )
        LSEh = LSE + (b * n_heads + h).to(tl.int64) * T
        DELTAh = DELTA + (b * n_heads + h).to(tl.int64) * T
        dk, dv = _dkdv_loop(
            dk,
            dv,
            k,
            v,
            Qh,
            DOh,
            LSEh,
            DELTAh,
            stride_qt,
            stride_qd,
            stride_dot,
            stride_dod,
            a,
            b_,
            cols,
            T,
            S,
            window,
            START,
            END,
            d,
            d_mask,
            qk_scale,
            cap_scale,
            True,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            VARLEN,
            PRECISION,
            BLOCK_M,
            TMA,
        )
        dk, dv = _dkdv_loop(
            dk,
            dv,
            k,
            v,
            Qh,
            DOh,
            LSEh,
            DELTAh,
            stride_qt,
            stride_qd,
            stride_dot,
            stride_dod,
            b_,
            c,
            cols,
            T,
            S,
            window,
            START,
            END,
            d,
            d_mask,
            qk_scale,
            cap_scale,
            False,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            VARLEN,
            PRECISION,
            BLOCK_M,
            TMA,
        )
        dk, dv = _dkdv_loop(
            dk,
            dv,
            k,
            v,
            Qh,
            DOh,
            LSEh,
            DELTAh,
            stride_qt,
            stride_qd,
            stride_dot,
            stride_dod,
            c,
            e,
            cols,
            T,
            S,
            window,
            START,
            END,
            d,
            d_mask,
            qk_scale,
            cap_scale,
            True,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            VARLEN,
            PRECISION,
            BLOCK_M,
            TMA,
        )
    tl.store(
        DK
        + b.to(tl.int64) * stride_dkb
        + hk.to(tl.int64) * stride_dkh
        + cols[:, None] * stride_dks
        + d[None, :] * stride_dkd,
        (dk * ds_scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV
        + b.to(tl.int64) * stride_dvb
        + hk.to(tl.int64) * stride_dvh
        + cols[:, None] * stride_dvs
        + d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _dq_loop(
    dq,
    q,
    do,
    lse,
    delta,
    K,
    V,
    stride_ks,
    stride_kd,
    stride_vs,
    stride_vd,
    lo,
    hi,
    first,
    last,
    S,
    d,
    d_mask,
    qk_scale,
    cap_scale,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _tile(K, start, S, stride_ks, stride_kd, d, d_mask, BLOCK_N, TMA)
        v = _tile(V, start, S, stride_vs, stride_vd, d, d_mask, BLOCK_N, TMA)
        qk = dot(q, tl.trans(k), PRECISION)
        s, t = _scores(qk, qk_scale, cap_scale, HAS_SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            seen = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])
            p = tl.where(seen, p, 0.0)
        dp = dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += dot(ds.to(k.dtype), k, PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DELTA,
    DQ,
    START,
    END,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    stride_dob,
    stride_dot,
    stride_doh,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqt,
    stride_dqd,
    n_heads,
    group,
    T,
    S,
    head_dim,
    window,
    qk_scale,
    cap_scale,
    ds_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest blocks first, as in the forward
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row_valid = rows < T
    mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(
        Q
        + b.to(tl.int64) * stride_qb
        + h.to(tl.int64) * stride_qh
        + rows[:, None] * stride_qt
        + d[None, :] * stride_qd,
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO
        + b.to(tl.int64) * stride_dob
        + h.to(tl.int64) * stride_doh
        + rows[:, None] * stride_dot
        + d[None, :] * stride_dod,
        mask=mask,
        other=0.0,
    )
    lse = tl.load(LSE + bh.to(tl.int64) * T + rows, mask=row_valid, other=float("inf"))
    # delta = rowsum(dO * O) formed here (no kernel of its own: measured as fast or faster), stored for dK/dV
    o = tl.load(
        O
        + b.to(tl.int64) * stride_ob
        + h.to(tl.int64) * stride_oh
        + rows[:, None] * stride_ot
        + d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * T + rows, delta, mask=row_valid)
    K = _rows_of(
        K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh, S, head_dim, stride_ks, BLOCK_N, BLOCK_D, TMA
    )
    V = _rows_of(
        V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh, S, head_dim, stride_vs, BLOCK_N, BLOCK_D, TMA
    )
    START += b.to(tl.int64) * T
    END += b.to(tl.int64) * T
    first, last = _row_bounds(rows, T, S, window, START, END, CAUSAL, HAS_WINDOW, VARLEN)
    a, b_, c, e = _block_split(first, last, row_valid, S, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_loop(
        dq,
        q,
        do,
        lse,
        delta,
        K,
        V,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        a,
        b_,
        first,
        last,
        S,
        d,
        d_mask,
        qk_scale,
        cap_scale,
        True,
        HAS_SOFTCAP,
        PRECISION,
        BLOCK_N,
        TMA,
    )
    dq = _dq_loop(
        dq,
        q,
        do,
        lse,
        delta,
        K,
        V,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        b_,
        c,
        first,
        last,
        S,
        d,
        d_mask,
        qk_scale,
        cap_scale,
        False,
        HAS_SOFTCAP,
        PRECISION,
        BLOCK_N,
        TMA,
    )
    dq = _dq_loop(
        dq,
        q,
        do,
        lse,
        delta,
        K,
        V,
        stride_ks,
        stride_kd,
        stride_vs,
        stride_vd,
        c,
        e,
        first,
        last,
        S,
        d,
        d_mask,
        qk_scale,
        cap_scale,
        True,
        HAS_SOFTCAP,
        PRECISION,
        BLOCK_N,
        TMA,
    )
    tl.store(
        DQ
        + b.to(tl.int64) * stride_dqb
        + h.to(tl.int64) * stride_dqh
        + rows[:, None] * stride_dqt
        + d[None, :] * stride_dqd,
        (dq * ds_scale).to(DQ.dtype.element_ty),
        mask=mask,
    )


# ----------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One launch of `_attn_fwd`, `_attn_bwd_dq` or `_attn_bwd_dkdv`."""

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # read tiles through TMA descriptors (where the tensors' layout allows; else pointers)


@dataclasses.dataclass(frozen=True)
class AttentionTables:
    """The constants `attention_config` reads: per kernel, (block_m, block_n, num_warps, num_stages) per head-dim
    bucket (the padded power of two, up to 64 / 128 / 256), and the kernels that read through TMA per bucket.
    scripts/attention_gpu.py measures others through `tuning.override("attention", functools.partial(
    attention_config, tables=...))`. Hopper has 228 KB of shared memory per SM: at D 256 a 64x64 bf16 k and v
    tile pair is 64 KB per stage. How each entry won: docs/benchmarks/kernels.md, "attention"
    (scripts/attention_gpu.py --sweep, --sweep3, --sweep4, --breakdown)."""

    # D128: 128x128 8 warps; D256: 128x64, 2 stages.
    fwd: tuple = ((64, (128, 64, 8, 3)), (128, (128, 128, 8, 3)), (256, (128, 64, 8, 2)))
    # dK/dV with query rows on the MMA's M dim (D128 64x64 4 warps 2 stages, D256 64x32), and dQ.
    dkdv: tuple = ((128, (64, 64, 4, 2)), (256, (64, 32, 4, 2)))
    dq: tuple = ((128, (128, 64, 8, 3)), (256, (128, 32, 8, 3)))
    # The kernels that read their tiles through TMA descriptors, per bucket; forming delta in the dQ kernel
    # beat a separate delta kernel.
    tma: tuple = ((128, ("fwd", "dkdv")), (256, ("fwd", "dq")))


ATTENTION_TABLES = AttentionTables()
# The interpreter (CPU tests): small, unequal tiles so that tiny shapes still cross block and edge cases.
INTERPRETER_TILE = (16, 32, 1, 1)


def attention_config(
    kernel: str, block_d: int, device: torch.device, *, tables: AttentionTables | None = None
) -> AttentionConfig:
    """The launch of `kernel` ("fwd", "dq" or "dkdv") at padded head dim block_d. The interpreter takes small
    tiles but follows the TMA table, so the CPU tests run both ways."""
    tables = tables or ATTENTION_TABLES
    tile = _bucket(getattr(tables, kernel), block_d) if device.type == "cuda" else INTERPRETER_TILE
    return AttentionConfig(*tile, tma=kernel in _bucket(tables.tma, block_d))


def _config(kernel: str, block_d: int, device: torch.device) -> AttentionConfig:
    return tuning.pick("attention", attention_config, kernel, block_d, device)


def _bucket(table: tuple, block_d: int):
    for bucket, entry in table:
        if block_d <= bucket:
            return entry
    return table[-1][1]


def _tma_alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(cfg: AttentionConfig, *tensors: torch.Tensor) -> bool:
    """TMA descriptors when the config asks for them and every tensor's rows suit the copy engine."""
    if not cfg.tma:
        return False
    for t in tensors:
        size = t.element_size()
        aligned = t.data_ptr() % 16 == 0 and all(x * size % 16 == 0 for x in t.stride()[:3])
        if t.stride(3) != 1 or not aligned or t.shape[3] * size < 16:
            return False
    if tensors[0].device.type == "cuda":
        # descriptors built on the device need a scratch allocator (per thread: autograd's backward runs in its own)
        try:
            from triton.runtime._allocation import NullAllocator, _allocator

            if not isinstance(_allocator.get(), NullAllocator):
                return True
        except ImportError:
            pass
        triton.set_allocator(_tma_alloc)
    return True


class _Problem(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    T: int
    S: int
    D: int
    block_d: int
    causal: bool
    window: int | None
    softcap: float | None
    scale: float


def _problem(q, k, causal, window, softcap, scale) -> _Problem:
    D = q.shape[3]
    return _Problem(
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        k.shape[2],
        D,
        max(16, next_power_of_2(D)),
        causal,
        window,
        softcap,
        scale,
    )


def _consts(p: _Problem, dtype: torch.dtype, interpret: bool) -> dict:
    if p.softcap is not None:
        qk_scale, cap_scale = p.scale / p.softcap, p.softcap * LOG2E
    else:
        qk_scale, cap_scale = p.scale * LOG2E, 1.0
    return dict(
        qk_scale=qk_scale,
        cap_scale=cap_scale,
        window=p.window or 0,
        BLOCK_D=p.block_d,
        CAUSAL=p.causal,
        HAS_WINDOW=p.window is not None,
        HAS_SOFTCAP=p.softcap is not None,
        PRECISION="ieee" if dtype == torch.float32 else "upcast" if interpret and dtype == torch.bfloat16 else "tf32",
    )


def _flash_forward(q, k, v, p: _Problem, start, end, config: AttentionConfig | None = None, sinks=None):
    out = torch.empty((p.B, p.T, p.Hq, p.D), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.B, p.Hq, p.T), dtype=torch.float32, device=q.device)
    cfg = config or _config("fwd", p.block_d, q.device)
    varlen = start is not None
    _attn_fwd[(cdiv(p.T, cfg.block_m), p.B * p.Hq)](
        q,
        k,
        v,
        out,
        lse,
        start if varlen else lse,
        end if varlen else lse,
        sinks if sinks is not None else lse,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        p.Hq,
        p.Hq // p.Hkv,
        p.T,
        p.S,
        p.D,
        **_consts(p, q.dtype, q.device.type != "cuda"),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        VARLEN=varlen,
        HAS_SINKS=sinks is not None,
        TMA=_use_tma(cfg, q, k, v),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse


def _launch_dq(do, q, k, v, out, lse, delta, dq, p: _Problem, start, end, cfg: AttentionConfig):
    """dQ per query block; forms delta = rowsum(dO * O) on the way and stores it for the dK/dV kernel."""
    varlen = start is not None
    _attn_bwd_dq[(cdiv(p.T, cfg.block_m), p.B * p.Hq)](
        q,
        k,
        v,
        out,
        do,
        lse,
        delta,
        dq,
        *((start, end) if varlen else (lse, lse)),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *do.stride(),
        *dq.stride(),
        p.Hq,
        p.Hq // p.Hkv,
        p.T,
        p.S,
        p.D,
        ds_scale=p.scale,
        **_consts(p, q.dtype, q.device.type != "cuda"),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        VARLEN=varlen,
        TMA=_use_tma(cfg, k, v),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch_dkdv(do, q, k, v, lse, delta, dk, dv, p: _Problem, start, end, cfg: AttentionConfig):
    """dK/dV per key block, summed over the query heads of its group."""
    varlen = start is not None
    _attn_bwd_dkdv[(cdiv(p.S, cfg.block_n), p.B * p.Hkv)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        *((start, end) if varlen else (lse, lse)),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *do.stride(),
        *dk.stride(),
        *dv.stride(),
        p.Hq,
        p.Hkv,
        p.Hq // p.Hkv,
        p.T,
        p.S,
        p.D,
        ds_scale=p.scale,
        **_consts(p, q.dtype, q.device.type != "cuda"),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        VARLEN=varlen,
        TMA=_use_tma(cfg, q, do),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _flash_backward(do, q, k, v, out, lse, p: _Problem, start, end, sinks=None):
    """(dq, dk, dv, dsinks or None): dQ per query block (it forms delta too), then dK/dV per key block.
    Deterministic: no atomics."""
    delta = torch.empty_like(lse)
    # empty_like keeps q/k/v's memory layout: the grads flow back through the same transposes as the inputs.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _launch_dq(do, q, k, v, out, lse, delta, dq, p, start, end, _config("dq", p.block_d, q.device))
    _launch_dkdv(do, q, k, v, lse, delta, dk, dv, p, start, end, _config("dkdv", p.block_d, q.device))
    return dq, dk, dv, (None if sinks is None else _sinks_grad(sinks, lse, delta))


def _sinks_grad(sinks, lse, delta):
    """d loss / d sink[h] = -sum over (b, t) of p_sink * delta: the sink's probability exp2(sink log2 e - lse) (lse in
    base 2, the sink included) times rowsum(dO * O), which the dQ kernel stored."""
    p_sink = torch.exp2(sinks.float()[None, :, None] * LOG2E - lse)
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)


# ----------------------------------------------------------------------------------------------------
# 3. Autograd function
# ----------------------------------------------------------------------------------------------------


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem, start, end, sinks=None):  # backward's extra None is dropped without sinks
        out, lse = _flash_forward(q, k, v, problem, start, end, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.problem, ctx.bounds = problem, (start, end)  # int32 bounds: no grads, never written in place
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = _flash_backward(do, q, k, v, out, lse, ctx.problem, *ctx.bounds, sinks=sinks)
        return dq, dk, dv, None, None, None, dsinks if ctx.needs_input_grad[6:7] == (True,) else None


# ----------------------------------------------------------------------------------------------------
# 4. Public functions: checks, varlen helpers, the dispatcher
# ----------------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, causal, sliding_window, softcap, scale, cu_seqlens, max_seqlen, sinks=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (batch, heads, tokens, head_dim); got shape {tuple(t.shape)}")
        check_dtype(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must have q's dtype {q.dtype}; got k {k.dtype}, v {v.dtype}")
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    B, Hq, T, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have q's batch {B} and head_dim {D}: shape ({B}, Hkv, S, {D}); got {tuple(k.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be between 1 and {MAX_HEAD_DIM}; got {D}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"k's head count {k.shape[1]} must divide q's head count {Hq} (GQA/MQA)")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool; got {causal!r}")
    if causal and k.shape[2] < T:
        raise ValueError(f"causal attention needs k at least as long as q (keys {k.shape[2]} < queries {T})")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1; got {sliding_window!r}")
    if sliding_window is not None and not causal and k.shape[2] != T:
        raise ValueError(f"sliding_window without causal needs q and k of one length; got {T} and {k.shape[2]}")
    for name, x in (("softcap", softcap), ("scale", scale)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0):
            raise ValueError(f"{name} must be None or a finite number > 0; got {x!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (Hq,):
            raise ValueError(f"sinks must be a tensor of shape ({Hq},) (one logit per query head); got {sinks!r:.80}")
        check_dtype("sinks", sinks)
        check_same_device(q=q, sinks=sinks)
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen is only meaningful with cu_seqlens; got cu_seqlens None")
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor; got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}"
            f" of shape {tuple(getattr(cu_seqlens, 'shape', ()))}"
        )
    if B != 1 or k.shape[2] != T:
        raise ValueError(
            f"with cu_seqlens, q and k must be packed rows (1, H, total, D) of one length; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have at least 2 entries (0 and the total); got {cu_seqlens.numel()}")
    # One host sync: the bounds must be checked before a kernel reads memory through them.
    first, last, increasing = torch.stack(
        (cu_seqlens[0], cu_seqlens[-1], (cu_seqlens[1:] > cu_seqlens[:-1]).all().to(torch.int32))
    ).tolist()
    if first != 0 or last != T or not increasing:
        shown = cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else f"first {first}, last {last}"
        raise ValueError(f"cu_seqlens must increase strictly from 0 to the packed length {T}; got {shown}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1):
        raise ValueError(f"max_seqlen must be None or an int >= 1; got {max_seqlen!r}")


def bounds_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (shape (1, total), int32): the start and end of its document. On the device, no host sync."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    doc = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    return cu_seqlens[doc].view(1, total), cu_seqlens[doc + 1].view(1, total)


def packed_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (B, T) int32: start and end of its document, from position_ids that restart per document.

    A document starts wherever the position does not follow the previous one by 1 (transformers'
    `find_packed_sequence_indices` rule), so rows of one unpacked sequence give (0, T). Device ops only,
    no host sync: the model integration calls this inside the layer stack."""
    B, T = position_ids.shape
    idx = torch.arange(T, device=position_ids.device, dtype=torch.int32).expand(B, T)
    is_start = torch.ones((B, T), dtype=torch.bool, device=position_ids.device)
    is_start[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    start = torch.where(is_start, idx, 0).cummax(dim=1).values
    next_start = torch.full((B, T), T, dtype=torch.int32, device=position_ids.device)
    next_start[:, :-1] = torch.where(is_start[:, 1:], idx[:, 1:], T)
    end = next_start.flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def right_padding_bounds(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a 2-D padding mask (B, T) (nonzero: a real token): ((2, B, T) int32 per-token (start, end)), and a
    bool per row: whether the row is right-padded (its real tokens, at least one, come first).

    For right-padded rows the bounds are exact, pad tokens included: with causality, token i sees the real
    keys j <= i, which is what transformers' padded mask lets every query see. The kernel reads a token's
    bounds both as the keys it sees and as the queries that see it, so real tokens get (0, T) (as queries
    causality keeps them to real keys; as keys every later token, pads too, sees them) and pads (0, real
    count) (as queries they see the real keys; as keys no one). A left pad query sees no key at all in
    transformers (its row is fully masked: eager then averages over every key), which bounds cannot
    express: callers check `right_padded` first. Device ops only, no host sync."""
    valid = valid.bool()
    B, T = valid.shape
    count = valid.sum(dim=1)
    leading = valid.int().cumprod(dim=1).sum(dim=1)  # real tokens before the first pad
    right_padded = (leading == count) & (count > 0)
    end = torch.where(valid, T, count[:, None]).to(torch.int32)
    return torch.stack((torch.zeros_like(end), end)), right_padded


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32, max_seqlen) for one packed row of position_ids (shape (total,) or (1, total)) that
    restart per document, as TRL's padding-free collator builds them.

    This syncs with the host, unavoidably: cu_seqlens' length (documents + 1) and max_seqlen depend on the
    data. Inside a model prefer `packed_bounds`, which the kernel takes directly and which does not sync."""
    pos = position_ids.reshape(-1) if position_ids.dim() == 1 or position_ids.shape[0] == 1 else None
    if pos is None:
        raise ValueError(f"position_ids must be one packed row (total,) or (1, total); got {tuple(position_ids.shape)}")
    total = pos.numel()
    starts = torch.ones(total, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] - pos[:-1] != 1
    cu = torch.cat((starts.nonzero().flatten(), torch.tensor([total], device=pos.device))).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


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


# ----------------------------------------------------------------------------------------------------
# 5. Reference (plain torch, fp32 math; float64 inputs are computed in float64)
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# 6. Registered operators: what torch.compile traces (eager calls keep the cheaper autograd Function)
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fastplug::flash_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, int? window, float? softcap, float scale, Tensor? doc_start, "
    "Tensor? doc_end, Tensor? sinks) -> (Tensor, Tensor)",
)
def _flash_attention_op(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks):
    problem = _problem(q, k, causal, window, softcap, scale)
    out, lse = _flash_forward(q, k, v, problem, doc_start, doc_end, sinks=sinks)
    return out, lse


@_flash_attention_op.register_fake
def _(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks):
    B, Hq, T, D = q.shape
    return q.new_empty((B, T, Hq, D)), q.new_empty((B, Hq, T), dtype=torch.float32)


@torch.library.custom_op(
    "fastplug::flash_attention_backward",
    mutates_args=(),
    schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, int? window, "
    "float? softcap, float scale, Tensor? doc_start, Tensor? doc_end, Tensor? sinks) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _flash_attention_backward_op(do, q, k, v, out, lse, causal, window, softcap, scale, doc_start, doc_end, sinks):
    problem = _problem(q, k, causal, window, softcap, scale)
    dq, dk, dv, dsinks = _flash_backward(do, q, k, v, out, lse, problem, doc_start, doc_end, sinks=sinks)
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks  # operators return tensors, not None


@_flash_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, causal, window, softcap, scale, doc_start, doc_end, sinks):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_flash_attention(ctx, inputs, output):
    q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, doc_start, doc_end, sinks)
    ctx.problem = (causal, window, softcap, scale)


def _flash_attention_op_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, doc_start, doc_end, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attention_backward_op(
        grad_out, q, k, v, out, lse, *ctx.problem, doc_start, doc_end, sinks
    )
    return dq, dk, dv, None, None, None, None, None, None, dsinks if sinks is not None else None


_flash_attention_op.register_autograd(_flash_attention_op_backward, setup_context=_setup_flash_attention)
