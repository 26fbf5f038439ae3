"""What every attention launch shares: the limits and the input checks of the public functions, the launch
configs (`AttentionConfig` by `attention_config`, from `AttentionTables`; tuned through `kernels.tuning` as
"attention"), whether tiles are read through TMA descriptors (`_use_tma`), the problem's shape and options
(`_Problem`) and the structured arguments every kernel takes from it (`Operand` per tensor, `Heads`, `Scores`,
and the constexpr `Mask` and `Tile`: `_launch_args`, the dot precision included)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import triton

from .. import tuning
from .._utils import check_dtype, check_same_device, next_power_of_2

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


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


class Operand(NamedTuple):
    """A tensor of (batch, heads, tokens, head dim) as the kernels read it: its pointer and its strides by meaning,
    whatever the memory layout (`_operand`)."""

    ptr: torch.Tensor
    stride_b: int
    stride_h: int
    stride_t: int
    stride_d: int


def _operand(t: torch.Tensor, tokens_before_heads: bool = False) -> Operand:
    """t as an `Operand`: (B, H, tokens, D) in its dims, or (B, tokens, H, D) (the output) when tokens_before_heads."""
    b, x, y, d = t.stride()
    return Operand(t, b, y, x, d) if tokens_before_heads else Operand(t, b, x, y, d)


class Heads(NamedTuple):
    n_heads: int  # query heads
    n_kv_heads: int
    group: int  # query heads a key/value head
    head_dim: int


class Scores(NamedTuple):
    window: int  # sliding window (read with HAS_WINDOW)
    qk_scale: float  # q.k to base-2 scores (to the softcap's argument with HAS_SOFTCAP)
    cap_scale: float  # tanh to base-2 scores (softcap x log2 e; read with HAS_SOFTCAP)
    ds_scale: float  # the softmax scale, on dQ and dK (the backward's)


class Mask(NamedTuple):
    """Constexpr: which keys a row sees, and what joins its softmax."""

    CAUSAL: bool
    HAS_WINDOW: bool
    HAS_SOFTCAP: bool
    VARLEN: bool  # per-token document bounds (START, END)
    HAS_SINKS: bool


class Tile(NamedTuple):
    """Constexpr: the blocks, the dot precision and whether tiles are read through TMA descriptors."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_D: int
    PRECISION: str
    TMA: bool


def _precision(dtype: torch.dtype, interpret: bool) -> str:
    """IEEE dots for fp32 (no TF32); the interpreter upcasts bf16 (its dots would truncate)."""
    return "ieee" if dtype == torch.float32 else "upcast" if interpret and dtype == torch.bfloat16 else "tf32"


def _launch_args(p: _Problem, q: torch.Tensor, cfg: AttentionConfig, varlen: bool, sinks: bool, tma: bool) -> tuple:
    """(Heads, Scores, Mask, Tile) of a launch on q's device and dtype."""
    if p.softcap is not None:
        qk_scale, cap_scale = p.scale / p.softcap, p.softcap * LOG2E
    else:
        qk_scale, cap_scale = p.scale * LOG2E, 1.0
    return (
        Heads(p.Hq, p.Hkv, p.Hq // p.Hkv, p.D),
        Scores(p.window or 0, qk_scale, cap_scale, p.scale),
        Mask(p.causal, p.window is not None, p.softcap is not None, varlen, sinks),
        Tile(cfg.block_m, cfg.block_n, p.block_d, _precision(q.dtype, q.device.type != "cuda"), tma),
    )


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
