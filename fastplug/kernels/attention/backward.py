"""The backward kernels and their launchers: `_attn_bwd_dq`, then `_attn_bwd_dkdv` (`_flash_backward` runs both),
and the sinks' gradient (`_sinks_grad`).

The backward recomputes the probabilities from the forward's log-sum-exp in two kernels and no T x S matrix is ever
in memory. The dQ kernel runs first, one program per query block: it forms delta = rowsum(dO * O) for its rows
(stored for the next kernel; no launch of its own) and accumulates dQ over the key blocks its rows see (3 matrix
products per tile: S, dP, dQ). The dK/dV kernel, one program per key block, loops over the query heads of its GQA
group and the query blocks that see the key block (4 products: S, dV, dP, dK), with query rows on the MMA's M
dimension so that k and v stay B operands in shared memory. 7 products where a single pass needs 5, but
deterministic (no atomics): a single pass that added each tile's dQ share with fp32 atomics (commit 782a4de)
measured several times slower with triton 3.6 (docs/benchmarks/kernels.md, "attention, host and layout notes"): the
PTX has one scalar atom.add.f32 per element.

The sink's gradient, -sum over rows of p_sink * delta, is one reduction over [B, H, T] of the delta the dQ
kernel stored (the forward's log-sum-exp includes the sink, so the kernels need no change for sinks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import cdiv
from ..jit_helpers import dot
from .config import LOG2E, AttentionConfig, _config, _launch_args, _operand, _Problem, _use_tma
from .tiles import _block_split, _key_bounds, _row_bounds, _rows_of, _scores, _tile


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


@triton.jit(do_not_specialize=["T", "S"])  # a new batch length compiles nothing
def _attn_bwd_dkdv(
    Qs, Ks, Vs, DOs, LSE, DELTA, DKs, DVs, START, END, T, S, heads, scores, M: tl.constexpr, TILE: tl.constexpr
):
    """Qs, Ks, Vs, DOs, DKs, DVs: `Operand`s (dO's tokens before its heads in memory); heads, scores: `Heads`,
    `Scores`; M, TILE: `Mask`, `Tile`. LSE, DELTA: the forward's log-sum-exp and the dQ kernel's rowsum(dO * O)."""
    Q, stride_qb, stride_qh, stride_qt, stride_qd = Qs
    K, stride_kb, stride_kh, stride_ks, stride_kd = Ks
    V, stride_vb, stride_vh, stride_vs, stride_vd = Vs
    DO, stride_dob, stride_doh, stride_dot, stride_dod = DOs
    DK, stride_dkb, stride_dkh, stride_dks, stride_dkd = DKs
    DV, stride_dvb, stride_dvh, stride_dvs, stride_dvd = DVs
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


@triton.jit(do_not_specialize=["T", "S"])  # a new batch length compiles nothing
def _attn_bwd_dq(
    Qs, Ks, Vs, Os, DOs, LSE, DELTA, DQs, START, END, T, S, heads, scores, M: tl.constexpr, TILE: tl.constexpr
):
    """Qs, Ks, Vs, Os, DOs, DQs: `Operand`s (O's and dO's tokens before their heads in memory); heads, scores:
    `Heads`, `Scores`; M, TILE: `Mask`, `Tile`. Stores delta = rowsum(dO * O) into DELTA for the dK/dV kernel."""
    Q, stride_qb, stride_qh, stride_qt, stride_qd = Qs
    K, stride_kb, stride_kh, stride_ks, stride_kd = Ks
    V, stride_vb, stride_vh, stride_vs, stride_vd = Vs
    O, stride_ob, stride_oh, stride_ot, stride_od = Os
    DO, stride_dob, stride_doh, stride_dot, stride_dod = DOs
    DQ, stride_dqb, stride_dqh, stride_dqt, stride_dqd = DQs
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


def _launch_dq(do, q, k, v, out, lse, delta, dq, p: _Problem, start, end, cfg: AttentionConfig):
    """dQ per query block; forms delta = rowsum(dO * O) on the way and stores it for the dK/dV kernel."""
    varlen = start is not None
    _attn_bwd_dq[(cdiv(p.T, cfg.block_m), p.B * p.Hq)](
        _operand(q),
        _operand(k),
        _operand(v),
        _operand(out, tokens_before_heads=True),
        _operand(do, tokens_before_heads=True),
        lse,
        delta,
        _operand(dq),
        *((start, end) if varlen else (lse, lse)),
        p.T,
        p.S,
        *_launch_args(p, q, cfg, varlen, False, _use_tma(cfg, k, v)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch_dkdv(do, q, k, v, lse, delta, dk, dv, p: _Problem, start, end, cfg: AttentionConfig):
    """dK/dV per key block, summed over the query heads of its group."""
    varlen = start is not None
    _attn_bwd_dkdv[(cdiv(p.S, cfg.block_n), p.B * p.Hkv)](
        _operand(q),
        _operand(k),
        _operand(v),
        _operand(do, tokens_before_heads=True),
        lse,
        delta,
        _operand(dk),
        _operand(dv),
        *((start, end) if varlen else (lse, lse)),
        p.T,
        p.S,
        *_launch_args(p, q, cfg, varlen, False, _use_tma(cfg, q, do)),
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
