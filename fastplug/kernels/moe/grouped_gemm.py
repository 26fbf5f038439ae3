"""Grouped GEMM over experts with the token permutation fused into its loads and stores.

Rows are grouped by expert: expert e owns rows [offsets[e-1], offsets[e]) (offsets are cumulative ends,
as torch._grouped_mm takes them). Row m of the product is

    out[scatter_index[m]] = row_weights[m] * (x[gather_index[m]] @ w[e]^T)      w: [E, N, K]

so the first GEMM of an MoE MLP reads token rows straight from the hidden states (no permuted copy) and the
second writes each row back to its (token, slot) place already scaled by its routing weight.

Kernels:
- `_grouped_mm`: forward and dX (dX is the same product against w[e] read transposed, through strides).
  Programs map to (expert, row tile, column tile) on the device: each program reads the offsets and finds
  its tile in the per-expert tile counts, so there is no host sync and an expert with no rows costs nothing.
  Optional epilogue: a rank-r LoRA term (t[m] @ b[e]^T, t = x A^T computed by another grouped GEMM, b = s B) and a
  per-expert bias (gpt-oss), both before the row weight.
- `_grouped_mm_glu`: the gate_up GEMM with the gated activation in its epilogue (gate and up columns of one
  program in two accumulators; h = act(gate) * up, and [gate, up] only when the backward needs it); the activation
  and the columns' layout (halves or interleaved) are a `glu.GluSpec`, the bias an option.
- `_grouped_mm_dw`: dW[e] = sum over the expert's rows of (row_weights * dy)^T x, one program per
  (expert, N tile, K tile) looping over that expert's whole BLOCK_M blocks of rows unmasked, then the
  partial last block masked (an empty expert writes zeros).
- `_scale_scatter_rows`: the epilogue of the torch._grouped_mm path (rows scaled and scattered in one pass).

Launch paths, picked per launch by the autotuner (`tuning.config_for`, cached on disk), each a candidate:
"ptr" (every tile through pointer loads), "tma" (tensor descriptors, Hopper's bulk copies, for the weight
tiles and for rows that are not gathered; falls back to pointers where strides do not allow one), "torch"
(torch._grouped_mm, CUTLASS on Hopper, on a gathered copy of the rows, then `_scale_scatter_rows`; bf16
without LoRA) and for the glu kind "split" (the tuned GEMM, then the activation as its own pass).
No path wins everywhere: what the tuner picked per shape is in docs/benchmarks/kernels.md ("MoE";
`python -m fastplug.bench moe-tune ...` reruns it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import cdiv, check_dtype, check_same_device, next_power_of_2, use_triton
from ..jit_helpers import dot_acc
from . import tuning
from .args import Bias, DwSpec, Experts, GluMmSpec, GluOut, LoRA, MmSpec, Rows, Tile
from .glu import GluSpec, glu_columns, glu_rows_forward, glu_terms

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton without host-side tensor descriptors: pointer loads only
    TensorDescriptor = None

_INDEX_DTYPES = (torch.int32, torch.int64)
_GROUP_M = 8  # row tiles that share each weight tile while it is in L2 (see _expert_tile)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _expert_tile(offsets_ptr, pid, n_col_tiles, E, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, first row, end row, column tile) of program `pid` when each expert's rows are cut in BLOCK_M
    tiles; expert == E when the program lies beyond the last tile.

    Programs run GROUP_M row tiles down one column tile before moving to the next, so the weight tile they
    share is read from L2: an expert's weight often exceeds L2 (Mixtral's gate_up, 235 MB), and walking
    every column for one row tile first would read it from memory once per row tile."""
    e_idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int32)
    starts = tl.load(offsets_ptr + e_idx - 1, mask=(e_idx > 0) & (e_idx < E), other=0).to(tl.int32)
    tiles = tl.where(e_idx < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, 0)
    n_row_tiles = tl.sum(tiles, 0)
    per_group = GROUP_M * n_col_tiles
    first = (pid // per_group) * GROUP_M
    in_group = tl.maximum(tl.minimum(n_row_tiles - first, GROUP_M), 1)
    tile = first + (pid % per_group) % in_group
    col_tile = (pid % per_group) // in_group
    expert = tl.sum((cum <= tile).to(tl.int32), 0)
    this = e_idx == expert
    first_tile = tl.sum(tl.where(this, cum - tiles, 0), 0)
    row_start = tl.sum(tl.where(this, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(this, ends, 0), 0)
    expert = tl.where(col_tile < n_col_tiles, expert, E)  # the last, partial group leaves programs idle
    return expert, row_start, row_end, col_tile


@triton.jit
def _tile_rows(a_index_ptr, row_start, row_end, M, HAS_A_INDEX: tl.constexpr, BLOCK_M: tl.constexpr):
    """(rows [BLOCK_M], their mask, the input row each reads: gathered through a_index or the row itself) of a
    tile from `_expert_tile`; offsets past the M rows given must not write out of bounds."""
    rm = row_start + tl.arange(0, BLOCK_M)
    mask_m = rm < tl.minimum(row_end, M)
    if HAS_A_INDEX:
        src = tl.load(a_index_ptr + rm, mask=mask_m, other=0).to(tl.int64)
    else:
        src = rm.to(tl.int64)
    return rm, mask_m, src


@triton.jit(do_not_specialize=["M"])  # a new batch length compiles nothing
def _grouped_mm(
    A, W, a_desc, w_desc, OUT, LORA, BIAS, rw_ptr, offsets_ptr, M, N, K, E, F: tl.constexpr, TILE: tl.constexpr
):
    """A, OUT: `Rows` (a's rows gathered, out's scattered); W: `Experts`; LORA, BIAS: `LoRA`, `Bias`; F, TILE:
    `MmSpec`, `Tile`. A_TMA: a's rows are read through a_desc, a tensor descriptor over a [rows, K] (block
    [BLOCK_M, BLOCK_K]); a tile may run into the next expert's rows, whose products are not stored. W_TMA: the
    weights are read through w_desc, a descriptor over them
    flattened to 2-D: [E * N, K] (W_KMAJOR, block [BLOCK_N, BLOCK_K]; a tile past N reads the next expert's rows,
    whose columns are not stored) or [E * K, N] (block [BLOCK_K, BLOCK_N]; the launcher takes this only when
    BLOCK_K divides K, so no tile reads another expert's rows into the sum)."""
    # constexpr fields bound by name: Triton 3.6 hands a tuple's field on as a plain value (docs/contributing.md)
    HAS_A_INDEX: tl.constexpr = F.HAS_A_INDEX
    HAS_OUT_INDEX: tl.constexpr = F.HAS_OUT_INDEX
    HAS_RW: tl.constexpr = F.HAS_RW
    HAS_LORA: tl.constexpr = F.HAS_LORA
    HAS_BIAS: tl.constexpr = F.HAS_BIAS
    BLOCK_R: tl.constexpr = F.BLOCK_R
    A_TMA: tl.constexpr = F.A_TMA
    W_TMA: tl.constexpr = F.W_TMA
    W_KMAJOR: tl.constexpr = F.W_KMAJOR
    BLOCK_E: tl.constexpr = F.BLOCK_E
    GROUP_M: tl.constexpr = F.GROUP_M
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    PRECISION: tl.constexpr = TILE.PRECISION
    expert, row_start, row_end, col_tile = _expert_tile(
        offsets_ptr, tl.program_id(0), tl.cdiv(N, BLOCK_N), E, BLOCK_E, BLOCK_M, GROUP_M
    )
    if expert >= E:
        return
    rm, mask_m, src = _tile_rows(A.index, row_start, row_end, M, HAS_A_INDEX, BLOCK_M)
    col0 = col_tile * BLOCK_N
    rn = col0 + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rk = tl.arange(0, BLOCK_K)
    if not A_TMA:
        a_ptrs = A.ptr + src[:, None] * A.stride_row + rk[None, :] * A.stride_col
    if not W_TMA:
        w_ptrs = W.ptr + expert.to(tl.int64) * W.stride_e + rn[None, :] * W.stride_n + rk[:, None] * W.stride_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_TMA:
            a = a_desc.load([row_start, k0])
        else:
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K * A.stride_col
        if W_TMA:
            if W_KMAJOR:
                w = tl.trans(w_desc.load([expert * N + col0, k0]))
            else:
                w = w_desc.load([expert * K + k0, col0])
        else:
            k_ok = rk < K - k0
            w = tl.load(w_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            w_ptrs += BLOCK_K * W.stride_k
        acc = dot_acc(a, w, acc, PRECISION)
    if HAS_LORA:
        rr = tl.arange(0, BLOCK_R)
        t = tl.load(
            LORA.t + rm[:, None] * LORA.stride_tm + rr[None, :] * LORA.stride_tr,
            mask=mask_m[:, None] & (rr[None, :] < LORA.rank),
            other=0.0,
        )
        b = tl.load(
            LORA.b + expert.to(tl.int64) * LORA.stride_be + rn[None, :] * LORA.stride_bn + rr[:, None] * LORA.stride_br,
            mask=(rr[:, None] < LORA.rank) & mask_n[None, :],
            other=0.0,
        )
        acc = dot_acc(t, b, acc, PRECISION)  # into acc: a second [BLOCK_M, BLOCK_N] accumulator would spill
    if HAS_BIAS:
        bias = tl.load(BIAS.ptr + expert.to(tl.int64) * BIAS.stride_e + rn * BIAS.stride_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if HAS_RW:
        acc *= tl.load(rw_ptr + rm, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    if HAS_OUT_INDEX:
        dst = tl.load(OUT.index + rm, mask=mask_m, other=0).to(tl.int64)
    else:
        dst = rm.to(tl.int64)
    tl.store(
        OUT.ptr + dst[:, None] * OUT.stride_row + rn[None, :] * OUT.stride_col,
        acc.to(OUT.ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit(do_not_specialize=["M"])  # a new batch length compiles nothing
def _grouped_mm_glu(
    A, W, a_desc, w_desc, OUT, BIAS, offsets_ptr, M, I, K, E, alpha, limit, F: tl.constexpr, TILE: tl.constexpr
):
    """The gate_up GEMM with the gated activation in its epilogue: W [E, 2I, K] ([gate; up] halves, or gate and
    up rows interleaved: INTERLEAVED); a program owns BLOCK_N columns of gate and the same columns of up (two
    accumulators), adds the bias (HAS_BIAS, [E, 2I] in W's row order), rounds both to the output dtype (as a
    separate activation pass would read them), and stores h = act(gate) * up [M, I] (glu.glu_terms: ACT, alpha,
    limit) and, with STORE_GU, the [gate, up] rows [M, 2I] in W's row order for the backward. A: `Rows`; W:
    `Experts`; OUT: `GluOut`; BIAS: `Bias`; F, TILE: `GluMmSpec`, `Tile`. W_TMA (halves only): w_desc is a
    descriptor over W as [E * 2I, K] (block [BLOCK_N, BLOCK_K]); A_TMA, a_desc as in _grouped_mm."""
    HAS_A_INDEX: tl.constexpr = F.HAS_A_INDEX
    HAS_BIAS: tl.constexpr = F.HAS_BIAS
    STORE_GU: tl.constexpr = F.STORE_GU
    ACT: tl.constexpr = F.ACT
    INTERLEAVED: tl.constexpr = F.INTERLEAVED
    A_TMA: tl.constexpr = F.A_TMA
    W_TMA: tl.constexpr = F.W_TMA
    BLOCK_E: tl.constexpr = F.BLOCK_E
    GROUP_M: tl.constexpr = F.GROUP_M
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    PRECISION: tl.constexpr = TILE.PRECISION
    expert, row_start, row_end, col_tile = _expert_tile(
        offsets_ptr, tl.program_id(0), tl.cdiv(I, BLOCK_N), E, BLOCK_E, BLOCK_M, GROUP_M
    )
    if expert >= E:
        return
    rm, mask_m, src = _tile_rows(A.index, row_start, row_end, M, HAS_A_INDEX, BLOCK_M)
    col0 = col_tile * BLOCK_N
    rn = col0 + tl.arange(0, BLOCK_N)
    mask_n = rn < I
    rk = tl.arange(0, BLOCK_K)
    gate_row, up_row = glu_columns(rn, I, INTERLEAVED)  # rows of W (and columns of the bias and of gu)
    if not A_TMA:
        a_ptrs = A.ptr + src[:, None] * A.stride_row + rk[None, :] * A.stride_col
    if not W_TMA:
        w_e = W.ptr + expert.to(tl.int64) * W.stride_e + rk[:, None] * W.stride_k
        g_ptrs = w_e + gate_row[None, :] * W.stride_n
        u_ptrs = w_e + up_row[None, :] * W.stride_n
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_TMA:
            a = a_desc.load([row_start, k0])
        else:
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K * A.stride_col
        if W_TMA:
            wg = tl.trans(w_desc.load([expert * 2 * I + col0, k0]))
            wu = tl.trans(w_desc.load([expert * 2 * I + I + col0, k0]))
        else:
            k_ok = rk < K - k0
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            g_ptrs += BLOCK_K * W.stride_k
            u_ptrs += BLOCK_K * W.stride_k
        acc_g = dot_acc(a, wg, acc_g, PRECISION)
        acc_u = dot_acc(a, wu, acc_u, PRECISION)
    if HAS_BIAS:
        bias_e = BIAS.ptr + expert.to(tl.int64) * BIAS.stride_e
        acc_g += tl.load(bias_e + gate_row * BIAS.stride_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_e + up_row * BIAS.stride_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    rows = rm.to(tl.int64)[:, None]
    gate = acc_g.to(OUT.h.dtype.element_ty)
    up = acc_u.to(OUT.h.dtype.element_ty)
    if STORE_GU:
        tl.store(OUT.gu + rows * OUT.stride_gu + gate_row[None, :], gate, mask=mask)
        tl.store(OUT.gu + rows * OUT.stride_gu + up_row[None, :], up, mask=mask)
    h, _, _ = glu_terms(gate.to(tl.float32), up.to(tl.float32), ACT, alpha, limit)
    tl.store(OUT.h + rows * OUT.stride_h + rn[None, :], h.to(OUT.h.dtype.element_ty), mask=mask)


@triton.jit
def _dw_step(
    DY,
    X,
    dy_desc,
    x_desc,
    rw_ptr,
    m0,
    row_end,
    n0,
    k0,
    rn,
    rk,
    mask_n,
    mask_k,
    acc,
    F: tl.constexpr,
    FULL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """acc += (rw * dy)[m0:m0+BLOCK_M, rn]^T x[m0:m0+BLOCK_M, rk] (DY, X: `Rows`; F: `DwSpec`). FULL: every row of
    the block is the expert's: no row mask, and dy and x are read through their descriptors where F says so. The
    last, partial block (not FULL) reads through pointers: rows past the expert's end must be masked, which bulk
    copies cannot do."""
    HAS_DY_INDEX: tl.constexpr = F.HAS_DY_INDEX
    HAS_X_INDEX: tl.constexpr = F.HAS_X_INDEX
    HAS_RW: tl.constexpr = F.HAS_RW
    DY_TMA: tl.constexpr = F.DY_TMA
    X_TMA: tl.constexpr = F.X_TMA
    rm = m0 + tl.arange(0, BLOCK_M)
    if FULL:
        mask_m = tl.full((BLOCK_M,), 1, tl.int1)
    else:
        mask_m = rm < row_end
    if FULL and DY_TMA:
        dy = tl.trans(dy_desc.load([m0, n0]))
    else:
        if HAS_DY_INDEX:
            dy_rows = tl.load(DY.index + rm, mask=mask_m, other=0).to(tl.int64)
        else:
            dy_rows = rm.to(tl.int64)
        dy = tl.load(
            DY.ptr + dy_rows[None, :] * DY.stride_row + rn[:, None] * DY.stride_col,
            mask=mask_n[:, None] & mask_m[None, :],
            other=0.0,
        )
    if HAS_RW:
        rw = tl.load(rw_ptr + rm, mask=mask_m, other=0.0).to(tl.float32)
        dy = (dy.to(tl.float32) * rw[None, :]).to(DY.ptr.dtype.element_ty)
    if FULL and X_TMA:
        x = x_desc.load([m0, k0])
    else:
        if HAS_X_INDEX:
            x_rows = tl.load(X.index + rm, mask=mask_m, other=0).to(tl.int64)
        else:
            x_rows = rm.to(tl.int64)
        x = tl.load(
            X.ptr + x_rows[:, None] * X.stride_row + rk[None, :] * X.stride_col,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
    return dot_acc(dy, x, acc, PRECISION)


@triton.jit(do_not_specialize=["M"])  # a new batch length compiles nothing
def _grouped_mm_dw(
    DY, X, dy_desc, x_desc, rw_ptr, offsets_ptr, DW, scale, M, N, K, F: tl.constexpr, TILE: tl.constexpr
):
    """DY, X: `Rows` (dy [rows, N], x [rows, K], gathered with F's HAS_*_INDEX); DW: `Experts`; F, TILE: `DwSpec`,
    `Tile`. dy_desc / x_desc: tensor descriptors over dy (block [BLOCK_M, BLOCK_N]) and x (block [BLOCK_M, BLOCK_K])
    where F.DY_TMA / F.X_TMA, used for the expert's whole BLOCK_M blocks of rows (the last, partial block reads
    through the pointers)."""
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    PRECISION: tl.constexpr = TILE.PRECISION
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n0 = (pid // k_tiles) * BLOCK_N
    k0 = (pid % k_tiles) * BLOCK_K
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = k0 + tl.arange(0, BLOCK_K)
    mask_n = rn < N
    mask_k = rk < K
    row_end = tl.minimum(tl.load(offsets_ptr + expert).to(tl.int32), M)
    row_start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int32)
    row_start = tl.minimum(row_start, row_end)
    full_end = row_start + ((row_end - row_start) // BLOCK_M) * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, full_end, BLOCK_M):
        acc = _dw_step(
            DY,
            X,
            dy_desc,
            x_desc,
            rw_ptr,
            m0,
            row_end,
            n0,
            k0,
            rn,
            rk,
            mask_n,
            mask_k,
            acc,
            F,
            True,
            PRECISION,
            BLOCK_M,
        )
    if full_end < row_end:
        acc = _dw_step(
            DY,
            X,
            dy_desc,
            x_desc,
            rw_ptr,
            full_end,
            row_end,
            n0,
            k0,
            rn,
            rk,
            mask_n,
            mask_k,
            acc,
            F,
            False,
            PRECISION,
            BLOCK_M,
        )
    acc *= scale
    tl.store(
        DW.ptr + expert.to(tl.int64) * DW.stride_e + rn[:, None] * DW.stride_n + rk[None, :] * DW.stride_k,
        acc.to(DW.ptr.dtype.element_ty),
        mask=mask_n[:, None] & mask_k[None, :],
    )


@triton.jit(do_not_specialize=["M"])  # a new batch length compiles nothing
def _scale_scatter_rows(
    y_ptr,
    rw_ptr,
    index_ptr,
    out_ptr,
    M,
    N,
    stride_y,
    stride_o,
    HAS_RW: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[index[m]] = rw[m] * y[m] (the epilogue of the torch._grouped_mm path), fp32 product, one rounding."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    dst = tl.load(index_ptr + rm, mask=mask_m, other=0).to(tl.int64) if HAS_INDEX else rm.to(tl.int64)
    rw = tl.load(rw_ptr + rm, mask=mask_m, other=0.0).to(tl.float32) if HAS_RW else tl.full((BLOCK_M,), 1.0, tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        mask = mask_m[:, None] & (rn[None, :] < N)
        y = tl.load(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + dst[:, None] * stride_o + rn[None, :], (y * rw[:, None]).to(out_ptr.dtype.element_ty), mask=mask
        )


# --------------------------------------------------------------------------------------------- launchers
def _precision(dtype: torch.dtype, device: torch.device) -> str:
    # fp32 inputs get fp32 products (tl.dot would use TF32 otherwise); 16-bit inputs ignore this.
    if device.type != "cuda":
        return "upcast"
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile(cfg: dict, t: torch.Tensor) -> Tile:
    """The blocks of a launch config, and the precision of dots on t's dtype and device."""
    return Tile(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], _precision(t.dtype, t.device))


def _rows(t: torch.Tensor, index: torch.Tensor | None, dummy: torch.Tensor) -> Rows:
    """t [rows, columns] as `Rows`; dummy stands in for no index."""
    return Rows(t, index if index is not None else dummy, t.stride(0), t.stride(1))


def _lora(lora: tuple | None, dummy: torch.Tensor) -> LoRA:
    """(t [M, r], b [E, N, r]) as `LoRA`; dummies and rank 0 without one."""
    if lora is None:
        return LoRA(dummy, dummy, 0, 0, 0, 0, 0, 0)
    t, b = lora
    return LoRA(t, b, t.shape[1], *t.stride(), *b.stride())


def _bias(bias: torch.Tensor | None, dummy: torch.Tensor) -> Bias:
    return Bias(bias, *bias.stride()) if bias is not None else Bias(dummy, 0, 0)


def _block_e(E: int) -> int:
    return max(next_power_of_2(E), 2)


def _descriptor_ok(t: torch.Tensor, rows_stride: int) -> bool:
    """A 2-D descriptor [*, unit-stride columns] over t's storage: 16-byte aligned base and row stride."""
    size = t.element_size()
    return TensorDescriptor is not None and t.data_ptr() % 16 == 0 and (rows_stride * size) % 16 == 0


def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors: Hopper's bulk copies (capability 9.0+), or the interpreter's emulation."""
    if TensorDescriptor is None:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def _weight_descriptor(w: torch.Tensor, block_n: int, block_k: int):
    """(descriptor, k-major) over w [E, N, K] flattened to 2-D, or None when its strides do not allow it."""
    E, N, K = w.shape
    if w.stride(2) == 1 and w.stride(0) == N * w.stride(1) and _descriptor_ok(w, w.stride(1)):
        return TensorDescriptor(w, [E * N, K], [w.stride(1), 1], [block_n, block_k]), True
    if (
        w.stride(1) == 1
        and w.stride(0) == K * w.stride(2)
        and K % block_k == 0  # no tile reads two experts' rows
        and _descriptor_ok(w, w.stride(2))
    ):
        return TensorDescriptor(w, [E * K, N], [w.stride(2), 1], [block_k, block_n]), False
    return None


def _torch_grouped_ok(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm (CUTLASS on Hopper): bf16, 16-byte aligned rows."""
    return hasattr(torch, "_grouped_mm") and all(t.dtype == torch.bfloat16 for t in tensors)


def _scale_scatter(y: torch.Tensor, out: torch.Tensor, row_weights, out_index) -> None:
    M, N = y.shape
    block_n = min(256, max(16, next_power_of_2(N)))
    _scale_scatter_rows[(cdiv(M, 16),)](
        y,
        row_weights if row_weights is not None else y,
        out_index if out_index is not None else y,
        out,
        M,
        N,
        y.stride(0),
        out.stride(0),
        HAS_RW=row_weights is not None,
        HAS_INDEX=out_index is not None,
        BLOCK_M=16,
        BLOCK_N=block_n,
        num_warps=4,
    )


def _rows_torch(a, w, offsets, a_index, out, out_index, row_weights, out_given: bool) -> torch.Tensor:
    """The same product through torch._grouped_mm on a gathered copy of the rows, then one pass that
    scales and scatters them (tuning picks it where cuBLAS/CUTLASS beats the Triton kernel)."""
    rows = a.index_select(0, a_index) if a_index is not None else a
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch._grouped_mm(rows, w.transpose(1, 2), offs=offsets if offsets.dtype == torch.int32 else offsets.int())
    if out_index is None and row_weights is None and not out_given:
        return y
    if out.stride(1) != 1:
        out.copy_(y if row_weights is None else y * row_weights[:, None])
        return out
    _scale_scatter(y, out, row_weights, out_index)
    return out


def grouped_mm_rows(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    a_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """out[out_index[m]] = row_weights[m] * (a[a_index[m]] @ w[e]^T + t[m] @ b[e]^T + bias[e]); no autograd.

    w may be any strided [E, N, K] view (w.transpose(1, 2) for dX). lora = (t [M, r], b [E, N, r]), the
    LoRA scale already folded into b; bias [E, N], any strides.
    M (the grouped rows) is offsets' last value; `out` defaults to a new [M, N] tensor in a's dtype.
    `config` (block sizes, warps, stages, impl) overrides the tuned one (tuning sweeps, tests).
    """
    M = a_index.shape[0] if a_index is not None else a.shape[0]
    E, N, K = w.shape
    out_given = out is not None
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()  # the product of empty rows; nothing for the kernel to accumulate
    dummy = offsets  # a valid pointer for arguments that a constexpr flag switches off
    lora_args = _lora(lora, dummy)
    tma_device = _tma_capable(a.device)
    torch_ok = lora is None and bias is None and _torch_grouped_ok(a, w)

    def launch(cfg: dict):
        impl = cfg.get("impl", "ptr")
        if impl == "torch":
            if not torch_ok:
                raise RuntimeError("torch._grouped_mm path: bf16 tensors without LoRA or bias only")
            return _rows_torch(a, w, offsets, a_index, out, out_index, row_weights, out_given)
        a_desc, w_desc, a_tma, w_tma, w_kmajor = dummy, dummy, False, False, True
        if impl == "tma" and tma_device:
            wd = _weight_descriptor(w, cfg["BLOCK_N"], cfg["BLOCK_K"])
            if wd is not None:
                w_desc, w_kmajor = wd
                w_tma = True
            if a_index is None and a.stride(1) == 1 and _descriptor_ok(a, a.stride(0)):
                a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_K"]])
                a_tma = True
        grid = ((cdiv(M, cfg["BLOCK_M"]) + E) * cdiv(N, cfg["BLOCK_N"]),)
        spec = MmSpec(
            a_index is not None,
            out_index is not None,
            row_weights is not None,
            lora is not None,
            bias is not None,
            max(16, next_power_of_2(lora_args.rank)),
            a_tma,
            w_tma,
            w_kmajor,
            _block_e(E),
            _GROUP_M,
        )
        _grouped_mm[grid](
            _rows(a, a_index, dummy),
            Experts(w, *w.stride()),
            a_desc,
            w_desc,
            _rows(out, out_index, dummy),
            lora_args,
            _bias(bias, dummy),
            row_weights if row_weights is not None else dummy,
            offsets,
            M,
            N,
            K,
            E,
            spec,
            _tile(cfg, a),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        return out

    # tuning runs write `out`, which the real launch then overwrites
    cfg = config or tuning.config_for(
        "fwd",
        a.dtype,
        N,
        K,
        E,
        M,
        a.device,
        run=launch,
        variant=_variant(a_index, out_index, row_weights, lora, torch_ok, bias),
    )
    return launch(cfg)


def grouped_mm_glu(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    glu: GluSpec,
    *,
    a_index: torch.Tensor | None = None,
    store_gu: bool = True,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(gu [M, 2I] or None, h [M, I]): gu = a[a_index] @ w[e]^T + bias[e] for w [E, 2I, K] (rows [gate; up], or
    interleaved per `glu`) and h = act(gate) * up from gu rounded to a's dtype (`glu`: the activation and the
    layout), in one kernel (no activation pass over gu); no autograd."""
    M = a_index.shape[0] if a_index is not None else a.shape[0]
    E, two_i, K = w.shape
    I = two_i // 2
    gu = torch.empty((M, two_i), dtype=a.dtype, device=a.device) if store_gu else None
    h = torch.empty((M, I), dtype=a.dtype, device=a.device)
    if M == 0 or I == 0:
        return gu, h
    if K == 0:
        return (gu.zero_() if gu is not None else None), h.zero_()
    dummy = offsets
    tma_device = _tma_capable(a.device)

    def launch(cfg: dict):
        if cfg.get("impl") == "split":  # the tuned GEMM into gu, then the activation pass
            full = grouped_mm_rows(a, w, offsets, a_index=a_index, out=gu, bias=bias)
            return gu, glu_rows_forward(full, glu)
        a_desc, w_desc, a_tma, w_tma = dummy, dummy, False, False
        if cfg.get("impl") == "tma" and tma_device:
            halves = not glu.interleaved  # a descriptor's block of rows is all gate or all up only in halves
            if halves and w.stride(2) == 1 and w.stride(0) == two_i * w.stride(1) and _descriptor_ok(w, w.stride(1)):
                w_desc = TensorDescriptor(w, [E * two_i, K], [w.stride(1), 1], [cfg["BLOCK_N"], cfg["BLOCK_K"]])
                w_tma = True
            if a_index is None and a.stride(1) == 1 and _descriptor_ok(a, a.stride(0)):
                a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_K"]])
                a_tma = True
        grid = ((cdiv(M, cfg["BLOCK_M"]) + E) * cdiv(I, cfg["BLOCK_N"]),)
        spec = GluMmSpec(
            a_index is not None,
            bias is not None,
            gu is not None,
            glu.act,
            glu.interleaved,
            a_tma,
            w_tma,
            _block_e(E),
            _GROUP_M,
        )
        _grouped_mm_glu[grid](
            _rows(a, a_index, dummy),
            Experts(w, *w.stride()),
            a_desc,
            w_desc,
            GluOut(gu if gu is not None else h, h, gu.stride(0) if gu is not None else 0, h.stride(0)),
            _bias(bias, dummy),
            offsets,
            M,
            I,
            K,
            E,
            glu.alpha,
            glu.limit,
            spec,
            _tile(cfg, a),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        return gu, h

    cfg = config or tuning.config_for(
        "glu",
        a.dtype,
        two_i,
        K,
        E,
        M,
        a.device,
        run=launch,
        variant=_variant(a_index, None, None, None, False, bias) + ("u" if store_gu else ""),
    )
    return launch(cfg)


def _variant(gather, scatter, rw, lora, torch_ok, bias=None) -> str:
    """The part of the tuning key beyond the shape: gathered rows, scattered rows, weights, LoRA, whether
    torch._grouped_mm may run, a bias (each changes what is fastest)."""
    flags = (gather, scatter, rw, lora, torch_ok or None, bias)
    return "".join(c for c, flag in zip("gswltb", flags) if flag is not None)


def grouped_mm_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    num_experts: int,
    *,
    dy_index: torch.Tensor | None = None,
    x_index: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """dW [E, N, K]: dW[e] = scale * sum over e's rows m of (row_weights[m] dy[dy_index[m]])^T x[x_index[m]]."""
    N, K = dy.shape[1], x.shape[1]
    M = dy_index.shape[0] if dy_index is not None else dy.shape[0]
    dw = torch.empty((num_experts, N, K), dtype=dtype or x.dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    if M == 0:
        return dw.zero_()
    dummy = offsets
    tma_device = _tma_capable(x.device)
    torch_ok = _torch_grouped_ok(dy, x)

    def launch(cfg: dict):
        impl = cfg.get("impl", "ptr")
        if impl == "torch":
            if not torch_ok:
                raise RuntimeError("torch._grouped_mm path: bf16 tensors only")
            return _dw_torch(dy, x, offsets, dy_index, x_index, row_weights, scale, dw)
        dy_desc, x_desc = dummy, dummy
        dy_tma = (
            impl == "tma" and tma_device and dy_index is None and dy.stride(1) == 1 and _descriptor_ok(dy, dy.stride(0))
        )
        x_tma = impl == "tma" and tma_device and x_index is None and x.stride(1) == 1 and _descriptor_ok(x, x.stride(0))
        if dy_tma:
            dy_desc = TensorDescriptor(dy, [dy.shape[0], N], [dy.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_N"]])
        if x_tma:
            x_desc = TensorDescriptor(x, [x.shape[0], K], [x.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        grid = (cdiv(N, cfg["BLOCK_N"]) * cdiv(K, cfg["BLOCK_K"]), num_experts)
        _grouped_mm_dw[grid](
            _rows(dy, dy_index, dummy),
            _rows(x, x_index, dummy),
            dy_desc,
            x_desc,
            row_weights if row_weights is not None else dummy,
            offsets,
            Experts(dw, *dw.stride()),
            float(scale),
            M,
            N,
            K,
            DwSpec(dy_index is not None, x_index is not None, row_weights is not None, dy_tma, x_tma),
            _tile(cfg, x),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        return dw

    cfg = config or tuning.config_for(
        "dw",
        x.dtype,
        N,
        K,
        num_experts,
        M,
        x.device,
        run=launch,
        variant=_variant(dy_index, x_index, row_weights, None, torch_ok),
    )
    return launch(cfg)


def _dw_torch(dy, x, offsets, dy_index, x_index, row_weights, scale, dw) -> torch.Tensor:
    """dW through torch._grouped_mm over the contraction (2-D x 2-D, groups along the rows) on gathered,
    weighted copies of the rows."""
    rows_dy = dy.index_select(0, dy_index) if dy_index is not None else dy
    if row_weights is not None or scale != 1.0:
        rw = row_weights.float() * scale if row_weights is not None else None
        scaled = torch.empty((rows_dy.shape[0], rows_dy.shape[1]), dtype=dy.dtype, device=dy.device)
        if rw is None:
            scaled.copy_(rows_dy * scale)
        else:
            _scale_scatter(rows_dy if rows_dy.stride(1) == 1 else rows_dy.contiguous(), scaled, rw, None)
        rows_dy = scaled
    rows_x = x.index_select(0, x_index) if x_index is not None else x
    res = torch._grouped_mm(rows_dy.t(), rows_x, offs=offsets if offsets.dtype == torch.int32 else offsets.int())
    return res if res.dtype == dw.dtype else dw.copy_(res)


def _check_args(x, w, offsets, gather_index, scatter_index, row_weights) -> int:
    """Validates the public arguments; returns M, the number of grouped rows."""
    check_dtype("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, K]; got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D [experts, N, K]; got shape {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w must have x's dtype {x.dtype}; got {w.dtype}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w's last dim must be x's K={x.shape[1]}; got w of shape {tuple(w.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] or offsets.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"expert_offsets must be int32/int64 of shape ({w.shape[0]},) (cumulative rows per expert); "
            f"got {offsets.dtype} {tuple(offsets.shape)}"
        )
    M = gather_index.shape[0] if gather_index is not None else x.shape[0]
    for name, idx in (("gather_index", gather_index), ("scatter_index", scatter_index)):
        if idx is not None and (idx.dim() != 1 or idx.shape[0] != M or idx.dtype not in _INDEX_DTYPES):
            raise ValueError(f"{name} must be int32/int64 of shape ({M},); got {idx.dtype} {tuple(idx.shape)}")
    if row_weights is not None:
        if row_weights.shape != (M,):
            raise ValueError(f"row_weights must have shape ({M},); got {tuple(row_weights.shape)}")
        check_dtype("row_weights", row_weights)
    check_same_device(
        x=x,
        w=w,
        expert_offsets=offsets,
        gather_index=gather_index,
        scatter_index=scatter_index,
        row_weights=row_weights,
    )
    return M


# ---------------------------------------------------------------------------------------------- autograd
class GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, gather_index, scatter_index, row_weights):
        ctx.save_for_backward(x, w, offsets, gather_index, scatter_index, row_weights)
        return grouped_mm_rows(x, w, offsets, a_index=gather_index, out_index=scatter_index, row_weights=row_weights)

    @staticmethod
    def backward(ctx, grad_out):
        x, w, offsets, gather_index, scatter_index, row_weights = ctx.saved_tensors
        need_x, need_w, _, _, _, need_rw = ctx.needs_input_grad
        dx = dw = drw = None
        if need_x or need_rw:
            # unweighted rows when the routing weights need their gradient <d(unweighted row), x row>
            rows = grouped_mm_rows(
                grad_out,
                w.transpose(1, 2),
                offsets,
                a_index=scatter_index,
                row_weights=None if need_rw else row_weights,
            )
            if need_rw:
                rows = rows.float()
                x_rows = x[gather_index] if gather_index is not None else x
                drw = (rows * x_rows.float()).sum(1).to(row_weights.dtype)
                rows = rows * row_weights.float()[:, None]
            if need_x and gather_index is not None:
                # several rows read one token: sum their gradients (fp32, then x's dtype)
                dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
                dx = dx.index_add_(0, gather_index, rows.float()).to(x.dtype)
            elif need_x:
                dx = rows.to(x.dtype)
        if need_w:
            dw = grouped_mm_dw(
                grad_out,
                x,
                offsets,
                w.shape[0],
                dy_index=scatter_index,
                x_index=gather_index,
                row_weights=row_weights,
                dtype=w.dtype,
            )
        return dx, dw, None, None, None, drw


# ------------------------------------------------------------------------------------------- public API
def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    gather_index: torch.Tensor | None = None,
    scatter_index: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped x @ w[e]^T over experts; differentiable in x, w and row_weights.

    x [T, K] (token rows, read through gather_index) or [M, K] (rows already grouped by expert);
    w [E, N, K] (transformers' expert layout: out x in); expert_offsets [E] cumulative row counts, the last
    one M; gather_index [M]: grouped row m reads x[gather_index[m]]; scatter_index [M], a permutation of
    range(M): row m is written to output row scatter_index[m]; row_weights [M] scale the rows (routing
    weights). Returns [M, N] in x's dtype.
    """
    _check_args(x, w, expert_offsets, gather_index, scatter_index, row_weights)
    if not use_triton(x, w):
        return grouped_gemm_reference(
            x, w, expert_offsets, gather_index=gather_index, scatter_index=scatter_index, row_weights=row_weights
        )
    return GroupedGemm.apply(x, w, expert_offsets, gather_index, scatter_index, row_weights)


def grouped_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    gather_index: torch.Tensor | None = None,
    scatter_index: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same maths as `grouped_gemm` with a per-expert loop of matmuls (reads the offsets on the host)."""
    rows = x[gather_index] if gather_index is not None else x
    ends = expert_offsets.tolist()
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(rows[start:end] @ w[e].T)
        start = end
    out = torch.cat(pieces) if pieces else rows.new_zeros((0, w.shape[1]))
    if row_weights is not None:
        out = out * row_weights[:, None].to(out.dtype)
    if scatter_index is not None:
        out = torch.empty_like(out).index_copy(0, scatter_index, out)
    return out


def sweep(
    kind: str,
    N: int,
    K: int,
    E: int,
    M: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    seed: int = 0,
) -> list[dict]:
    """Times every candidate config of one kernel on random data of this shape (rows spread over the
    experts at random); one dict per config: the config, ms, TFLOP/s, shared memory, and why it was
    skipped (pruned, or it failed to launch). What `python -m fastplug.bench moe-tune` reports."""
    if kind not in tuning.KINDS:
        raise ValueError(f"kind must be one of {tuning.KINDS}; got {kind!r}")
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    counts = torch.bincount(torch.randint(0, E, (M,), device=device, generator=g), minlength=E)
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=device, generator=g).to(dtype)
    if kind == "fwd":
        w = torch.randn(E, N, K, device=device, generator=g).to(dtype)
        out = torch.empty(M, N, device=device, dtype=dtype)

        def run(cfg):
            grouped_mm_rows(x, w, offsets, out=out, config=cfg)
    elif kind == "glu":  # N: the gate_up width 2I
        w = torch.randn(E, N, K, device=device, generator=g).to(dtype)

        def run(cfg):
            grouped_mm_glu(x, w, offsets, GluSpec(0), config=cfg)
    else:
        dy = torch.randn(M, N, device=device, generator=g).to(dtype)

        def run(cfg):
            grouped_mm_dw(dy, x, offsets, E, config=cfg)

    limit = tuning.shared_memory_limit(device)
    kept = tuning.candidates(kind, dtype, N, K, E, M, limit)
    rows = []
    for values in tuning.CANDIDATES[kind]:
        cfg = tuning.as_config(values)
        smem = tuning.shared_memory_bytes(kind, cfg, dtype)
        row = {
            "kind": kind,
            "N": N,
            "K": K,
            "E": E,
            "M": M,
            "dtype": str(dtype).replace("torch.", ""),
            **cfg,
            "smem_KiB": smem // 1024,
            "ms": None,
            "TFLOPs": None,
            "skipped": "",
        }
        if cfg not in kept:
            row["skipped"] = "shared memory" if smem > limit else "blocks larger than the shape"
        else:
            ms = tuning.time_config(run, cfg)
            if ms is None:
                row["skipped"] = "failed to launch"
            else:
                row["ms"], row["TFLOPs"] = ms, 2 * M * N * K / ms / 1e9
        rows.append(row)
    return rows
