"""bitsandbytes' 4-bit format, read without bitsandbytes: what the kernels take of a weight, cached per weight.

The format (bitsandbytes' `Params4bit` + `QuantState`): the weight [out, in] is flattened row-major and
packed two elements a byte, element 2i in the high nibble; element e's 4-bit index selects a value of a
16-entry table (NF4 quantiles or FP4), scaled by the fp32 absmax of its block of `blocksize` elements.
With double quantization the absmax are themselves 8-bit: absmax[b] = code2[q[b]] * absmax2[b // blocksize2]
+ offset.

A weight is recognised by its `quant_state`, its layout by the state's flags, not by a version (the CPU
inference layout of bitsandbytes >= 0.49 is read back into the standard one: `_from_cpu_layout`). A weight's
fields are read once and cached per weight (`_unpacked`): a training step dequantizes each weight three times,
and each read through a Params4bit's __torch_function__ costs the host microseconds.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from .. import state
from .._utils import cdiv, triton_available

INSTALL_HINT = 'pip install "fastplug[qlora]"'

# The tables bitsandbytes defines for its two 4-bit types (NF4: quantiles of N(0, 1); FP4: 1 sign,
# 2 exponent, 1 mantissa bit, in bit-pattern order, divided by its largest magnitude).
_NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


@functools.cache
def _table(quant_type: str, device: torch.device) -> torch.Tensor:
    values = torch.tensor(_NF4 if quant_type == "nf4" else _FP4, dtype=torch.float32, device=device)
    return values / values.abs().max()


state.register_cache("quant.code_tables", _table)


class Packed4bit(NamedTuple):
    """What the kernels read of a 4-bit weight."""

    data: torch.Tensor  # uint8 [ceil(numel / 2)]
    absmax: torch.Tensor  # fp32 [blocks], or uint8 [blocks] when nested
    code: torch.Tensor  # fp32 [16]
    blocksize: int
    shape: tuple  # (out, in)
    dtype: torch.dtype  # the dtype the weight was quantized from: the default output dtype
    nested: tuple | None  # (absmax2 fp32, code2 fp32 [256], blocksize2, offset fp32 0-d) or None


def is_4bit(weight) -> bool:
    """True for a bitsandbytes 4-bit weight (a tensor carrying a `quant_state`)."""
    return isinstance(weight, torch.Tensor) and getattr(weight, "quant_state", None) is not None


def shape_4bit(weight) -> tuple:
    """The (out, in) shape a packed 4-bit weight stands for."""
    return tuple(weight.quant_state.shape)


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _unpack(weight) -> Packed4bit:
    if not is_4bit(weight):
        raise ValueError(
            "weight must be a bitsandbytes 4-bit weight (Params4bit with a quant_state; quantized: move it to "
            f"the device first); got {type(weight).__name__}. For 4-bit support: {INSTALL_HINT}"
        )
    qs = weight.quant_state
    if qs.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"weight.quant_state.quant_type must be 'nf4' or 'fp4'; got {qs.quant_type!r}")
    shape = tuple(qs.shape)
    if len(shape) != 2:
        raise ValueError(f"weight.quant_state.shape must be 2-D [out, in]; got {shape}")
    if not _is_pow2(qs.blocksize) or qs.blocksize < 2:
        raise ValueError(f"weight.quant_state.blocksize must be a power of two >= 2; got {qs.blocksize}")
    data = weight.detach().reshape(-1)
    if data.dtype != torch.uint8:  # quant_storage other than uint8 (FSDP): the same bytes
        data = data.view(torch.uint8)
    if getattr(qs, "packing_format_for_cpu", False):  # the flag, not a version: bitsandbytes < 0.49 has none
        return _from_cpu_layout(data, qs, shape)
    numel = shape[0] * shape[1]
    if data.numel() < cdiv(numel, 2):
        raise ValueError(f"weight holds {data.numel()} bytes; {shape} needs {cdiv(numel, 2)}")
    nested = None
    if qs.nested:
        s2 = qs.state2
        if not _is_pow2(s2.blocksize):
            raise ValueError(f"weight.quant_state.state2.blocksize must be a power of two; got {s2.blocksize}")
        offset = qs.offset if isinstance(qs.offset, torch.Tensor) else torch.tensor(float(qs.offset))
        nested = (s2.absmax.float(), s2.code.float(), s2.blocksize, offset.float().to(data.device))
    return Packed4bit(data, qs.absmax, _table(qs.quant_type, data.device), qs.blocksize, shape, qs.dtype, nested)


_CPU_BLOCK_N = 32  # rows a tile of bitsandbytes' CPU layout interleaves


def _from_cpu_layout(data: torch.Tensor, qs, shape: tuple) -> Packed4bit:
    """A weight in bitsandbytes' CPU inference layout, read back into the standard one as a copy (the weight is
    left as it is: bitsandbytes' own forward keeps reading its layout).

    bitsandbytes >= 0.49 rewrites a Linear4bit's weight in place at its first eval forward without grad on a CPU
    with AVX512-BF16 (`packing_format_for_cpu` on the quant state): data [out, in / 2] where each tile of 32 rows
    x 2 columns is 32 bytes, rows 0-15 in the low nibbles and 16-31 in the high ones; the absmax un-nested,
    transposed to [in / blocksize, out] and rounded to bf16. Its own inverse re-quantizes the absmax (lossy),
    so the weight is read here with the bf16 absmax its forward now computes with."""
    out, k = shape
    blocks = k // qs.blocksize if k % qs.blocksize == 0 else 0
    if (
        out % _CPU_BLOCK_N
        or k % 2
        or not blocks
        or data.numel() != out * k // 2
        or tuple(qs.absmax.shape) != (blocks, out)
        or getattr(qs, "nested", False)
    ):
        raise ValueError(
            f"weight is in bitsandbytes' CPU inference layout (packing_format_for_cpu) with shape "
            f"{shape}, {data.numel()} bytes and absmax {tuple(qs.absmax.shape)}: not a layout fastplug "
            f"reads (it expects [out, in / 2] bytes, out % {_CPU_BLOCK_N} == 0, absmax [in / blocksize, "
            "out])"
        )
    tiles = data.reshape(out // _CPU_BLOCK_N, k // 2, _CPU_BLOCK_N)
    nibbles = torch.cat([tiles & 15, tiles >> 4], -1).reshape(out // _CPU_BLOCK_N, k // 2, _CPU_BLOCK_N, 2)
    nibbles = nibbles.transpose(1, 2).reshape(-1)  # row-major [out, in]
    standard = (nibbles[0::2] << 4) | nibbles[1::2]
    absmax = qs.absmax.t().reshape(-1).float()  # blocks row-major again (in % blocksize == 0 here)
    dtype = getattr(qs, "original_dtype", None) or qs.dtype  # the repack sets dtype to bf16, keeps the original
    return Packed4bit(standard, absmax, _table(qs.quant_type, data.device), qs.blocksize, shape, dtype, None)


def layout_reason(weight) -> str | None:
    """Why fastplug cannot read this quantized 4-bit weight as it is stored now (None: it can)."""
    try:
        _unpacked(weight)
    except ValueError as error:
        return str(error)
    return None


class _Unpacked(NamedTuple):
    """A weight's fields and its kernels' arguments, made once per weight: a QLoRA step dequantizes every
    weight three times (forward, checkpoint recompute, backward), and reading a Params4bit's fields through
    its __torch_function__ costs microseconds each, which the host of a step pays hundreds of times."""

    ref: weakref.ref  # the weight; its callback drops the entry
    quant_state: object  # identity checks: a re-quantized or moved weight gets a new state or absmax
    absmax: torch.Tensor
    data_ptr: int
    packed: Packed4bit
    args: tuple  # data, absmax, code, absmax2, code2, offset: the kernels' leading pointer arguments
    consts: dict  # BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED
    numel: int
    compiled: bool  # on CUDA with Triton: the kernels run compiled (otherwise `use_triton` decides per call)
    words: torch.Tensor | None  # the packed bytes as int32 (the word-wise GEMV), None where they are not aligned


_UNPACKED: dict[int, _Unpacked] = state.register_cache("quant.unpacked", {})


def _unpacked(weight) -> _Unpacked:
    hit = _UNPACKED.get(id(weight))
    if hit is not None and hit.ref() is weight:
        qs = weight.quant_state
        if qs is hit.quant_state and qs.absmax is hit.absmax and weight.data_ptr() == hit.data_ptr:
            return hit
    p = _unpack(weight)
    key = id(weight)
    ref = weakref.ref(weight, lambda _, key=key, cache=_UNPACKED: cache.pop(key, None))
    if p.nested is None:
        absmax2, code2, offset, log2_b2 = p.absmax, p.absmax, p.absmax, 0  # unused pointers
    else:
        absmax2, code2, blocksize2, offset = p.nested
        log2_b2 = blocksize2.bit_length() - 1
    consts = dict(BLOCKSIZE_LOG2=p.blocksize.bit_length() - 1, BLOCKSIZE2_LOG2=log2_b2, NESTED=p.nested is not None)
    words = p.data[: p.data.numel() // 4 * 4].view(torch.int32) if p.data.data_ptr() % 4 == 0 else None
    entry = _Unpacked(
        ref,
        weight.quant_state,
        weight.quant_state.absmax,
        weight.data_ptr(),
        p,
        (p.data, p.absmax, p.code, absmax2, code2, offset),
        consts,
        p.shape[0] * p.shape[1],
        p.data.is_cuda and triton_available(),
        words,
    )
    _UNPACKED[key] = entry
    return entry


def unpack(weight) -> Packed4bit:
    """The fields of a bitsandbytes Params4bit (cached per weight); ValueError naming what is wrong with `weight`."""
    return _unpacked(weight).packed


def require_bitsandbytes():
    """bitsandbytes, imported now (never at fastplug's import); ImportError saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(f"4-bit (QLoRA) loading needs bitsandbytes: {INSTALL_HINT}") from error
    return bitsandbytes
