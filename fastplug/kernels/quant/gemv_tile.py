"""The 4-bit GEMV's word-wise tile: `GemvConfig`, built by `gemv_config` and picked through `kernels.tuning` under
the name "gemv_4bit" (`default_gemv_config`), and `launch_checked`, which launches a kernel that may look its table
up by warp shuffle only after checking the compiled layouts. The kernel is the decode GEMV's
(`kernels.decode.gemv`); its loop is `gemv_kernels.words_row_sums`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import state
from .._utils import cdiv, interpreter_enabled, num_sms
from ..ptx import layouts_agree
from .gemv_kernels import LOOKUP_SHFL, LOOKUPS

GEMV_MAX_ROWS = 8  # beyond this, dequantizing once and one matmul is faster than a GEMV per row block


class GemvConfig(NamedTuple):
    """Tile of the word-wise 4-bit GEMV: BLOCK_N rows x NB sub-chunks x SUB 32-bit words of packed bytes a step,
    `split` programs along K (a plain product only), `num_warps`, and how the 16 table values are looked up
    (`lookup`, a key of LOOKUPS)."""

    block_n: int
    nb: int
    sub: int
    split: int
    num_warps: int
    lookup: str = "load"


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
    """The tile for x [m, k] @ W[n, k]^T, or None where the word-wise loop cannot read the weight (K not a multiple
    of 8, blocksize < 8). A sub-chunk is at most 8 words (two 16-byte vectors) and lies inside one quantization
    block and one row; split-K only when the rows alone would leave the GPU's SMs idle. Overrides: block_n, chunk
    (bytes a row a step), split, num_warps, lookup ("shfl", the default where the kernels run compiled on a GPU;
    "gather" or "load"). The shuffle lookups with inline-PTX loads are the fastest at one row, ahead of
    bitsandbytes' GEMV; Triton's pipeliner (num_stages 2-4) was slower (`python -m fastplug.bench.qlora
    --gemv-sweep`; docs/benchmarks/kernels.md, "4-bit GEMV")."""
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"the word-wise GEMV takes 1 to {GEMV_MAX_ROWS} rows of x; got {m}")
    if k % 8 or blocksize < 8:
        return None
    kw = k // 8
    sub = min(8, max(1, blocksize // 8), _lowbit(kw))
    if device.type == "cuda":  # from the --gemv-sweep at 1, 2 and 8 rows of x
        block_n, chunk, warps = 4, 512, 4
        if m == 1:
            block_n, warps, chunk = _one_row_tile(n, kw, device)
        target = 4 * num_sms(device)
    else:  # the interpreter: few, wide programs (its cost is per program and per op)
        block_n, chunk, warps, target = 8, 128, 4, 1
    block_n = override.pop("block_n", block_n)
    chunk = override.pop("chunk", chunk)
    nb = max(1, chunk // (sub * 4))
    programs = cdiv(n, block_n)
    chunks = cdiv(kw, nb * sub)
    split = override.pop("split", min(chunks, max(1, target // programs)) if programs < target // 2 else 1)
    compiled = device.type == "cuda" and not interpreter_enabled()
    lookup = override.pop("lookup", "shfl" if compiled else "load")
    if lookup not in LOOKUPS or (lookup == "shfl" and not compiled):
        raise ValueError(
            f"lookup must be one of {sorted(LOOKUPS)} ('shfl' is inline PTX: compiled CUDA only); "
            f"got {lookup!r} on {device.type}"
        )
    cfg = GemvConfig(block_n, nb, sub, split, override.pop("num_warps", warps), lookup)
    if override:
        raise ValueError(f"unknown gemv_config override(s): {sorted(override)}")
    return cfg


@functools.lru_cache(maxsize=1024)
def default_gemv_config(m: int, n: int, k: int, blocksize: int, device: torch.device) -> GemvConfig | None:
    """`gemv_config` without overrides, cached (the heuristic `kernels.tuning` picks "gemv_4bit" by)."""
    return gemv_config(m, n, k, blocksize, device)


_LAUNCH_CHECKED: dict[tuple, bool] = state.register_cache("quant.launch_checked", {})


def launch_checked(kernel, grid, args, consts: dict, fallback: dict, dtypes: tuple) -> None:
    """kernel[grid](*args, **consts); a shuffle-lookup kernel (LOOKUP_SHFL) is first compiled by `kernel.warmup`
    and checked by `layouts_agree`, once per kernel, constexprs and `dtypes`, and launched with `fallback` merged
    into its constexprs (tl.gather lookups) where it fails: checked before the launch, since a kernel that adds
    into its output in place (the decode step's residual) cannot be launched again. `dtypes`: the dtypes of the
    arguments the compiled kernel depends on, named by the caller (reading them off every nested argument on each
    call cost the host as much as the launch itself)."""
    if consts.get("LOOKUP") == LOOKUP_SHFL:
        key = (kernel, tuple(sorted(consts.items())), dtypes)
        if key not in _LAUNCH_CHECKED:
            _LAUNCH_CHECKED[key] = layouts_agree(kernel.warmup(*args, grid=grid, **consts))
        if not _LAUNCH_CHECKED[key]:
            consts = {**consts, **fallback}
    kernel[grid](*args, **consts)
