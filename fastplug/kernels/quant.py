"""4-bit weights of bitsandbytes (NF4 and FP4, with or without double quantization): dequantization and a
decode GEMV in Triton, reading the packed bytes directly. No bitsandbytes call runs here.

The format (bitsandbytes' `Params4bit` + `QuantState`): the weight [out, in] is flattened row-major and
packed two elements a byte, element 2i in the high nibble; element e's 4-bit index selects a value of a
16-entry table (NF4 quantiles or FP4), scaled by the fp32 absmax of its block of `blocksize` elements.
With double quantization the absmax are themselves 8-bit: absmax[b] = code2[q[b]] * absmax2[b // blocksize2]
+ offset. Values are formed in fp32 and rounded once to the output dtype, as bitsandbytes does, so the
dequantization equals `bitsandbytes.functional.dequantize_4bit`.

bitsandbytes is never imported: a weight is recognised by its `quant_state`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._utils import cdiv, check_dtype, next_power_of_2, rows_view, scratch, use_triton

INSTALL_HINT = 'pip install "fastplug[qlora]"'
GEMV_MAX_ROWS = 8  # beyond this, dequantizing once and one matmul is faster than a GEMV per row block

# The tables bitsandbytes defines for its two 4-bit types (NF4: quantiles of N(0, 1); FP4: 1 sign,
# 2 exponent, 1 mantissa bit, in bit-pattern order, divided by its largest magnitude).
_NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
_FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


@functools.cache
def _table(quant_type: str, device: torch.device) -> torch.Tensor:
    values = torch.tensor(_NF4 if quant_type == "nf4" else _FP4, dtype=torch.float32, device=device)
    return values / values.abs().max()


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


def unpack(weight) -> Packed4bit:
    """The fields of a bitsandbytes Params4bit; ValueError naming what is wrong with `weight`."""
    if not is_4bit(weight):
        raise ValueError(
            "weight must be a bitsandbytes 4-bit weight (Params4bit with a quant_state; quantized: move it to "
            f"the device first); got {type(weight).__name__}. For 4-bit support: {INSTALL_HINT}"
        )
    qs = weight.quant_state
    if qs.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"weight.quant_state.quant_type must be 'nf4' or 'fp4'; got {qs.quant_type!r}")
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("weight is in bitsandbytes' CPU inference layout (packing_format_for_cpu); not supported")
    shape = tuple(qs.shape)
    if len(shape) != 2:
        raise ValueError(f"weight.quant_state.shape must be 2-D [out, in]; got {shape}")
    if not _is_pow2(qs.blocksize):
        raise ValueError(f"weight.quant_state.blocksize must be a power of two; got {qs.blocksize}")
    data = weight.detach().reshape(-1)
    if data.dtype != torch.uint8:  # quant_storage other than uint8 (FSDP): the same bytes
        data = data.view(torch.uint8)
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


# ------------------------------------------------------------------------------------------- kernels


@triton.jit
def _block_scale(blk, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2: tl.constexpr,
                 NESTED: tl.constexpr):
    """fp32 absmax of the blocks `blk` (decoded from 8 bits when double-quantized)."""
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale2 = tl.load(absmax2_ptr + (blk >> BLOCKSIZE2_LOG2), mask=mask, other=0.0)
        return tl.load(code2_ptr + q, mask=mask, other=0.0) * scale2 + tl.load(offset_ptr)
    return tl.load(absmax_ptr + blk, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dequant_4bit_kernel(
    data_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, numel,
    BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr, BLOCK: tl.constexpr,
):
    """Each program turns BLOCK bytes into 2*BLOCK contiguous outputs."""
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BLOCK + tl.arange(0, BLOCK)
    nbytes = (numel + 1) // 2
    mask = byte < nbytes
    packed = tl.load(data_ptr + byte, mask=mask, other=0).to(tl.int32)
    # blocksize >= 2 is even: both elements of a byte share their block
    scale = _block_scale((byte * 2) >> BLOCKSIZE_LOG2, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                         BLOCKSIZE2_LOG2, NESTED)
    hi = tl.load(code_ptr + (packed >> 4)) * scale
    lo = tl.load(code_ptr + (packed & 15)) * scale
    vals = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))  # element 2i from the high nibble, 2i+1 from the low
    elem = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + elem, vals.to(out_ptr.dtype.element_ty), mask=elem < numel)


@triton.jit
def _gemv_4bit_kernel(
    x_ptr, data_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
    M, N, K, stride_xm, stride_om,
    BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] W[n, k] for BLOCK_N outputs of all M (<= BLOCK_M) rows, W decoded from its
    packed bytes in registers. Addresses are element indices n*K + k, so an odd K (rows straddling bytes)
    needs no special case. ROW_SCALE: each row of a [BLOCK_N, BLOCK_K] tile lies in one quantization block
    (K and the blocksize are multiples of BLOCK_K), so the scales are loaded per row, not per element."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    row_start = rn.to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        kmask = k < K
        wmask = (rn[:, None] < N) & kmask[None, :]
        elem = row_start[:, None] + k[None, :]
        packed = tl.load(data_ptr + (elem >> 1), mask=wmask, other=0).to(tl.int32)
        nibble = (packed >> ((1 - (elem & 1)) * 4).to(tl.int32)) & 15
        if ROW_SCALE:
            scale = _block_scale((row_start + k0) >> BLOCKSIZE_LOG2, rn < N, absmax_ptr, absmax2_ptr, code2_ptr,
                                 offset_ptr, BLOCKSIZE2_LOG2, NESTED)[:, None]
        else:
            scale = _block_scale(elem >> BLOCKSIZE_LOG2, wmask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                 BLOCKSIZE2_LOG2, NESTED)
        w = tl.load(code_ptr + nibble) * scale  # [BLOCK_N, BLOCK_K] fp32
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# ----------------------------------------------------------------------------------------- launchers


def _nested_args(p: Packed4bit):
    """(absmax2, code2, offset, log2(blocksize2)); the absmax tensor stands in for unused pointers."""
    if p.nested is None:
        return p.absmax, p.absmax, p.absmax, 0
    absmax2, code2, blocksize2, offset = p.nested
    return absmax2, code2, offset, blocksize2.bit_length() - 1


def _check_out(out: torch.Tensor, p: Packed4bit) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a tensor; got {type(out).__name__}")
    check_dtype("out", out)
    if tuple(out.shape) != p.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {p.shape}; got {tuple(out.shape)}")
    if out.device != p.data.device:
        raise ValueError(f"out must be on {p.data.device} like weight; got {out.device}")


def dequantize_4bit(weight, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [out, in] matrix of a bitsandbytes 4-bit weight, written into `out` when given (a reusable
    buffer; its dtype wins) or a new tensor of `dtype` (default: the dtype the weight was quantized from)."""
    p = unpack(weight)
    if out is None:
        dtype = p.dtype if dtype is None else dtype
        check_dtype("dtype", torch.empty(0, dtype=dtype))
        out = torch.empty(p.shape, dtype=dtype, device=p.data.device)
    else:
        _check_out(out, p)
    if not use_triton(p.data):
        return out.copy_(dequantize_4bit_reference(weight, out.dtype))
    absmax2, code2, offset, log2_b2 = _nested_args(p)
    numel = out.numel()
    block = 1024  # bytes a program; also few programs for the interpreter, whose cost is per program
    _dequant_4bit_kernel[(cdiv(cdiv(numel, 2), block),)](
        p.data, p.absmax, p.code, absmax2, code2, offset, out, numel,
        BLOCKSIZE_LOG2=p.blocksize.bit_length() - 1, BLOCKSIZE2_LOG2=log2_b2, NESTED=p.nested is not None,
        BLOCK=block, num_warps=4,
    )
    return out


