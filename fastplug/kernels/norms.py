"""Normalisation kernels: RMSNorm (Llama and Gemma flavours) and LayerNorm, forward and backward.

One forward and one backward Triton kernel serve both norms; constexpr flags carry the differences
(CENTER: LayerNorm subtracts the mean; CAST_BEFORE_SCALE: Llama rounds the normalised row to x's dtype
before scaling; HAS_WEIGHT / HAS_BIAS; GATED: the result times silu(z) of a second input, the gated RMSNorm of
Gated DeltaNet layers (Qwen3.5, Qwen3-Next); LOOPED: rows too wide for registers are walked in column blocks).

Forward reads x once (wide rows: once per pass, the later passes mostly from L2) and saves the per-row
rstd (and mean) in fp32. Backward runs a persistent grid: each program walks many row tiles, keeps its
partial dW/db in registers and writes one fp32 row of partials; a torch sum over the programs finishes
the reduction, so no atomics contend however many rows there are. `norm_config` builds each launch's
`NormConfig` from `NormConstants` (scripts/tune_kernels.py measures others through `tuning.override`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import state, tuning
from ._utils import (
    SUPPORTED_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    keep_for_backward,
    kept_for_backward,
    next_power_of_2,
    num_sms,
    promote_types,
    rows_view,
    use_triton,
)

# ----------------------------------------------------------------------------------------------------
# 1. Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _affine(h, W, B, cols, col_mask, offset, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """h * (w + offset) + b on an fp32 [rows, cols] tile."""
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        h = h * (w + offset)[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        h = h + b[None, :]
    return h


@triton.jit
def _gate(y, Z, z_rows, offs, mask, GATED: tl.constexpr):
    """y * silu(z) on an fp32 tile (GATED), else y."""
    if GATED:
        z = tl.load(Z + z_rows[:, None] + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    return y


@triton.jit(do_not_specialize=["n_rows"])  # a new batch length compiles nothing
def _norm_fwd(
    X,
    x_row_stride,
    W,
    B,
    Y,
    y_row_stride,
    MEAN,
    RSTD,
    n_rows,
    n_cols,
    eps,
    offset,
    Z,
    z_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOPED: tl.constexpr,
    CENTER: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CAST_BEFORE_SCALE: tl.constexpr,
    GATED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31
    x_rows = X + rows * x_row_stride
    y_rows = Y + rows * y_row_stride
    z_rows = rows * z_row_stride
    cols = tl.arange(0, BLOCK_N)
    mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if LOOPED:
        # Wide rows: one pass per statistic (two-pass variance is exact where E[x^2]-E[x]^2 is not),
        # then a pass that writes; the re-reads of the row mostly hit L2.
        if CENTER:
            acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                mask = row_mask[:, None] & (start + cols < n_cols)[None, :]
                acc += tl.load(x_rows[:, None] + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=1) / n_cols
        acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_mask[:, None] & (start + cols < n_cols)[None, :]
            x = tl.load(x_rows[:, None] + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc * xc
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            col_mask = start + cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows[:, None] + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x - mean[:, None]) * rstd[:, None]
            if CAST_BEFORE_SCALE:
                h = h.to(X.dtype.element_ty).to(tl.float32)
            y = _affine(h, W, B, start + cols, col_mask, offset, HAS_WEIGHT, HAS_BIAS)
            y = _gate(y, Z, z_rows, (start + cols)[None, :], mask, GATED)
            tl.store(y_rows[:, None] + (start + cols)[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CENTER:
            mean = tl.sum(x, axis=1) / n_cols
            x = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        h = x * rstd[:, None]
        if CAST_BEFORE_SCALE:
            h = h.to(X.dtype.element_ty).to(tl.float32)
        y = _affine(h, W, B, cols, col_mask, offset, HAS_WEIGHT, HAS_BIAS)
        y = _gate(y, Z, z_rows, cols[None, :], mask, GATED)
        tl.store(y_rows[:, None] + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if CENTER:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _grad_terms(x, dy, W, cols, col_mask, mask, mean, rstd, offset, CENTER: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """x_hat (the normalised row) and g = dL/dx_hat for an fp32 tile."""
    if CENTER:
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    else:
        x_hat = x * rstd[:, None]
    g = dy
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        g = dy * (w + offset)[None, :]
    return x_hat, g


@triton.jit
def _ungate(
    dy, x, X, W, Z, DZ, rows, z_row_stride, dz_row_stride, cols, col_mask, mask, rstd, offset,
    STORE_DZ: tl.constexpr, HAS_WEIGHT: tl.constexpr, CAST_BEFORE_SCALE: tl.constexpr,
):  # fmt: skip
    """The gated norm's y = a * silu(z) (a: the RMSNorm output) on an fp32 tile: returns dL/da = dy * silu(z);
    STORE_DZ: also writes dL/dz = dy * a * silu'(z), with a recomputed as the forward rounded it."""
    offs = cols[None, :]
    z = tl.load(Z + rows[:, None] * z_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    if STORE_DZ:
        a = x * rstd[:, None]
        if CAST_BEFORE_SCALE:
            a = a.to(X.dtype.element_ty).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = a * (w + offset)[None, :]
        dz = dy * a * sig * (1.0 + z * (1.0 - sig))
        tl.store(DZ + rows[:, None] * dz_row_stride + offs, dz.to(DZ.dtype.element_ty), mask=mask)
    return dy * z * sig


@triton.jit(do_not_specialize=["n_rows"])  # a new batch length compiles nothing
def _norm_bwd(
    DY,
    dy_row_stride,
    X,
    x_row_stride,
    W,
    MEAN,
    RSTD,
    DX,
    dx_row_stride,
    DW_PARTIAL,
    DB_PARTIAL,
    n_rows,
    n_cols,
    offset,
    Z,
    z_row_stride,
    DZ,
    dz_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOPED: tl.constexpr,
    CENTER: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    GATED: tl.constexpr,
    CAST_BEFORE_SCALE: tl.constexpr,
):
    # dx = rstd * (g - x_hat * mean(g * x_hat) - [CENTER] mean(g)),  g = dy * (w + offset)
    # dW = sum_rows dy * x_hat,  db = sum_rows dy
    # GATED (y = a * silu(z)): dy above is dL/da = dy * silu(z), and dz = dy * a * silu'(z)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    num_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    partial_row = pid.to(tl.int64) * n_cols  # this program's row in DW_PARTIAL / DB_PARTIAL
    if LOOPED:
        for tile in range(pid, num_tiles, n_programs):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows = rows.to(tl.int64)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            if CENTER:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            # pass 1: the row sums that couple all columns
            sum_g_xhat = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
            sum_g = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)  # LayerNorm only
            for start in range(0, n_cols, BLOCK_N):
                col_mask = start + cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                offs = (start + cols)[None, :]
                x = tl.load(X + rows[:, None] * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * dy_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
                if GATED:
                    dy = _ungate(dy, x, X, W, Z, DZ, rows, z_row_stride, dz_row_stride, start + cols, col_mask,
                                 mask, rstd, offset, False, HAS_WEIGHT, CAST_BEFORE_SCALE)  # fmt: skip
                x_hat, g = _grad_terms(x, dy, W, start + cols, col_mask, mask, mean, rstd, offset, CENTER, HAS_WEIGHT)
                sum_g_xhat += g * x_hat
                if CENTER:
                    sum_g += g
            c_xhat = tl.sum(sum_g_xhat, axis=1) / n_cols
            c_g = tl.sum(sum_g, axis=1) / n_cols
            # pass 2: dx, and this tile's share of dW/db added into the program's partial row. Only this
            # program touches that row; the barrier orders its read-modify-write across tiles.
            for start in range(0, n_cols, BLOCK_N):
                col_mask = start + cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                offs = (start + cols)[None, :]
                x = tl.load(X + rows[:, None] * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * dy_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
                if GATED:
                    dy = _ungate(dy, x, X, W, Z, DZ, rows, z_row_stride, dz_row_stride, start + cols, col_mask,
                                 mask, rstd, offset, True, HAS_WEIGHT, CAST_BEFORE_SCALE)  # fmt: skip
                x_hat, g = _grad_terms(x, dy, W, start + cols, col_mask, mask, mean, rstd, offset, CENTER, HAS_WEIGHT)
                dx = (g - x_hat * c_xhat[:, None] - c_g[:, None]) * rstd[:, None]
                tl.store(DX + rows[:, None] * dx_row_stride + offs, dx.to(DX.dtype.element_ty), mask=mask)
                part = partial_row + start + cols
                if COMPUTE_DW:
                    dw = tl.load(DW_PARTIAL + part, mask=col_mask, other=0.0)
                    tl.store(DW_PARTIAL + part, dw + tl.sum(dy * x_hat, axis=0), mask=col_mask)
                if COMPUTE_DB:
                    db = tl.load(DB_PARTIAL + part, mask=col_mask, other=0.0)
                    tl.store(DB_PARTIAL + part, db + tl.sum(dy, axis=0), mask=col_mask)
            tl.debug_barrier()
    else:
        col_mask = cols < n_cols
        dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
        # LOOP_STAGES > 1 software-pipelines the loop: the next tile's x/dy loads are issued while this tile
        # reduces and stores (Triton pipelines loads that feed no dot only when the loop asks for it).
        for tile in tl.range(pid, num_tiles, n_programs, num_stages=LOOP_STAGES):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            if CENTER:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if GATED:
                dy = _ungate(dy, x, X, W, Z, DZ, rows, z_row_stride, dz_row_stride, cols, col_mask, mask, rstd,
                             offset, True, HAS_WEIGHT, CAST_BEFORE_SCALE)  # fmt: skip
            x_hat, g = _grad_terms(x, dy, W, cols, col_mask, mask, mean, rstd, offset, CENTER, HAS_WEIGHT)
            dx = g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None]
            if CENTER:
                dx -= (tl.sum(g, axis=1) / n_cols)[:, None]
            dx = dx * rstd[:, None]
            tl.store(DX + rows[:, None] * dx_row_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += dy * x_hat
            if COMPUTE_DB:
                db_acc += dy
        if COMPUTE_DW:
            tl.store(DW_PARTIAL + partial_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if COMPUTE_DB:
            tl.store(DB_PARTIAL + partial_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NormConstants:
    """The constants `norm_config` builds a launch from. The defaults are RMSNorm's, and what runs;
    LayerNorm's differ in `resident_warps_per_sm` (LAYER_NORM_CONSTANTS). scripts/tune_kernels.py measures
    others through `tuning.override("norm", functools.partial(norm_config, constants=...))`."""

    max_fused_cols: int = 8192  # widest row kept whole in registers (no spills on sm_90 up to here)
    looped_block_n: int = 4096  # column block for wider rows
    fwd_min_tile: int = 4096  # pack narrow rows up to this many elements per forward tile
    bwd_min_tile: int = 2048  # ... per backward tile
    fwd_elems_per_warp: int = 512  # 4096 cols -> 8 warps: two 16-byte bf16 vectors per thread per tensor
    bwd_elems_per_warp: int = 1024
    # Backward programs resident per SM, counted in warps. Each holds one fp32 dW (and db) partial row, so
    # fewer programs cost less memory; 20 (RMSNorm: 5 programs of 4 warps) and 16 (LayerNorm: 4) are the
    # fewest at full speed, and fewer than torch.compile's peak memory (numbers: docs/benchmarks/kernels.md,
    # "norms"; measured by scripts/tune_kernels.py --ops rms_norm layer_norm).
    resident_warps_per_sm: int = 20
    # num_stages of backward's persistent row loop: 1. A pipelined loop (2) won alone with 8-warp programs
    # and lost to the 4-warp programs above (docs/benchmarks/kernels.md, "norms").
    bwd_loop_stages: int = 1


RMS_NORM_CONSTANTS = NormConstants()
LAYER_NORM_CONSTANTS = NormConstants(resident_warps_per_sm=16)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """One launch of `_norm_fwd` or `_norm_bwd`."""

    block_n: int  # columns per tile (a power of two)
    block_rows: int  # rows per tile: narrow rows (q/k norms over a head dim) pack several per program
    looped: bool  # row wider than block_n: walk it in column blocks
    num_warps: int
    programs_per_sm: int  # backward's persistent grid
    loop_stages: int = 1  # num_stages of backward's row loop


@functools.lru_cache(maxsize=256)
def norm_config(
    n_cols: int,
    dtype: torch.dtype | None = None,
    *,
    backward: bool,
    center: bool,
    constants: NormConstants | None = None,
) -> NormConfig:
    """The launch of a norm over rows of n_cols (RMSNorm, or LayerNorm when `center`), forward or backward."""
    tune = constants or (LAYER_NORM_CONSTANTS if center else RMS_NORM_CONSTANTS)
    min_tile = tune.bwd_min_tile if backward else tune.fwd_min_tile
    elems_per_warp = tune.bwd_elems_per_warp if backward else tune.fwd_elems_per_warp
    cols = next_power_of_2(n_cols)
    looped = cols > tune.max_fused_cols
    block_n = tune.looped_block_n if looped else cols
    block_rows = 1 if looped else max(1, min_tile // block_n)
    num_warps = min(16, max(1, block_rows * block_n // elems_per_warp))
    return NormConfig(
        block_n, block_rows, looped, num_warps, max(1, tune.resident_warps_per_sm // num_warps), tune.bwd_loop_stages
    )


def _config(n_cols: int, dtype: torch.dtype, backward: bool, center: bool) -> NormConfig:
    return tuning.pick("norm", norm_config, n_cols, dtype, backward=backward, center=center)


# The launch settings memoised per (n_cols, dtype, backward, center) for the forward and per (n_cols, dtype,
# backward, center, device) for the backward, whose entry also holds its grid's bound (the device's SMs times
# programs per SM): what `_config` and `num_sms` give while no tuning override is set, without their Python
# calls on every launch (a step launches each norm up to three times). Plain ints and configs, one entry per
# norm width, dtype and device a model has: a handful.
_LAUNCHES: dict[tuple, NormConfig | tuple[NormConfig, int]] = state.register_cache("norms.launches", {})


def _norm_forward(
    x2, weight, bias, eps, offset, *, center, cast_before_scale, out_dtype, gate=None, config: NormConfig | None = None
):
    """gate: None, or z [rows, cols] (unit last stride) to multiply the result by silu(z)."""
    n_rows, n_cols = x2.shape
    if config is not None:
        cfg = config
    elif tuning._overrides:  # an override of some kernel is set: ask `tuning.pick` on every launch
        cfg = _config(n_cols, x2.dtype, backward=False, center=center)
    else:
        key = (n_cols, x2.dtype, False, center)
        try:
            cfg = _LAUNCHES[key]
        except KeyError:
            cfg = _LAUNCHES[key] = norm_config(n_cols, x2.dtype, backward=False, center=center)
    device = x2.device
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=device) if center else rstd  # rstd: unused stand-in
    grid = (-(-n_rows // cfg.block_rows),)  # cdiv, inline
    _norm_fwd[grid](
        x2,
        x2.stride(0),
        weight if weight is not None else rstd,
        bias if bias is not None else rstd,
        y,
        n_cols,  # y's row stride: a fresh contiguous [rows, cols] tensor
        mean,
        rstd,
        n_rows,
        n_cols,
        eps,
        offset,
        gate if gate is not None else rstd,
        gate.stride(0) if gate is not None else 0,
        BLOCK_ROWS=cfg.block_rows,
        BLOCK_N=cfg.block_n,
        LOOPED=cfg.looped,
        CENTER=center,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        CAST_BEFORE_SCALE=cast_before_scale,
        GATED=gate is not None,
        num_warps=cfg.num_warps,
    )
    return y, (mean if center else None), rstd


def _norm_backward(
    dy2, x2, weight, mean, rstd, offset, *, compute_dw, compute_db, gate=None, config: NormConfig | None = None
):
    """Returns dx [rows, cols] in x's dtype, and dW, db in fp32 (None where not asked for); with a gate (the
    gated RMSNorm, Llama's rounding) also dz in the gate's dtype, else None."""
    n_rows, n_cols = x2.shape
    device = x2.device
    if config is not None or tuning._overrides:
        cfg = config or _config(n_cols, x2.dtype, backward=True, center=mean is not None)
        max_programs = num_sms(device) * cfg.programs_per_sm
    else:
        key = (n_cols, x2.dtype, True, mean is not None, device)
        try:
            cfg, max_programs = _LAUNCHES[key]
        except KeyError:
            cfg = norm_config(n_cols, x2.dtype, backward=True, center=mean is not None)
            max_programs = num_sms(device) * cfg.programs_per_sm
            _LAUNCHES[key] = (cfg, max_programs)
    n_programs = -(-n_rows // cfg.block_rows)  # cdiv, inline
    if n_programs > max_programs:
        n_programs = max_programs
    dx = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=device)
    # Looped tiles add into their partial row; fused ones write it once at the end.
    alloc = torch.zeros if cfg.looped else torch.empty
    dw_partial = alloc((n_programs, n_cols), dtype=torch.float32, device=device) if compute_dw else None
    db_partial = alloc((n_programs, n_cols), dtype=torch.float32, device=device) if compute_db else None
    dz = torch.empty_like(gate) if gate is not None else None
    _norm_bwd[(n_programs,)](
        dy2,
        dy2.stride(0),
        x2,
        x2.stride(0),
        weight if weight is not None else rstd,
        mean if mean is not None else rstd,
        rstd,
        dx,
        n_cols,  # dx's row stride: a fresh contiguous [rows, cols] tensor
        dw_partial if dw_partial is not None else rstd,
        db_partial if db_partial is not None else rstd,
        n_rows,
        n_cols,
        offset,
        gate if gate is not None else rstd,
        gate.stride(0) if gate is not None else 0,
        dz if dz is not None else rstd,
        dz.stride(0) if dz is not None else 0,
        BLOCK_ROWS=cfg.block_rows,
        BLOCK_N=cfg.block_n,
        LOOPED=cfg.looped,
        CENTER=mean is not None,
        HAS_WEIGHT=weight is not None,
        COMPUTE_DW=dw_partial is not None,
        COMPUTE_DB=db_partial is not None,
        LOOP_STAGES=cfg.loop_stages,
        GATED=gate is not None,
        CAST_BEFORE_SCALE=gate is not None,
        num_warps=cfg.num_warps,
    )
    dw = _reduce_partials(dw_partial) if compute_dw else None
    db = _reduce_partials(db_partial) if compute_db else None
    return (dx, dw, db, dz) if gate is not None else (dx, dw, db)


# (rows, device) -> fp32 ones: the partial rows are summed as a matrix-vector product.
_ONES: dict = state.register_cache("norms.ones", {})


def _reduce_partials(partials: torch.Tensor | None) -> torch.Tensor | None:
    """The column sums of the fp32 partial rows, as one GEMV against a cached ones vector: deterministic,
    and without scratch memory (torch's sum(0) takes tens of MiB of it: docs/benchmarks/kernels.md, "host and
    memory notes")."""
    if partials is None:
        return None
    key = (partials.shape[0], partials.device)
    ones = _ONES.get(key)
    if ones is None:
        ones = torch.ones(partials.shape[0], dtype=torch.float32, device=partials.device)
        # inside a CUDA graph capture the vector comes from the graph's pool, which later replays reuse: not kept
        if not (partials.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ONES[key] = ones
    return partials.t().mv(ones)


def _check_inputs(x, weight, bias, eps):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dim; got shape {tuple(x.shape)}")
    check_dtype("x", x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_dtype(name, t)
            check_shape(name, t, (x.shape[-1],), "the last dim of x")
    check_same_device(x=x, weight=weight, bias=bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0; got {eps!r}")


# The public functions first test their inputs in one expression of attribute reads and comparisons (one call,
# `_plainly_valid`, instead of the checks' dozen: the norms run up to three times per layer and step, and the
# host bounds small-batch steps): a test stricter than the checks (eps a float, not any number), never looser.
# Where it fails, the checks run and raise their clear errors; where they pass (an int eps, say), so does the call.


def _plainly_valid(x, weight, eps) -> bool:
    """What every norm asks of x, its weight (or None) and eps, as `_check_inputs` would pass them."""
    return (
        isinstance(x, torch.Tensor)
        and x.dtype in SUPPORTED_DTYPES
        and x.ndim > 0
        and x.shape[-1] > 0
        and (
            weight is None
            or (weight.dtype in SUPPORTED_DTYPES and weight.shape == x.shape[-1:] and weight.device == x.device)
        )
        and type(eps) is float
        and 0.0 < eps < math.inf
    )


def _check_rms_norm_inputs(x, weight, eps, offset, scale_in_fp32):
    _check_inputs(x, weight, None, eps)
    if weight is None and offset != 0.0:
        raise ValueError(f"offset {offset!r} needs a weight (offset scales as offset + weight); got weight None")
    if not isinstance(scale_in_fp32, bool):
        raise ValueError(f"scale_in_fp32 must be a bool; got {scale_in_fp32!r}")


def _check_gated_inputs(x, gate, weight, eps):
    _check_inputs(x, weight, None, eps)
    if not isinstance(gate, torch.Tensor):
        raise ValueError(f"gate must be a torch.Tensor; got {type(gate).__name__}")
    check_dtype("gate", gate)
    check_shape("gate", gate, tuple(x.shape), "x's shape")
    check_same_device(x=x, gate=gate, weight=weight)


_KEPT_MODIFIED = "a tensor kept for backward was modified by an inplace operation between forward and backward"


def _weight_and_rows(ctx, dy: torch.Tensor) -> tuple:
    """What a norm's backward starts from: the weight kept by reference (raising if it changed in place since the
    forward, as autograd does for saved tensors) and dy as contiguous rows."""
    weight = ctx.weight
    if weight is not None and weight._version != ctx.weight_version:
        raise RuntimeError(_KEPT_MODIFIED)
    dy2 = dy.reshape(-1, dy.shape[-1])
    return weight, dy2 if dy2.stride(-1) == 1 else dy2.contiguous()


# ----------------------------------------------------------------------------------------------------
# 3. Autograd functions
# ----------------------------------------------------------------------------------------------------


def _llama_form(weight, offset, scale_in_fp32) -> bool:
    # Llama: scale the row rounded to x's dtype, result dtype promotes with the weight. Gemma (any other offset)
    # and Gemma 4 (scale_in_fp32): scale in fp32 by (offset + w), result in x's dtype.
    return offset == 0.0 and not scale_in_fp32 and weight is not None


def _rms_out_dtype(x, weight, offset, scale_in_fp32=False):
    return promote_types(x.dtype, weight.dtype) if _llama_form(weight, offset, scale_in_fp32) else x.dtype


def _rms_norm_forward(x, weight, eps, offset, scale_in_fp32=False):
    """(y shaped like x, rstd per row, x2 the rows view of x that backward reads): the forward shared by the
    autograd Function and the operator."""
    x2 = x.reshape(-1, x.shape[-1])  # rows_view, inline
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    llama = offset == 0.0 and not scale_in_fp32 and weight is not None  # _llama_form, inline
    # _rms_out_dtype: promote_types of a dtype with itself is that dtype
    out_dtype = x.dtype if not llama or weight.dtype == x.dtype else promote_types(x.dtype, weight.dtype)
    y, _, rstd = _norm_forward(
        x2, weight, None, eps, offset, center=False, cast_before_scale=llama, out_dtype=out_dtype
    )
    return y.view(x.shape), rstd, x2


def _layer_norm_forward(x, weight, bias, eps):
    """(y shaped like x, mean and rstd per row, x2), shared like `_rms_norm_forward`."""
    x2 = x.reshape(-1, x.shape[-1])  # rows_view, inline
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y, mean, rstd = _norm_forward(x2, weight, bias, eps, 0.0, center=True, cast_before_scale=False, out_dtype=x.dtype)
    return y.view(x.shape), mean, rstd, x2


class RMSNorm(torch.autograd.Function):
    # `keep_for_backward` and `kept_for_backward` written out for the one tensor: the weight stays on ctx, not in
    # save_for_backward, and backward checks its version. rows_view written out for dy. `params` is (eps,
    # offset, scale_in_fp32): one argument for three, each of which costs Function.apply some host time.
    @staticmethod
    def forward(ctx, x, weight, params):
        eps, offset, scale_in_fp32 = params
        y, rstd, x2 = _rms_norm_forward(x, weight, eps, offset, scale_in_fp32)
        ctx.weight = weight
        ctx.weight_version = None if weight is None else weight._version
        ctx.save_for_backward(x2, rstd)
        ctx.offset = offset
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, rstd = ctx.saved_tensors
        weight, dy2 = _weight_and_rows(ctx, dy)
        dx, dw, _ = _norm_backward(
            dy2,
            x2,
            weight,
            None,
            rstd,
            ctx.offset,
            compute_dw=ctx.needs_input_grad[1],
            compute_db=False,
        )
        if dw is not None and dw.dtype != weight.dtype:  # dw is fp32
            dw = dw.to(weight.dtype)
        return dx.view(ctx.x_shape), dw, None


class LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd, x2 = _layer_norm_forward(x, weight, bias, eps)
        ctx.weight = weight  # as in RMSNorm
        ctx.weight_version = None if weight is None else weight._version
        ctx.save_for_backward(x2, mean, rstd)
        ctx.x_shape = x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, mean, rstd = ctx.saved_tensors
        weight, dy2 = _weight_and_rows(ctx, dy)
        needs_input_grad = ctx.needs_input_grad
        dx, dw, db = _norm_backward(
            dy2,
            x2,
            weight,
            mean,
            rstd,
            0.0,
            compute_dw=needs_input_grad[1],
            compute_db=needs_input_grad[2],
        )
        if dw is not None and dw.dtype != weight.dtype:  # dw and db are fp32
            dw = dw.to(weight.dtype)
        if db is not None and db.dtype != ctx.bias_dtype:
            db = db.to(ctx.bias_dtype)
        return dx.view(ctx.x_shape), dw, db, None


def _rms_norm_gated_forward(x, gate, weight, eps):
    """(y shaped like x, rstd per row, x2, z2: the rows views backward reads): shared by the autograd Function
    and the operator."""
    x2, z2 = rows_view(x), rows_view(gate)
    y, _, rstd = _norm_forward(
        x2, weight, None, eps, 0.0, center=False, cast_before_scale=True, out_dtype=x.dtype, gate=z2
    )
    return y.view(x.shape), rstd, x2, z2


def _rms_norm_gated_backward(dy, x2, z2, weight, rstd, need_dw):
    """(dx, dw or None, dz) as 2-D [rows, cols] tensors (dw: 1-D, in the weight's dtype)."""
    dx, dw, _, dz = _norm_backward(
        rows_view(dy), x2, weight, None, rstd, 0.0, compute_dw=need_dw, compute_db=False, gate=z2
    )
    return dx, (dw.to(weight.dtype) if dw is not None else None), dz


class RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        y, rstd, x2, z2 = _rms_norm_gated_forward(x, gate, weight, eps)
        keep_for_backward(ctx, (weight,))
        ctx.save_for_backward(x2, z2, rstd)
        ctx.shapes = x.shape, gate.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, z2, rstd = ctx.saved_tensors
        (weight,) = kept_for_backward(ctx)
        dx, dw, dz = _rms_norm_gated_backward(dy, x2, z2, weight, rstd, ctx.needs_input_grad[2])
        return dx.view(ctx.shapes[0]), dz.view(ctx.shapes[1]), dw, None


# ----------------------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0, scale_in_fp32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim of x.

    offset 0.0 is transformers' LlamaRMSNorm: normalise in fp32, round to x's dtype, multiply by weight
    (result dtype promotes x with weight). Any other offset is GemmaRMSNorm's form (offset 1.0):
    x_norm * (offset + w) in fp32, then cast to x's dtype; scale_in_fp32=True takes that form at offset 0
    too (Gemma 4's RMSNorm: x_norm * w in fp32). weight None: no scaling.
    """
    if not (  # `_check_rms_norm_inputs` where the inputs are not plainly good (see above `_plainly_valid`)
        _plainly_valid(x, weight, eps)
        and (weight is not None or offset == 0.0)
        and (scale_in_fp32 is False or scale_in_fp32 is True)
    ):
        _check_rms_norm_inputs(x, weight, eps, offset, scale_in_fp32)
    if x.numel() == 0 or not use_triton(x, weight):
        return rms_norm_reference(x, weight, eps, offset, scale_in_fp32)
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, float(eps), float(offset), scale_in_fp32)[0]
    return RMSNorm.apply(x, weight, (float(eps), float(offset), scale_in_fp32))


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of x, statistics in fp32, result in x's dtype (like nn.LayerNorm)."""
    if not (  # `_check_inputs` where the inputs are not plainly good (see above `_plainly_valid`)
        _plainly_valid(x, weight, eps)
        and (
            bias is None or (bias.dtype in SUPPORTED_DTYPES and bias.shape == x.shape[-1:] and bias.device == x.device)
        )
    ):
        _check_inputs(x, weight, bias, eps)
    if x.numel() == 0 or not use_triton(x, weight, bias):
        return layer_norm_reference(x, weight, bias, eps)
    if torch.compiler.is_compiling():
        return _layer_norm_op(x, weight, bias, float(eps))[0]
    return LayerNorm.apply(x, weight, bias, float(eps))


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """The gated RMSNorm of Gated DeltaNet layers (transformers' Qwen3_5RMSNormGated, Qwen3NextRMSNormGated):
    Llama's RMSNorm of x (normalised in fp32, rounded to x's dtype, times weight) times silu(gate) in fp32,
    the result in x's dtype. gate has x's shape (any float dtype)."""
    if not (  # `_check_gated_inputs` where the inputs are not plainly good (see above `_plainly_valid`)
        _plainly_valid(x, weight, eps)
        and isinstance(gate, torch.Tensor)
        and gate.dtype in SUPPORTED_DTYPES
        and gate.shape == x.shape
        and gate.device == x.device
    ):
        _check_gated_inputs(x, gate, weight, eps)
    if x.numel() == 0 or not use_triton(x, gate, weight):
        return rms_norm_gated_reference(x, gate, weight, eps)
    if torch.compiler.is_compiling():
        return _rms_norm_gated_op(x, gate, weight, float(eps))[0]
    return RMSNormGated.apply(x, gate, weight, float(eps))


# ----------------------------------------------------------------------------------------------------
# 5. References (plain torch; float64 inputs are computed in float64)
# ----------------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0, scale_in_fp32: bool = False
) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(x.dtype)
    if _llama_form(weight, offset, scale_in_fp32):
        return weight * h.to(x.dtype)  # LlamaRMSNorm
    return (h * (offset + weight.to(compute))).to(x.dtype)  # GemmaRMSNorm, Gemma4RMSNorm (offset 0)


def rms_norm_gated_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight is not None:
        h = weight * h
    z = gate.to(torch.promote_types(gate.dtype, compute))
    return (h.to(z.dtype) * F.silu(z)).to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute) if weight is not None else None
    b = bias.to(compute) if bias is not None else None
    return F.layer_norm(x.to(compute), (x.shape[-1],), w, b, eps).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# 6. Registered operators: what torch.compile traces (a call costs more host time than the autograd
#    Functions above, which eager calls keep). Forward returns the statistics backward needs.
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fastplug::rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, float eps, float offset, bool scale_in_fp32) -> (Tensor, Tensor)",
)
def _rms_norm_op(x, weight, eps, offset, scale_in_fp32):
    return _rms_norm_forward(x, weight, eps, offset, scale_in_fp32)[:2]


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, scale_in_fp32):
    return x.new_empty(x.shape, dtype=_rms_out_dtype(x, weight, offset, scale_in_fp32)), x.new_empty(
        x.numel() // x.shape[-1], dtype=torch.float32
    )


@torch.library.custom_op(
    "fastplug::layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
)
def _layer_norm_op(x, weight, bias, eps):
    return _layer_norm_forward(x, weight, bias, eps)[:3]


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(
    "fastplug::norm_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor? weight, Tensor? mean, Tensor rstd, float offset, bool need_dw, bool need_db) "
    "-> (Tensor, Tensor, Tensor)",
)
def _norm_backward_op(dy, x, weight, mean, rstd, offset, need_dw, need_db):
    """(dx, dw, db); a gradient not asked for is an empty tensor (operators cannot return None)."""
    dx, dw, db = _norm_backward(
        rows_view(dy), rows_view(x), weight, mean, rstd, offset, compute_dw=need_dw, compute_db=need_db
    )
    return (
        dx.view(x.shape),
        x.new_empty(0) if dw is None else dw.to(weight.dtype),
        x.new_empty(0) if db is None else db.to(x.dtype),
    )


@_norm_backward_op.register_fake
def _(dy, x, weight, mean, rstd, offset, need_dw, need_db):
    dw = weight.new_empty(weight.shape) if need_dw else x.new_empty(0)
    return x.new_empty(x.shape), dw, x.new_empty(x.shape[-1]) if need_db else x.new_empty(0)


def _setup_rms(ctx, inputs, output):
    x, weight, _, offset, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw, _ = _norm_backward_op(dy, x, weight, None, rstd, ctx.offset, need_dw, False)
    return dx, dw if need_dw else None, None, None, None


def _setup_layer(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.bias_dtype = None if bias is None else bias.dtype


def _layer_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    need_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dx, dw, db = _norm_backward_op(dy, x, weight, mean, rstd, 0.0, need_dw, need_db)
    return dx, dw if need_dw else None, db.to(ctx.bias_dtype) if need_db else None, None


@torch.library.custom_op(
    "fastplug::rms_norm_gated",
    mutates_args=(),
    schema="(Tensor x, Tensor gate, Tensor? weight, float eps) -> (Tensor, Tensor)",
)
def _rms_norm_gated_op(x, gate, weight, eps):
    return _rms_norm_gated_forward(x, gate, weight, eps)[:2]


@_rms_norm_gated_op.register_fake
def _(x, gate, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op(
    "fastplug::rms_norm_gated_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor gate, Tensor? weight, Tensor rstd, bool need_dw) -> (Tensor, Tensor, Tensor)",
)
def _rms_norm_gated_backward_op(dy, x, gate, weight, rstd, need_dw):
    """(dx, dz, dw); dw is an empty tensor when not asked for (operators cannot return None)."""
    dx, dw, dz = _rms_norm_gated_backward(dy, rows_view(x), rows_view(gate), weight, rstd, need_dw)
    return dx.view(x.shape), dz.view(gate.shape), x.new_empty(0) if dw is None else dw


@_rms_norm_gated_backward_op.register_fake
def _(dy, x, gate, weight, rstd, need_dw):
    return (
        x.new_empty(x.shape),
        gate.new_empty(gate.shape),
        weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
    )


def _setup_gated(ctx, inputs, output):
    x, gate, weight, _ = inputs
    ctx.save_for_backward(x, gate, weight, output[1])


def _gated_backward(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[2]
    dx, dz, dw = _rms_norm_gated_backward_op(dy, x, gate, weight, rstd, need_dw)
    return dx, dz, dw if need_dw else None, None


_rms_norm_gated_op.register_autograd(_gated_backward, setup_context=_setup_gated)
_rms_norm_op.register_autograd(_rms_backward, setup_context=_setup_rms)
_layer_norm_op.register_autograd(_layer_backward, setup_context=_setup_layer)
