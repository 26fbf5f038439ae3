"""The structured arguments of the grouped GEMM kernels (docs/contributing.md): a NamedTuple per operand with its
pointer and strides by meaning, and constexpr NamedTuples for what specialises a launch (`Tile`: the tuned blocks
and the dots' precision; a spec per kernel: what it fuses and how it reads its operands).

Two kinds of argument stay plain parameters: the row count M, in every kernel's `do_not_specialize` (a new batch
length compiles nothing), and the host-side tensor descriptors (TMA): Triton 3.6 compiles a kernel with a descriptor
inside a tuple, but its launcher expands only descriptors passed at the top level and refuses the launch."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """A [rows, columns] operand: its pointer, the index its grouped rows are gathered from or scattered to (read
    with the kernel's HAS_*_INDEX flag) and its strides."""

    ptr: torch.Tensor
    index: torch.Tensor
    stride_row: int
    stride_col: int


class Experts(NamedTuple):
    """A per-expert matrix [E, N, K] (the weights, dW): its pointer and strides."""

    ptr: torch.Tensor
    stride_e: int
    stride_n: int
    stride_k: int


class LoRA(NamedTuple):
    """The rank-r term t[m] @ b[e]^T of `_grouped_mm`'s epilogue: t [M, rank], b [E, N, rank] (read with HAS_LORA)."""

    t: torch.Tensor
    b: torch.Tensor
    rank: int
    stride_tm: int
    stride_tr: int
    stride_be: int
    stride_bn: int
    stride_br: int


class Bias(NamedTuple):
    """A per-expert bias [E, N] (read with HAS_BIAS)."""

    ptr: torch.Tensor
    stride_e: int
    stride_n: int


class GluOut(NamedTuple):
    """`_grouped_mm_glu`'s outputs, unit column stride: gu [M, 2I] (written with STORE_GU) and h [M, I]."""

    gu: torch.Tensor
    h: torch.Tensor
    stride_gu: int
    stride_h: int


class Tile(NamedTuple):
    """Constexpr: the tuned config's blocks and the dots' precision ("ieee", "tf32"; the interpreter's "upcast")."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    PRECISION: str


class MmSpec(NamedTuple):
    """Constexpr of `_grouped_mm`: what its epilogue fuses, how it reads A and W, how programs walk the experts."""

    HAS_A_INDEX: bool
    HAS_OUT_INDEX: bool
    HAS_RW: bool  # row weights
    HAS_LORA: bool
    HAS_BIAS: bool
    BLOCK_R: int  # the LoRA rank, padded
    A_TMA: bool
    W_TMA: bool
    W_KMAJOR: bool  # W's descriptor is over [E * N, K] (else [E * K, N])
    BLOCK_E: int  # the experts, padded (`_expert_tile`)
    GROUP_M: int  # row tiles that share a weight tile in L2


class GluMmSpec(NamedTuple):
    """Constexpr of `_grouped_mm_glu`: gathered rows, the bias, whether gu is stored, the activation (`glu.GluSpec`'s
    act and layout), how it reads A and W, how programs walk the experts."""

    HAS_A_INDEX: bool
    HAS_BIAS: bool
    STORE_GU: bool
    ACT: int
    INTERLEAVED: bool
    A_TMA: bool
    W_TMA: bool
    BLOCK_E: int
    GROUP_M: int


class DwSpec(NamedTuple):
    """Constexpr of `_grouped_mm_dw`: gathered dy and x rows, row weights, and which of dy and x are read through
    their descriptors (over the expert's whole blocks of rows)."""

    HAS_DY_INDEX: bool
    HAS_X_INDEX: bool
    HAS_RW: bool
    DY_TMA: bool
    X_TMA: bool
