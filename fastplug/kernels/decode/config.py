"""What the decode kernels share: their limits, the argument tuples several of them take, the tl.dot precision of a
dtype, and the GEMV's launch config (`DecodeGemvConfig`, built by `decode_gemv_config`, tuned through
`kernels.tuning` as "decode_gemv")."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._utils import interpreter_enabled, next_power_of_2
from ..quant.gemv_tile import GEMV_MAX_ROWS

ACTIVATIONS = {None: -1, "silu": 0, "gelu_tanh": 1, "gelu": 2}  # gemv's `activation` -> jit_helpers.gate_factor's ACT
MAX_SEGMENTS = 3  # weights one GEMV launch reads (q, k, v)
MAX_ROWS = 16  # the GEMV's dot path pads rows to 16; more rows go through cuBLAS
WORDS_MAX_ROWS = GEMV_MAX_ROWS  # rows of x the word-wise 4-bit loop takes (accumulators per thread grow with them)


class Rows(NamedTuple):
    """A matrix as a kernel reads it: its first element and its row stride (elements)."""

    ptr: torch.Tensor
    stride: int


def rows_of(t: torch.Tensor) -> Rows:
    return Rows(t, t.stride(0))


class Norm(NamedTuple):
    """An RMSNorm as a kernel applies it: weight [N], eps, offset (0: Llama's, weight times the rounded normalised
    values; else Gemma's, (offset + weight) in fp32)."""

    weight: torch.Tensor
    eps: float
    offset: float


def precision(dtype: torch.dtype) -> str:
    """jit_helpers.dot's PRECISION for operands of `dtype`."""
    if interpreter_enabled():
        return "upcast"
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


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