def dequantize_4bit_reference(weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch, the same maths: the path for tensors Triton cannot run, and the tests' second opinion."""
    p = unpack(weight)
    numel = p.shape[0] * p.shape[1]
    bytes_ = p.data[: cdiv(numel, 2)].long()
    idx = torch.stack((bytes_ >> 4, bytes_ & 15), dim=1).reshape(-1)[:numel]
    blk = torch.arange(numel, device=idx.device) // p.blocksize
    absmax = p.absmax
    if p.nested is not None:
        absmax2, code2, blocksize2, offset = p.nested
        absmax = code2[absmax.long()] * absmax2[torch.arange(absmax.numel(), device=idx.device) // blocksize2]
        absmax = absmax + offset
    values = p.code[idx] * absmax.float()[blk]
    return values.to(p.dtype if dtype is None else dtype).view(p.shape)


def dequantize_4bit_scratch(weight, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_4bit into the buffer that dequantized weights share (`_utils.scratch`): valid until the next
    dequantization on that device in that dtype; use it at once, never keep it."""
    return dequantize_4bit(weight, out=scratch(shape_4bit(weight), dtype, weight.device))


def gemv_4bit(x: torch.Tensor, weight) -> torch.Tensor:
    """x [..., in] @ W^T for a 4-bit weight W [out, in], straight from the packed bytes: the decode-time
    product (at most GEMV_MAX_ROWS rows of x; more rows take one dequantization and a matmul).

    Not yet fast: on an H100, batch 1 at 4096x14336 takes 0.24 ms against bitsandbytes' 0.036 ms; each
    element still gathers its table value (and each byte is loaded per element, twice).
    """
    p = unpack(weight)
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != p.shape[1]:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [..., {p.shape[1]}] to match weight {p.shape}; got {got}")
    check_dtype("x", x)
    if x.device != p.data.device:
        raise ValueError(f"x must be on {p.data.device} like weight; got {x.device}")
    x2 = rows_view(x)
    M, (N, K) = x2.shape[0], p.shape
    if M > GEMV_MAX_ROWS or not use_triton(x2):
        return (x2 @ dequantize_4bit(weight, dtype=x.dtype).t()).view(*x.shape[:-1], N)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    absmax2, code2, offset, log2_b2 = _nested_args(p)
    block_m = next_power_of_2(M)
    block_n = (16 if block_m <= 2 else 8) if x.is_cuda else 4
    block_k = min(p.blocksize, 128) if x.is_cuda else 32
    row_scale = K % p.blocksize == 0 and p.blocksize % block_k == 0
    _gemv_4bit_kernel[(cdiv(N, block_n),)](
        x2, p.data, p.absmax, p.code, absmax2, code2, offset, out, M, N, K, x2.stride(0), out.stride(0),
        BLOCKSIZE_LOG2=p.blocksize.bit_length() - 1, BLOCKSIZE2_LOG2=log2_b2, NESTED=p.nested is not None,
        ROW_SCALE=row_scale, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out.view(*x.shape[:-1], N)


def gemv_4bit_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """Plain torch: x @ dequantized(W)^T with fp32 accumulation, in x's dtype."""
    w = dequantize_4bit_reference(weight, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


def require_bitsandbytes():
    """bitsandbytes, imported now (never at fastplug's import); ImportError saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(f"4-bit (QLoRA) loading needs bitsandbytes: {INSTALL_HINT}") from error
    return bitsandbytes
