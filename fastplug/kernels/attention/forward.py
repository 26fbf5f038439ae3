"""The forward kernel `_attn_fwd`, one program per query block and head, and its launcher `_flash_forward`.

Each program runs an online softmax over the key blocks its rows see (`tiles._block_split`: the masked edge
blocks, then the blocks every row sees in full without mask work, then the other edge) and keeps the output and
the log-sum-exp (base 2, fp32) for the backward; no T x S matrix is ever in memory. Causal: the last query
blocks see the most keys, so they run first.

Sinks: the forward starts each row's online softmax at the sink (running max = the sink's logit, sum = 1) instead
of an empty one, so the log-sum-exp it keeps includes the sink and the backward's recomputed probabilities are the
sink-normalised ones with no change to the backward kernels (the sink carries no value, so delta = rowsum(dO * O)
stays its own term); the sink's gradient, -sum over rows of p_sink * delta, is one reduction over [B, H, T].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import cdiv
from ..jit_helpers import dot
from .config import AttentionConfig, _config, _launch_args, _operand, _Problem, _use_tma
from .tiles import _block_split, _row_bounds, _rows_of, _scores, _tile


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


@triton.jit(do_not_specialize=["T", "S"])  # a new batch length compiles nothing
def _attn_fwd(Qs, Ks, Vs, Os, LSE, START, END, SINKS, T, S, heads, scores, M: tl.constexpr, TILE: tl.constexpr):
    """Qs, Ks, Vs, Os: `Operand`s (the output's tokens before its heads in memory); heads, scores: `Heads`, `Scores`;
    M, TILE: `Mask`, `Tile`. START, END: per-token document bounds (read with M.VARLEN); SINKS: a logit per query
    head (read with M.HAS_SINKS)."""
    Q, stride_qb, stride_qh, stride_qt, stride_qd = Qs
    K, stride_kb, stride_kh, stride_ks, stride_kd = Ks
    V, stride_vb, stride_vh, stride_vs, stride_vd = Vs
    O, stride_ob, stride_oh, stride_ot, stride_od = Os
    n_heads, n_kv_heads, group, head_dim = heads
    window, qk_scale, cap_scale, ds_scale = scores
    # constexpr fields bound by name: Triton 3.6 hands a tuple's field on as a plain value (docs/contributing.md)
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    PRECISION: tl.constexpr = TILE.PRECISION
    TMA: tl.constexpr = TILE.TMA
    CAUSAL: tl.constexpr = M.CAUSAL
    HAS_WINDOW: tl.constexpr = M.HAS_WINDOW
    HAS_SOFTCAP: tl.constexpr = M.HAS_SOFTCAP
    VARLEN: tl.constexpr = M.VARLEN
    HAS_SINKS: tl.constexpr = M.HAS_SINKS
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


def _flash_forward(q, k, v, p: _Problem, start, end, config: AttentionConfig | None = None, sinks=None):
    out = torch.empty((p.B, p.T, p.Hq, p.D), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.B, p.Hq, p.T), dtype=torch.float32, device=q.device)
    cfg = config or _config("fwd", p.block_d, q.device)
    varlen = start is not None
    _attn_fwd[(cdiv(p.T, cfg.block_m), p.B * p.Hq)](
        _operand(q),
        _operand(k),
        _operand(v),
        _operand(out, tokens_before_heads=True),
        lse,
        start if varlen else lse,
        end if varlen else lse,
        sinks if sinks is not None else lse,
        p.T,
        p.S,
        *_launch_args(p, q, cfg, varlen, sinks is not None, _use_tma(cfg, q, k, v)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse
