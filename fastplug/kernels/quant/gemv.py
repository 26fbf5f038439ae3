"""The 4-bit GEMV's launch: its tile (`GemvConfig`, built by `gemv_config`, picked through
`kernels.tuning` under the name "gemv_4bit"), the launchers, and `gemv_4bit`, the decode-time product x W^T
for a few rows of x, read straight from the packed bytes. Products and sums in fp32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import state, tuning
from .._utils import cdiv, check_dtype, interpreter_enabled, next_power_of_2, num_sms, rows_view, use_triton
from ..ptx import layouts_agree
from .dequant import dequantize_4bit, dequantize_4bit_reference
from .formats import _Unpacked, _unpacked
from .gemv_kernels import (
    LOOKUP_SHFL,
    LOOKUPS,
    _gemv_4bit_dot_kernel,
    _gemv_4bit_kernel,
    _gemv_4bit_rows_kernel,
    _gemv_4bit_words_kernel,
    _sum_splits_kernel,
)

GEMV_MAX_ROWS = 8  # beyond this, dequantizing once and one matmul is faster than a GEMV per row block
# Rows of x the byte-wise default tile takes (its work grows with each row of x); more rows, up to GEMV_MAX_ROWS,
# take dequantize + matmul unless a tile is given or the word-wise kernel reads the weight (it looks each nibble up
# once for all rows: up to GEMV_MAX_ROWS). Past 4 rows the byte-wise tile lost to dequantize + matmul
# (`python -m fastplug.bench.qlora --gemv-sweep`; docs/benchmarks/kernels.md, "4-bit GEMV").
GEMV_KERNEL_ROWS = 4


class GemvConfig(NamedTuple):
    """Tile of the 4-bit GEMV: BLOCK_N rows x NB sub-chunks x SUB packed bytes, `split` programs along K."""

    block_n: int
    nb: int
    sub: int
    split: int
    num_warps: int
    x_split: bool
    dot: bool = False  # the tensor-core kernel (several rows of x)
    lookup: str = "load"  # CUDA-core kernels: how the 16 table values are looked up, a key of LOOKUPS
    words: bool = False  # `_gemv_4bit_words_kernel`, 1-GEMV_MAX_ROWS rows of x (then `sub` counts 4-byte words)


def _lowbit(n: int) -> int:
    return n & -n


def _one_row_tile(n: int, kw: int, device: torch.device) -> tuple[int, int, int]:
    """(rows a program, warps, bytes a row a step) of the word-wise GEMV at one row of x. Each thread holds 4 rows
    of 8 consecutive words a step (`_words_one_x_row`: x loaded once for the 4 rows, 64 words in flight with the
    loop unrolled twice; 128 registers) and a program's warps split K. Where that leaves fewer than 7 programs an
    SM: warps along K while whole steps fill a row, then 2 rows a program. It beat 4 words a thread at every
    measured shape (`python -m fastplug.bench.qlora --gemv-sweep`; docs/benchmarks/kernels.md, "4-bit GEMV")."""
    step = 256 if kw % 256 == 0 else 128  # words a warp a step
    block_n, warps = 4, 1
    while cdiv(n, block_n) * warps < 7 * num_sms(device):
        if kw % (2 * step * warps) == 0:
            warps *= 2
        elif block_n > 2:
            block_n //= 2
        else:
            break
    return block_n, warps, 4 * step * warps


def gemv_config(m: int, n: int, k: int, blocksize: int, device: torch.device, **override) -> GemvConfig | None:
    """The tile for x [m, k] @ W[n, k]^T, or None when K is odd (rows straddle bytes: the general kernel).
    A sub-chunk is at most 32 bytes (a 16-byte vector for each of two threads) and lies inside one
    quantization block and one row; split-K only when the rows alone would leave the GPU's SMs idle.
    `dot`: the tensor-core kernel (`_gemv_4bit_dot_kernel`) instead of the CUDA-core one (`_gemv_4bit_rows_kernel`);
    `words`: `_gemv_4bit_words_kernel` (the default on a GPU where K allows, up to GEMV_MAX_ROWS rows of x);
    `lookup`: "shfl" (the default where the kernels run compiled on a GPU), "gather" or "load"."""
    if k % 2:
        return None
    kb = k // 2
    dot = override.pop("dot", False)
    words_fit = m <= GEMV_MAX_ROWS and not dot and k % 8 == 0 and blocksize >= 8
    # The word-wise kernel with shuffle lookups and inline-PTX loads is the fastest at one row, ahead of
    # bitsandbytes' GEMV; Triton's pipeliner (num_stages 2-4) was slower (`python -m fastplug.bench.qlora
    # --gemv-sweep`; docs/benchmarks/kernels.md, "4-bit GEMV").
    words = override.pop("words", words_fit and device.type == "cuda")
    if words and not words_fit:
        raise ValueError(
            f"words=True takes at most {GEMV_MAX_ROWS} rows of x, K a multiple of 8 and blocksize >= 8 "
            "(CUDA-core kernel)"
        )
    unit = 4 if words else 1  # bytes a unit of sub and chunk
    sub = min(32 // unit, max(1, blocksize // (2 * unit)), _lowbit(kb // unit))
    if device.type == "cuda":  # from the --gemv-sweep at 1, 2 and 8 rows of x
        block_n, chunk, warps = (16, 256, 4) if dot else (4, 512, 4) if words else (8, 512, 4)
        if words and m == 1:
            block_n, warps, chunk = _one_row_tile(n, kb // 4, device)
        target = 4 * num_sms(device)
    else:  # the interpreter: few, wide programs (its cost is per program and per op)
        block_n, chunk, warps, target = (16 if dot else 8), 128, 4, 1
    block_n = override.pop("block_n", block_n)
    chunk = override.pop("chunk", chunk)
    if dot:  # tl.dot wants at least 16 along N and K
        block_n, chunk = max(block_n, 16), max(chunk, 8)
    nb = max(1, chunk // (sub * unit))
    programs = cdiv(n, block_n)
    chunks = cdiv(kb // unit, nb * sub)
    split = override.pop("split", min(chunks, max(1, target // programs)) if programs < target // 2 else 1)
    compiled = device.type == "cuda" and not interpreter_enabled()
    lookup = override.pop("lookup", "shfl" if compiled else "load")
    if lookup not in LOOKUPS or (lookup == "shfl" and not compiled):
        raise ValueError(
            f"lookup must be one of {sorted(LOOKUPS)} ('shfl' is inline PTX: compiled CUDA only); "
            f"got {lookup!r} on {device.type}"
        )
    cfg = GemvConfig(
        block_n, nb, sub, split, override.pop("num_warps", warps), override.pop("x_split", True), dot, lookup, words
    )
    if override:
        raise ValueError(f"unknown gemv_config override(s): {sorted(override)}")
    return cfg


@functools.lru_cache(maxsize=1024)
def _default_config(m: int, n: int, k: int, blocksize: int, device: torch.device) -> GemvConfig | None:
    return gemv_config(m, n, k, blocksize, device)


def _gemv_rows(x2: torch.Tensor, u: _Unpacked, cfg: GemvConfig) -> torch.Tensor:
    """x2 [M, K] (unit stride in K, M <= GEMV_MAX_ROWS, K even) @ W^T by the tile's kernel (word-wise, tensor-core
    or byte-wise), split-K summed by `_sum_splits_kernel`."""
    M, (N, K) = x2.shape[0], u.packed.shape
    if cfg.words and u.words is None:  # bytes not at a word boundary: the byte-wise kernel
        cfg = gemv_config(M, N, K, u.packed.blocksize, x2.device, lookup=cfg.lookup, words=False)
    kb = K // (8 if cfg.words else 2)  # words or bytes a row
    chunk = cfg.nb * cfg.sub
    split_bytes = cdiv(cdiv(kb, chunk), cfg.split) * chunk  # whole chunks a split
    split = cdiv(kb, split_bytes)
    out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    part = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
    if cfg.dot and not cfg.words and not (x2.is_cuda and x2.dtype == torch.float32):  # fp32 tl.dot spills
        _gemv_4bit_dot_kernel[(cdiv(N, cfg.block_n), split)](
            x2,
            *u.args,
            part,
            M,
            N,
            kb,
            x2.stride(0),
            N,
            M * N,
            split_bytes,
            **u.consts,
            BLOCK_M=16,
            BLOCK_N=cfg.block_n,
            NB=cfg.nb,
            SUB=cfg.sub,
            DOT_F32=not x2.is_cuda,
            num_warps=cfg.num_warps,
        )
    else:
        if cfg.words:
            kernel, fallback = _gemv_4bit_words_kernel, dict(LOOKUP=LOOKUPS["gather"], PTX=False)
            args = (x2, u.words, *u.args[1:], part, M, N, kb, x2.stride(0), N, M * N, split_bytes)
            aligned = x2.data_ptr() % 16 == 0 and (M == 1 or x2.stride(0) % 8 == 0)
            consts = dict(
                BLOCK_N=cfg.block_n,
                NB=cfg.nb,
                SUBW=cfg.sub,
                PTX=cfg.lookup == "shfl" and x2.dtype == torch.bfloat16 and aligned,
                EVEN=N % cfg.block_n == 0 and kb % chunk == 0,
                BLOCK_M=next_power_of_2(M),
            )
        else:
            kernel, fallback = _gemv_4bit_rows_kernel, dict(LOOKUP=LOOKUPS["gather"])
            args = (x2, *u.args, part, N, kb, x2.stride(0), N, M * N, split_bytes)
            consts = dict(
                M=M, M_POW2=next_power_of_2(M), BLOCK_N=cfg.block_n, NB=cfg.nb, SUB=cfg.sub, X_SPLIT=cfg.x_split
            )
        launch_checked(
            kernel,
            (cdiv(N, cfg.block_n), split),
            args,
            dict(**u.consts, **consts, LOOKUP=LOOKUPS[cfg.lookup], num_warps=cfg.num_warps),
            fallback,
        )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(M * N, block),)](part, out, M * N, SPLIT=split, BLOCK=block, num_warps=4)
    return out


_LAUNCH_CHECKED: dict[tuple, bool] = state.register_cache("quant.launch_checked", {})


def _flat(args):
    for a in args:
        if isinstance(a, tuple):
            yield from _flat(a)
        else:
            yield a


def launch_checked(kernel, grid, args, consts: dict, fallback: dict) -> None:
    """kernel[grid](*args, **consts); a shuffle-lookup kernel (LOOKUP_SHFL) is first compiled by `kernel.warmup`
    and checked by `layouts_agree`, once per kernel, constexprs and argument dtypes, and launched with
    `fallback` merged into its constexprs (tl.gather lookups) where it fails: checked before the launch, since a
    kernel that adds into its output in place (the decode step's residual) cannot be launched again."""
    if consts.get("LOOKUP") == LOOKUP_SHFL:
        key = (kernel, tuple(sorted(consts.items())), *(a.dtype for a in _flat(args) if torch.is_tensor(a)))
        if key not in _LAUNCH_CHECKED:
            _LAUNCH_CHECKED[key] = layouts_agree(kernel.warmup(*args, grid=grid, **consts))
        if not _LAUNCH_CHECKED[key]:
            consts = {**consts, **fallback}
    kernel[grid](*args, **consts)


def _gemv_general(x2: torch.Tensor, u: _Unpacked) -> torch.Tensor:
    """Any shape (odd K: rows straddle bytes), one element at a time: slower, used only where K is odd."""
    p = u.packed
    M, (N, K) = x2.shape[0], p.shape
    out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    block_m = next_power_of_2(M)
    block_n = (16 if block_m <= 2 else 8) if x2.is_cuda else 4
    block_k = min(p.blocksize, 128) if x2.is_cuda else 32
    row_scale = K % p.blocksize == 0 and p.blocksize % block_k == 0
    _gemv_4bit_kernel[(cdiv(N, block_n),)](
        x2,
        *u.args,
        out,
        M,
        N,
        K,
        x2.stride(0),
        out.stride(0),
        **u.consts,
        ROW_SCALE=row_scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def gemv_4bit(x: torch.Tensor, weight, config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., in] @ W^T for a 4-bit weight W [out, in], straight from the packed bytes: the decode-time
    product (at most GEMV_KERNEL_ROWS rows of x, GEMV_MAX_ROWS with an explicit `config`; more rows take one
    dequantization and a matmul). Products and sums in fp32, W never rounded (the tensor-core tile rounds it
    to x's dtype, as a dequantized weight is); the result in x's dtype. `config`: a tile from `gemv_config`."""
    u = _unpacked(weight)
    p = u.packed
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != p.shape[1]:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [..., {p.shape[1]}] to match weight {p.shape}; got {got}")
    check_dtype("x", x)
    if x.device != p.data.device:
        raise ValueError(f"x must be on {p.data.device} like weight; got {x.device}")
    x2 = rows_view(x)
    M, (N, K) = x2.shape[0], p.shape
    cfg = config
    if cfg is None and 0 < M <= GEMV_MAX_ROWS:
        cfg = tuning.pick("gemv_4bit", _default_config, M, N, K, p.blocksize, x2.device)
    words = cfg is not None and cfg.words and u.words is not None
    if M > (GEMV_MAX_ROWS if config is not None or words else GEMV_KERNEL_ROWS) or not use_triton(x2):
        return (x2 @ dequantize_4bit(weight, dtype=x.dtype).t()).view(*x.shape[:-1], N)
    if M == 0:
        return x2.new_empty((0, N)).view(*x.shape[:-1], N)
    out = _gemv_general(x2, u) if cfg is None else _gemv_rows(x2, u, cfg)
    return out.view(*x.shape[:-1], N)


def gemv_4bit_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """Plain torch: x @ dequantized(W)^T with fp32 accumulation, in x's dtype."""
    w = dequantize_4bit_reference(weight, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)
