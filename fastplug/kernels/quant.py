"""4-bit weights of bitsandbytes (NF4 and FP4, with or without double quantization): dequantization and a
decode GEMV in Triton, reading the packed bytes directly. No bitsandbytes call runs here.

The format (bitsandbytes' `Params4bit` + `QuantState`): the weight [out, in] is flattened row-major and
packed two elements a byte, element 2i in the high nibble; element e's 4-bit index selects a value of a
16-entry table (NF4 quantiles or FP4), scaled by the fp32 absmax of its block of `blocksize` elements.
With double quantization the absmax are themselves 8-bit: absmax[b] = code2[q[b]] * absmax2[b // blocksize2]
+ offset. Values are formed in fp32 and rounded once to the output dtype, as bitsandbytes does, so the
dequantization equals `bitsandbytes.functional.dequantize_4bit`.

Three uses: `dequantize_4bit` (one weight; `dequantize_4bit_scratch` into the buffer dequantized weights share),
`dequantize_4bit_stacked` (a group of weights that read one input, one under another, one launch) for
QLoRA training, and `gemv_4bit` (decode: a few rows of x times the packed weight, never dequantized to memory).
A weight's fields are read once and cached per weight (`_unpacked`): a training step dequantizes each weight
three times, and each read through a Params4bit's __torch_function__ costs the host microseconds.

bitsandbytes is never imported: a weight is recognised by its `quant_state`, its layout by the state's flags, not
by a version (the CPU inference layout of bitsandbytes >= 0.49 is read back into the standard one:
`_from_cpu_layout`).
"""

from __future__ import annotations

import functools
import re
import warnings
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _utils, state
from ._utils import (
    cdiv, check_dtype, interpreter_enabled, next_power_of_2, num_sms, rows_view, scratch, triton_available, use_triton,
)

INSTALL_HINT = 'pip install "fastplug[qlora]"'
GEMV_MAX_ROWS = 8  # beyond this, dequantizing once and one matmul is faster than a GEMV per row block
# Rows of x the byte-wise default tile takes (its work grows with each row of x); more rows, up to GEMV_MAX_ROWS,
# take dequantize + matmul unless a tile is given or the word-wise kernel reads the weight (it looks each nibble up
# once for all rows: up to GEMV_MAX_ROWS). Past 4 rows the byte-wise tile lost to dequantize + matmul
# (`python -m fastplug.bench.qlora --gemv-sweep`; docs/benchmarks/kernels.md, "4-bit GEMV").
GEMV_KERNEL_ROWS = 4
# How the CUDA-core GEMVs look their 16 table values up: global loads (L1), tl.gather (shared memory, two
# barriers a call) or a warp shuffle (registers; inline PTX, so compiled CUDA only; the word-wise kernel then also
# loads x and the block scales by inline PTX). See `_table_values`.
LOOKUP_LOAD, LOOKUP_GATHER, LOOKUP_SHFL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
LOOKUPS = {"load": LOOKUP_LOAD, "gather": LOOKUP_GATHER, "shfl": LOOKUP_SHFL}

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
    if out % _CPU_BLOCK_N or k % 2 or not blocks or data.numel() != out * k // 2 or \
            tuple(qs.absmax.shape) != (blocks, out) or getattr(qs, "nested", False):
        raise ValueError(f"weight is in bitsandbytes' CPU inference layout (packing_format_for_cpu) with shape "
                         f"{shape}, {data.numel()} bytes and absmax {tuple(qs.absmax.shape)}: not a layout fastplug "
                         f"reads (it expects [out, in / 2] bytes, out % {_CPU_BLOCK_N} == 0, absmax [in / blocksize, "
                         "out])")
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
    entry = _Unpacked(ref, weight.quant_state, weight.quant_state.absmax, weight.data_ptr(), p,
                      (p.data, p.absmax, p.code, absmax2, code2, offset), consts, p.shape[0] * p.shape[1],
                      p.data.is_cuda and triton_available(), words)
    _UNPACKED[key] = entry
    return entry


def unpack(weight) -> Packed4bit:
    """The fields of a bitsandbytes Params4bit (cached per weight); ValueError naming what is wrong with `weight`."""
    return _unpacked(weight).packed


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


def _scale_ptx(nested: bool, pack: int) -> tuple[tl.constexpr, tl.constexpr]:
    """The inline PTX (and its constraints) of `_block_scale_ptx` for `pack` elements an instance: one load (chain)
    for the pack's first element, its value written to all `pack` outputs. Operands: the outputs $0.., then each
    input's `pack` elements (absmax, code2 and absmax2 addresses, valid, offset; or absmax address, valid)."""
    arg = [f"${pack * (i + 1)}" for i in range(5 if nested else 2)]
    if nested:
        absmax, code2, absmax2, valid, offset = arg
        load = (f"@p ld.global.nc.u8 q, [{absmax}]; @p mul.wide.u32 a, q, 4; @p add.s64 a, a, {code2}; "
                f"@p ld.global.nc.f32 c, [a]; @p ld.global.nc.f32 s, [{absmax2}]; @p fma.rn.f32 r, c, s, {offset};")
        regs, inputs = ".reg .b32 q; .reg .b64 a; .reg .f32 c, s, r;", "l" * 3 + "r" + "f"
    else:
        absmax, valid = arg
        load, regs, inputs = f"@p ld.global.nc.f32 r, [{absmax}];", ".reg .f32 r;", "lr"
    copies = " ".join(f"mov.b32 ${i}, r;" for i in range(pack))
    asm = f"{{ .reg .pred p; {regs} setp.ne.b32 p, {valid}, 0; mov.b32 r, 0; {load} {copies} }}"
    return tl.constexpr(asm), tl.constexpr(",".join(["=f"] * pack + [c for c in inputs for _ in range(pack)]))


_SCALE_PTX_NESTED, _SCALE_CONSTRAINTS_NESTED = _scale_ptx(True, 1)
_SCALE_PTX_FLAT, _SCALE_CONSTRAINTS_FLAT = _scale_ptx(False, 1)
_SCALE_PTX_NESTED4, _SCALE_CONSTRAINTS_NESTED4 = _scale_ptx(True, 4)
_SCALE_PTX_FLAT4, _SCALE_CONSTRAINTS_FLAT4 = _scale_ptx(False, 4)


@triton.jit
def _block_scale_ptx(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset, BLOCKSIZE2_LOG2: tl.constexpr,
                     NESTED: tl.constexpr, PACK4: tl.constexpr = False):
    """`_block_scale` with its loads in inline PTX (0 where not `valid`), so that it takes the layout of its use
    instead of one of its own and a trip through shared memory; `offset` is the nested offset, loaded once.
    PACK4: one load for each 4 consecutive elements of a thread, which must share a block (`_word_scales`)."""
    valid = valid.to(tl.int32)
    if NESTED:
        args = [(absmax_ptr + blk).to(tl.int64, bitcast=True), (code2_ptr + 0 * blk).to(tl.int64, bitcast=True),
                (absmax2_ptr + (blk >> BLOCKSIZE2_LOG2)).to(tl.int64, bitcast=True), valid,
                tl.zeros(blk.shape, dtype=tl.float32) + offset]
        return tl.inline_asm_elementwise(_SCALE_PTX_NESTED4 if PACK4 else _SCALE_PTX_NESTED,
                                         _SCALE_CONSTRAINTS_NESTED4 if PACK4 else _SCALE_CONSTRAINTS_NESTED, args,
                                         dtype=tl.float32, is_pure=True, pack=4 if PACK4 else 1)
    return tl.inline_asm_elementwise(_SCALE_PTX_FLAT4 if PACK4 else _SCALE_PTX_FLAT,
                                     _SCALE_CONSTRAINTS_FLAT4 if PACK4 else _SCALE_CONSTRAINTS_FLAT,
                                     [(absmax_ptr + blk).to(tl.int64, bitcast=True), valid], dtype=tl.float32,
                                     is_pure=True, pack=4 if PACK4 else 1)


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
def _dequant_4bit_group_kernel(
    table_ptr, out_ptr, G: tl.constexpr, BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):
    """`_dequant_4bit_kernel` for G weights in one launch, written one under another into `out`. Row g of the
    int64 table [G, 9]: the addresses of its data, absmax, code, absmax2, code2 and offset, its first program,
    its first output element, its element count (even: no byte straddles two weights). ALIGNED: every data
    address and first output element is a multiple of 16 (wide loads and stores)."""
    pid = tl.program_id(0)
    g = 0
    for i in tl.static_range(1, G):
        g += (pid >= tl.load(table_ptr + i * 9 + 6)).to(tl.int32)
    row = table_ptr + g * 9
    data_ptr = tl.load(row).to(tl.pointer_type(tl.uint8))
    if NESTED:
        absmax_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
    else:
        absmax_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    code_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    absmax2_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    code2_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    offset_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    local = (pid - tl.load(row + 6)).to(tl.int64)
    out_start = tl.load(row + 7)
    numel = tl.load(row + 8)
    if ALIGNED:
        data_ptr = tl.multiple_of(data_ptr, 16)
        out_start = tl.multiple_of(out_start, 16)
    byte = local * BLOCK + tl.arange(0, BLOCK)
    mask = byte < numel // 2
    packed = tl.load(data_ptr + byte, mask=mask, other=0).to(tl.int32)
    scale = _block_scale((byte * 2) >> BLOCKSIZE_LOG2, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                         BLOCKSIZE2_LOG2, NESTED)
    hi = tl.load(code_ptr + (packed >> 4)) * scale
    lo = tl.load(code_ptr + (packed & 15)) * scale
    vals = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))
    elem = local * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_start + elem, vals.to(out_ptr.dtype.element_ty), mask=elem < numel)


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


@triton.jit
def _gemv_tile(N, KU, split, BLOCK_N: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr):
    """What a GEMV program covers, K counted in units (bytes, or 4-byte words): its BLOCK_N rows and their mask,
    each row's first unit, the [NB, SUB] unit offsets within a chunk, and its split's units [start, stop)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sub = tl.arange(0, NB)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    start = tl.program_id(1) * split
    return rn, rn < N, rn.to(tl.int64) * KU, sub, start, tl.minimum(start + split, KU)


@triton.jit
def _gemv_chunk(units_ptr, c0, stop, row_unit, nmask, sub, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                ELEMS: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr, BLOCKSIZE_LOG2: tl.constexpr,
                BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr, PTX: tl.constexpr = False, offset=0.0,
                EVEN: tl.constexpr = False):
    """The chunk at unit c0 of each row: its units [BLOCK_N, NB, SUB] as stored (zeros past `stop`) and the
    absmax [BLOCK_N, NB] of its sub-chunks of SUB units (ELEMS elements a unit), none straddling a block.
    EVEN: every row and unit of the tile exists, so the loads need no mask (and become 16-byte vectors: a mask
    against a runtime `stop` keeps Triton from proving four units alike). The packed weight is read once a call:
    its loads are marked evict-first, to keep x and the scales in cache (faster: docs/benchmarks/kernels.md)."""
    cu = c0 + sub
    first = c0 + tl.arange(0, NB) * SUB  # each sub-chunk's first unit
    if EVEN:
        units = tl.load(units_ptr + (row_unit[:, None, None] + cu[None, :, :]), eviction_policy="evict_first")
        valid = tl.full((row_unit.shape[0], NB), 1, tl.int1)
    else:
        units = tl.load(units_ptr + (row_unit[:, None, None] + cu[None, :, :]),
                        mask=nmask[:, None, None] & (cu < stop)[None, :, :], other=0, eviction_policy="evict_first")
        valid = nmask[:, None] & (first < stop)[None, :]
    blk = ((row_unit[:, None] + first[None, :]) * ELEMS) >> BLOCKSIZE_LOG2
    if PTX:  # `offset`: *offset_ptr, loaded once by the caller
        scale = _block_scale_ptx(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset, BLOCKSIZE2_LOG2, NESTED)
    else:
        scale = _block_scale(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED)
    return units, scale


@triton.jit
def _lookup_table(code_ptr, units, LOOKUP: tl.constexpr):
    """What `_table_values` looks the 16 values up in. For LOOKUP_SHFL it is this thread's share of the table,
    table[lane % 16], for every element of `units` (the packed int32 units of the loop's step, so that it is made in
    the layout the shuffles run in: made before the loop, or by a tl.load, Triton 3.6 gave it another layout and
    moved it between threads; `layouts_agree` checks). The lane id and the load are one inline PTX block,
    which nothing makes Triton re-lay out, and which ptxas computes once a step for all of a thread's elements.
    Otherwise the table, made before the loop."""
    if LOOKUP == LOOKUP_SHFL:
        table_addr = (code_ptr + tl.zeros(units.shape, dtype=tl.int32)).to(tl.int64, bitcast=True)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 15; mul.wide.u32 a, l, 4; "
            "add.s64 a, a, $2; ld.global.nc.b32 $0, [a]; }",
            "=r,r,l", [units.to(tl.int32), table_addr], dtype=tl.int32, is_pure=True, pack=1)
    elif LOOKUP == LOOKUP_GATHER:
        return tl.load(code_ptr + tl.arange(0, 16))
    else:  # unused
        return tl.zeros((16,), dtype=tl.float32)


@triton.jit
def _step_table(code_ptr, units, table, LOOKUP: tl.constexpr):
    """The table for one loop step of a GEMV: the shuffle's per-lane table is remade from the step's packed
    units (so that it has their layout, see `_lookup_table`); the others use `table`, made before the loop."""
    if LOOKUP == LOOKUP_SHFL:
        return _lookup_table(code_ptr, units, LOOKUP)
    else:
        return table


@triton.jit
def _table_values(index, code_ptr, table, LOOKUP: tl.constexpr):
    """The table's values at the low 4 bits of `index` (int32; higher bits are ignored), as fp32.
    LOOKUP_SHFL: a warp shuffle from the lane that holds the value (lanes 16-31 repeat 0-15, and the shuffle
    reads only the index's low 5 bits, so no mask either): registers only, no shared memory, no barrier.
    LOOKUP_GATHER: tl.gather, which Triton lowers to a store of the table to shared memory, a barrier and one
    load a value. LOOKUP_LOAD: a global load a value from the L1-resident table."""
    if LOOKUP == LOOKUP_SHFL:
        bits = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                                         [table, index], dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)
    elif LOOKUP == LOOKUP_GATHER:
        return tl.reshape(tl.gather(table, tl.reshape(index & 15, (index.numel,)), 0), index.shape)
    else:
        return tl.load(code_ptr + (index & 15))


@triton.jit
def _gemv_4bit_rows_kernel(
    x_ptr, data_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
    N, KB, stride_xm, stride_om, stride_os, split_bytes,
    M: tl.constexpr, M_POW2: tl.constexpr, BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr, X_SPLIT: tl.constexpr,
    LOOKUP: tl.constexpr,
):
    """out[s, m, n] = sum over the bytes [s * split_bytes, (s + 1) * split_bytes) of row n (KB bytes a row, K even)
    of x[m, k] W[n, k], for BLOCK_N rows and all M rows of x. A tile is [BLOCK_N, NB, SUB] packed bytes, SUB
    contiguous bytes per sub-chunk (a wide vector load per thread); a sub-chunk never straddles a quantization
    block (SUB divides blocksize / 2 and KB), so its scale is applied once, to its partial dot product. Both
    nibbles are decoded (high: element 2i, low: 2i + 1) and multiplied by the even and odd elements of x.
    LOOKUP: how the 16 values are looked up (`_table_values`)."""
    rn, nmask, row_byte, sub, start, stop = _gemv_tile(N, KB, split_bytes, BLOCK_N, NB, SUB)
    jb = tl.arange(0, NB)
    rm = tl.arange(0, M_POW2)
    acc = tl.zeros((M_POW2, BLOCK_N, NB), dtype=tl.float32)
    table = _lookup_table(code_ptr, sub, LOOKUP)
    for c0 in range(start, stop, NB * SUB):
        packed, scale = _gemv_chunk(data_ptr, c0, stop, row_byte, nmask, sub, absmax_ptr, absmax2_ptr, code2_ptr,
                                    offset_ptr, 2, NB, SUB, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED)
        packed = packed.to(tl.int32)
        lut = _step_table(code_ptr, packed, table, LOOKUP)
        w_hi = _table_values(packed >> 4, code_ptr, lut, LOOKUP)
        w_lo = _table_values(packed, code_ptr, lut, LOOKUP)
        for m in tl.static_range(M):
            xrow = x_ptr + m * stride_xm
            if X_SPLIT:  # one contiguous (vectorized) load of 2 * SUB elements a sub-chunk, split in registers
                e = c0 * 2 + jb[:, None] * (2 * SUB) + tl.arange(0, 2 * SUB)[None, :]
                xv = tl.load(xrow + e, mask=e < stop * 2, other=0.0).to(tl.float32)
                x_even, x_odd = tl.split(tl.reshape(xv, (NB, SUB, 2)))
            else:
                e = (c0 + sub) * 2  # each byte's even element
                x_even = tl.load(xrow + e, mask=e < stop * 2, other=0.0).to(tl.float32)
                x_odd = tl.load(xrow + e + 1, mask=e < stop * 2, other=0.0).to(tl.float32)
            part = tl.sum(w_hi * x_even[None, :, :] + w_lo * x_odd[None, :, :], axis=2) * scale  # [BLOCK_N, NB]
            if M == 1:
                acc += part[None, :, :]
            else:
                acc = tl.where((rm == m)[:, None, None], acc + part[None, :, :], acc)
    total = tl.sum(acc, axis=2)  # [M_POW2, BLOCK_N]
    out = out_ptr + tl.program_id(1) * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & nmask[None, :])


@triton.jit
def _eight_terms(words, x0, x1, x2, x3, x4, x5, x6, x7, code_ptr, table, LOOKUP: tl.constexpr):
    """sum over j of table[element j of each word] * xj, the xj broadcast against `words` by the caller."""
    part = _table_values(words >> 4, code_ptr, table, LOOKUP) * x0
    part += _table_values(words, code_ptr, table, LOOKUP) * x1
    part += _table_values(words >> 12, code_ptr, table, LOOKUP) * x2
    part += _table_values(words >> 8, code_ptr, table, LOOKUP) * x3
    part += _table_values(words >> 20, code_ptr, table, LOOKUP) * x4
    part += _table_values(words >> 16, code_ptr, table, LOOKUP) * x5
    part += _table_values(words >> 28, code_ptr, table, LOOKUP) * x6
    part += _table_values(words >> 24, code_ptr, table, LOOKUP) * x7
    return part


@triton.jit
def _x_of_words(x_ptr, word, valid):
    """x[8w .. 8w + 7] as eight fp32 tensors for the words `word` (x bf16 and 16-byte aligned; zeros where not
    `valid`): one 16-byte load a word in inline PTX. A tl.load would get a layout of its own and be moved to the
    words' layout through shared memory behind two barriers a step; this takes the layout of its use."""
    addr = (x_ptr + word * 8).to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 a, b, c, d; setp.ne.b32 p, $9, 0; mov.b32 a, 0; mov.b32 b, 0; mov.b32 c, 0; "
        "mov.b32 d, 0; @p ld.global.nc.v4.b32 {a, b, c, d}, [$8]; shl.b32 $0, a, 16; and.b32 $1, a, 0xffff0000; "
        "shl.b32 $2, b, 16; and.b32 $3, b, 0xffff0000; shl.b32 $4, c, 16; and.b32 $5, c, 0xffff0000; "
        "shl.b32 $6, d, 16; and.b32 $7, d, 0xffff0000; }",
        "=r,=r,=r,=r,=r,=r,=r,=r,l,r", [addr, valid.to(tl.int32)], dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _eight_of_words(ptr, c0, stop, jb, mask, NB: tl.constexpr, SUBW: tl.constexpr, ROWS: tl.constexpr):
    """ptr[8w .. 8w + 7] as eight fp32 tensors for the words w = c0 + sub (zeros from `stop` on, and where not
    `mask`), by one tl.load of the chunk, split apart in registers: element j = 4a + 2b + c of a word, split off c,
    then b, then a. ROWS 0: ptr is a pointer, [NB, SUBW] tensors; else ptr is [ROWS, 1, 1] (rows of x)."""
    e = c0 * 8 + jb[:, None] * (8 * SUBW) + tl.arange(0, 8 * SUBW)[None, :]
    v = tl.load(ptr + e, mask=(e < stop * 8) & mask, other=0.0).to(tl.float32)
    if ROWS:
        v = tl.reshape(v, (ROWS, NB, SUBW, 2, 2, 2))
    else:
        v = tl.reshape(v, (NB, SUBW, 2, 2, 2))
    c0_, c1_ = tl.split(v)
    c0b0, c0b1 = tl.split(c0_)
    c1b0, c1b1 = tl.split(c1_)
    v0, v4 = tl.split(c0b0)
    v2, v6 = tl.split(c0b1)
    v1, v5 = tl.split(c1b0)
    v3, v7 = tl.split(c1b1)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _word_scales(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, offset, BLOCKSIZE_LOG2: tl.constexpr,
                 BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr):
    """The fp32 absmax of each word's block `blk` [BLOCK_N, W]. In inline PTX where the tile is whole (EVEN), a
    block holds 32+ elements and the tile gives each thread 4+ words, each thread's 4 consecutive words share a
    block, so one load (chain) serves four words: the 16-byte word loads give every thread 4 consecutive words,
    which `layouts_agree` checks in the compiled kernel."""
    if PTX:
        pack4: tl.constexpr = EVEN and BLOCKSIZE_LOG2 >= 5 and blk.numel >= 4 * tl.extra.cuda.num_threads()
        return _block_scale_ptx(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset, BLOCKSIZE2_LOG2, NESTED,
                                pack4)
    else:
        return _block_scale(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED)


@triton.jit
def _words_row_sums(x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                    row_word, nmask, start, stop,
                    BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr,
                    NB: tl.constexpr, SUBW: tl.constexpr, LOOKUP: tl.constexpr, PTX: tl.constexpr,
                    EVEN: tl.constexpr, M=1, stride_xm=0, BLOCK_M: tl.constexpr = 1):
    """x . W[n] in fp32 over the words [start, stop) of the rows whose first words are `row_word`: [BLOCK_N] for
    one row of x (BLOCK_M 1), else [BLOCK_M, BLOCK_N] for its M rows (stride_xm apart; 8-element aligned for
    PTX). The packed weight is read as 32-bit words: a word holds elements 8i..8i+7, element 8i+j in byte j // 2
    (little-endian), high nibble for even j. The bytes stay packed in registers and each of the eight nibbles is
    shifted out and looked up once for all rows of x, NB * SUBW words of each row a step."""
    if BLOCK_M == 1:
        total = _words_one_x_row(x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                 row_word, nmask, start, stop, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED, NB * SUBW,
                                 LOOKUP, PTX, EVEN)
    else:
        total = _words_x_rows(x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, row_word,
                              nmask, start, stop, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED, NB, SUBW, LOOKUP, PTX,
                              EVEN, M, stride_xm, BLOCK_M)
    return total


@triton.jit
def _words_one_x_row(x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, row_word, nmask,
                     start, stop, BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr,
                     W: tl.constexpr, LOOKUP: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr):
    """`_words_row_sums` for one row of x, on [BLOCK_N, W] tiles of words, each word scaled by its block's absmax.
    The tile is 2-D so that its only contiguous axis is the words': Triton then gives each thread groups of 4
    consecutive words (16-byte vectors) of each of its rows, and x is loaded once for them. (A 3-D [rows,
    sub-chunks, words] tile left Triton 3.6 a tie between rows and sub-chunks, which it broke by spreading rows
    over threads: 4x the x loads and conversions, 127 registers.)"""
    sub = tl.arange(0, W)
    acc = tl.zeros((row_word.shape[0], W), dtype=tl.float32)  # summed over words once, after the loop
    table = _lookup_table(code_ptr, sub, LOOKUP)
    offset = 0.0
    if PTX and NESTED:
        offset = tl.load(offset_ptr)
    for c0 in tl.range(start, stop, W, loop_unroll_factor=2):  # the fastest factor (docs/benchmarks/kernels.md)
        cu = c0 + sub
        woff = row_word[:, None] + cu[None, :]
        wvalid = nmask[:, None] & (cu < stop)[None, :]
        if EVEN:
            words = tl.load(words_ptr + woff, eviction_policy="evict_first")
        else:
            words = tl.load(words_ptr + woff, mask=wvalid, other=0, eviction_policy="evict_first")
        scale = _word_scales((woff * 8) >> BLOCKSIZE_LOG2, wvalid | EVEN, absmax_ptr, absmax2_ptr, code2_ptr,
                             offset_ptr, offset, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED, PTX, EVEN)
        lut = _step_table(code_ptr, words, table, LOOKUP)
        if PTX:  # [1, W] each, like the one-sub-chunk split below
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_words(x_ptr, cu[None, :], ((cu < stop) | EVEN)[None, :])
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _eight_of_words(x_ptr, c0, stop, tl.arange(0, 1), True, 1, W, 0)
        acc += _eight_terms(words, x0, x1, x2, x3, x4, x5, x6, x7, code_ptr, lut, LOOKUP) * scale
    return tl.sum(acc, axis=1)


@triton.jit
def _words_x_rows(x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, row_word, nmask,
                  start, stop, BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr,
                  NB: tl.constexpr, SUBW: tl.constexpr, LOOKUP: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr,
                  M, stride_xm, BLOCK_M: tl.constexpr):
    """`_words_row_sums` for M (2..BLOCK_M) rows of x, on tiles [BLOCK_N, NB, SUBW] of words, a sub-chunk of SUBW
    words inside one quantization block. Rows of x are a leading dimension of the words' own layout (the words are
    expanded to it before the lookups: expanding the looked-up values instead cost 8 layout conversions a step).
    Here each thread holds one word of a sub-chunk and Triton 3.6 and 3.9 agree; the 2-D tile of
    `_words_one_x_row` compiled to more instructions a step with rows of x (docs/benchmarks/kernels.md)."""
    sub = tl.arange(0, NB)[:, None] * SUBW + tl.arange(0, SUBW)[None, :]
    jb = tl.arange(0, NB)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, row_word.shape[0], NB, SUBW), dtype=tl.float32)
    table = _lookup_table(code_ptr, sub, LOOKUP)
    offset = 0.0
    if PTX and NESTED:
        offset = tl.load(offset_ptr)
    for c0 in tl.range(start, stop, NB * SUBW, loop_unroll_factor=2):  # the fastest factor (docs/benchmarks/kernels.md)
        words, scale = _gemv_chunk(words_ptr, c0, stop, row_word, nmask, sub, absmax_ptr, absmax2_ptr, code2_ptr,
                                   offset_ptr, 8, NB, SUBW, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED, PTX, offset, EVEN)
        valid = (c0 + sub < stop) | EVEN
        words = tl.expand_dims(words, 0)
        lut = _step_table(code_ptr, words, table, LOOKUP)
        row = (rm < M)[:, None, None]
        if PTX:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_words(
                x_ptr, (c0 + sub)[None, :, :] + rm[:, None, None] * (stride_xm // 8), valid[None, :, :] & row)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _eight_of_words(x_ptr + rm[:, None, None] * stride_xm, c0, stop, jb,
                                                             row, NB, SUBW, BLOCK_M)
        acc += _eight_terms(words, x0[:, None, :, :], x1[:, None, :, :], x2[:, None, :, :], x3[:, None, :, :],
                            x4[:, None, :, :], x5[:, None, :, :], x6[:, None, :, :], x7[:, None, :, :], code_ptr,
                            lut, LOOKUP) * scale[None, :, :, None]
    return tl.sum(tl.sum(acc, axis=3), axis=2)


@triton.jit
def _gemv_4bit_words_kernel(
    x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
    M, N, KW, stride_xm, stride_om, stride_os, split_words,
    BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr,
    BLOCK_N: tl.constexpr, NB: tl.constexpr, SUBW: tl.constexpr, LOOKUP: tl.constexpr,
    PTX: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """M rows of x (at most BLOCK_M) times W (KW words a row, K a multiple of 8) by `_words_row_sums`: fewer
    registers than `_gemv_4bit_rows_kernel` spends on bytes, so more programs and more loads in flight per SM,
    and each nibble looked up once for all rows of x."""
    rn, nmask, row_word, sub, start, stop = _gemv_tile(N, KW, split_words, BLOCK_N, NB, SUBW)
    total = _words_row_sums(x_ptr, words_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, row_word,
                            nmask, start, stop, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED, NB, SUBW,
                            LOOKUP, PTX, EVEN, M, stride_xm, BLOCK_M)
    out = out_ptr + tl.program_id(1) * stride_os
    if BLOCK_M == 1:
        tl.store(out + rn, total.to(out_ptr.dtype.element_ty), mask=nmask)
    else:
        rm = tl.arange(0, BLOCK_M)
        tl.store(out + rm[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & nmask[None, :])


@triton.jit
def _gemv_4bit_dot_kernel(
    x_ptr, data_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
    M, N, KB, stride_xm, stride_om, stride_os, split_bytes,
    BLOCKSIZE_LOG2: tl.constexpr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr, DOT_F32: tl.constexpr,
):
    """The same product on the tensor cores, for several rows of x: the [BLOCK_N, NB, SUB] byte tile is decoded
    as in `_gemv_4bit_rows_kernel`, scaled per sub-chunk, interleaved back into element order (high nibble
    first), rounded to x's dtype (as a dequantized weight would be) and multiplied with a [BLOCK_M, 2 * NB *
    SUB] tile of x (rows past M masked) by one tl.dot, fp32 accumulation. DOT_F32: fp32 operands, for the
    interpreter, whose 16-bit dot is not exact (on a GPU an fp32 dot of this shape spills: fp32 x takes the
    CUDA-core kernel there)."""
    rn, nmask, row_byte, sub, start, stop = _gemv_tile(N, KB, split_bytes, BLOCK_N, NB, SUB)
    rm = tl.arange(0, BLOCK_M)
    ek = tl.arange(0, 2 * NB * SUB)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c0 in range(start, stop, NB * SUB):
        packed, scale = _gemv_chunk(data_ptr, c0, stop, row_byte, nmask, sub, absmax_ptr, absmax2_ptr, code2_ptr,
                                    offset_ptr, 2, NB, SUB, BLOCKSIZE_LOG2, BLOCKSIZE2_LOG2, NESTED)
        packed, scale = packed.to(tl.int32), scale[:, :, None]
        w_hi = tl.load(code_ptr + (packed >> 4)) * scale
        w_lo = tl.load(code_ptr + (packed & 15)) * scale
        w = tl.reshape(tl.join(w_hi, w_lo), (BLOCK_N, 2 * NB * SUB))  # element order within the chunk
        e = c0 * 2 + ek
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + e[None, :], mask=(rm < M)[:, None] & (e < stop * 2)[None, :],
                     other=0.0)
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
    out = out_ptr + tl.program_id(1) * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & nmask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum_s part[s, i] in fp32, rounded once to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------- launchers


def _check_out(out: torch.Tensor, p: Packed4bit) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a tensor; got {type(out).__name__}")
    check_dtype("out", out)
    if tuple(out.shape) != p.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {p.shape}; got {tuple(out.shape)}")
    if out.device != p.data.device:
        raise ValueError(f"out must be on {p.data.device} like weight; got {out.device}")


DEQUANT_BLOCK = 1024  # bytes a program; also few programs for the interpreter, whose cost is per program


def _dequantize_into(u: _Unpacked, out: torch.Tensor) -> torch.Tensor:
    if not u.compiled and not use_triton(u.packed.data):
        return out.copy_(_reference(u.packed, out.dtype))
    _dequant_4bit_kernel[(cdiv(cdiv(u.numel, 2), DEQUANT_BLOCK),)](
        *u.args, out, u.numel, **u.consts, BLOCK=DEQUANT_BLOCK, num_warps=4)
    return out


def dequantize_4bit(weight, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [out, in] matrix of a bitsandbytes 4-bit weight, written into `out` when given (a reusable
    buffer; its dtype wins) or a new tensor of `dtype` (default: the dtype the weight was quantized from)."""
    u = _unpacked(weight)
    p = u.packed
    if out is None:
        dtype = p.dtype if dtype is None else dtype
        check_dtype("dtype", torch.empty(0, dtype=dtype))
        out = torch.empty(p.shape, dtype=dtype, device=p.data.device)
    else:
        _check_out(out, p)
    return _dequantize_into(u, out)


def dequantize_4bit_reference(weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch, the same maths: the path for tensors Triton cannot run, and the tests' second opinion."""
    return _reference(_unpack(weight), dtype)


def _reference(p: Packed4bit, dtype: torch.dtype | None) -> torch.Tensor:
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
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16; got {dtype}")
    u = _unpacked(weight)
    return _dequantize_into(u, _scratch_view(u.packed.shape, dtype, u.packed.data.device))


class _Group(NamedTuple):
    entries: tuple  # the weights' _Unpacked, in order (identity: the table is still theirs)
    table: torch.Tensor | None  # int64 [G, 9] on the device (None: the weights are dequantized one by one)
    programs: int
    consts: dict  # the kernel's constexprs
    shape: tuple  # (sum of out, in)


_GROUPS: dict[tuple, _Group] = state.register_cache("quant.groups", {})
GROUP_MAX = 8


def _group(weights) -> _Group:
    entries = tuple(_unpacked(w) for w in weights)
    key = tuple(id(w) for w in weights)
    hit = _GROUPS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit.entries, entries)):
        return hit
    ps = [e.packed for e in entries]
    first = ps[0]
    if any(p.shape[1] != first.shape[1] for p in ps) or any(p.data.device != first.data.device for p in ps):
        raise ValueError("weights must share their input width and device to be stacked; got "
                         f"{[p.shape for p in ps]} on {sorted({str(p.data.device) for p in ps})}")
    shape = (sum(p.shape[0] for p in ps), first.shape[1])
    table, programs = None, 0
    same = all(e.consts == entries[0].consts and e.packed.absmax.dtype == first.absmax.dtype for e in entries)
    if len(ps) <= GROUP_MAX and same and all(e.numel % 2 == 0 for e in entries):
        rows, out_start = [], 0
        for e in entries:
            rows.append([t.data_ptr() for t in e.args] + [programs, out_start, e.numel])
            programs += cdiv(e.numel // 2, DEQUANT_BLOCK)
            out_start += e.numel
        table = torch.tensor(rows, dtype=torch.int64).to(first.data.device)
        aligned = all(r[0] % 16 == 0 and r[7] % 16 == 0 for r in rows)
        consts = dict(entries[0].consts, G=len(entries), ALIGNED=aligned)
    else:
        consts = {}
    group = _GROUPS[key] = _Group(entries, table, programs, consts, shape)
    for w in weights:  # a dead weight drops the groups it was in
        weakref.finalize(w, _GROUPS.pop, key, None)
    return group


def dequantize_4bit_stacked(weights, dtype: torch.dtype) -> torch.Tensor:
    """The dense weights of 4-bit `weights` (one input width: q/k/v, gate/up) one under another, [sum of out,
    in], in the buffer that dequantized weights share (`dequantize_4bit_scratch`'s: use it at once): one
    launch for the whole group where the weights share their quantization settings (one per weight
    otherwise), so a stacked base's single GEMM can read it. Row block i equals dequantize_4bit(weights[i])."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16; got {dtype}")
    weights = list(weights)
    if not weights:
        raise ValueError("weights must hold at least one 4-bit weight")
    g = _group(weights)
    device = g.entries[0].packed.data.device
    out = _scratch_view(g.shape, dtype, device)
    compiled = all(e.compiled for e in g.entries) or use_triton(g.entries[0].packed.data)
    if g.table is None or not compiled:
        row = 0
        for e in g.entries:  # one launch (or the torch reference) a weight, into its row block
            n = e.packed.shape[0]
            _dequantize_into(e, out[row:row + n])
            row += n
        return out
    _dequant_4bit_group_kernel[(g.programs,)](g.table, out, **g.consts, BLOCK=DEQUANT_BLOCK, num_warps=4)
    return out


# (shape, dtype, device) -> the [shape] view of the shared buffer last handed out: a layer's weight takes the
# same view at every step; a new view only when the buffer was replaced (grown) since.
_VIEWS: dict[tuple, torch.Tensor] = state.register_cache("quant.scratch_views", {})


def _scratch_view(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (shape, dtype, device)
    view = _VIEWS.get(key)
    if view is None or view._base is not _utils._SCRATCH.get((device, dtype)):
        view = scratch(shape, dtype, device)
        for stale in [k for k, v in _VIEWS.items() if k[1:] == key[1:] and v._base is not view._base]:
            del _VIEWS[stale]  # views of a buffer that was replaced: let it go
        _VIEWS[key] = view
    return view


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
        raise ValueError(f"words=True takes at most {GEMV_MAX_ROWS} rows of x, K a multiple of 8 and blocksize >= 8 "
                         "(CUDA-core kernel)")
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
        raise ValueError(f"lookup must be one of {sorted(LOOKUPS)} ('shfl' is inline PTX: compiled CUDA only); "
                         f"got {lookup!r} on {device.type}")
    cfg = GemvConfig(block_n, nb, sub, split, override.pop("num_warps", warps), override.pop("x_split", True), dot,
                     lookup, words)
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
            x2, *u.args, part, M, N, kb, x2.stride(0), N, M * N, split_bytes, **u.consts,
            BLOCK_M=16, BLOCK_N=cfg.block_n, NB=cfg.nb, SUB=cfg.sub,
            DOT_F32=not x2.is_cuda, num_warps=cfg.num_warps,
        )
    else:
        if cfg.words:
            kernel, fallback = _gemv_4bit_words_kernel, dict(LOOKUP=LOOKUPS["gather"], PTX=False)
            args = (x2, u.words, *u.args[1:], part, M, N, kb, x2.stride(0), N, M * N, split_bytes)
            aligned = x2.data_ptr() % 16 == 0 and (M == 1 or x2.stride(0) % 8 == 0)
            consts = dict(BLOCK_N=cfg.block_n, NB=cfg.nb, SUBW=cfg.sub,
                          PTX=cfg.lookup == "shfl" and x2.dtype == torch.bfloat16 and aligned,
                          EVEN=N % cfg.block_n == 0 and kb % chunk == 0, BLOCK_M=next_power_of_2(M))
        else:
            kernel, fallback = _gemv_4bit_rows_kernel, dict(LOOKUP=LOOKUPS["gather"])
            args = (x2, *u.args, part, N, kb, x2.stride(0), N, M * N, split_bytes)
            consts = dict(M=M, M_POW2=next_power_of_2(M), BLOCK_N=cfg.block_n, NB=cfg.nb, SUB=cfg.sub,
                          X_SPLIT=cfg.x_split)
        launch_checked(kernel, (cdiv(N, cfg.block_n), split), args,
                       dict(**u.consts, **consts, LOOKUP=LOOKUPS[cfg.lookup], num_warps=cfg.num_warps), fallback)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(M * N, block),)](part, out, M * N, SPLIT=split, BLOCK=block, num_warps=4)
    return out


_LAYOUTS_CHECKED: dict[str, bool] = state.register_cache("quant.layouts_checked", {})
_LAUNCH_CHECKED: dict[tuple, bool] = state.register_cache("quant.launch_checked", {})


def launch_checked(kernel, grid, args, consts: dict, fallback: dict) -> None:
    """kernel[grid](*args, **consts); a shuffle-lookup kernel (LOOKUP_SHFL) is first compiled by `kernel.warmup`
    and checked by `layouts_agree`, once per kernel, constexprs and argument dtypes, and launched with
    `fallback` merged into its constexprs (tl.gather lookups) where it fails: checked before the launch, since a
    kernel that adds into its output in place (the decode step's residual) cannot be launched again."""
    if consts.get("LOOKUP") == LOOKUP_SHFL:
        key = (kernel, tuple(sorted(consts.items())), *(a.dtype for a in args if torch.is_tensor(a)))
        if key not in _LAUNCH_CHECKED:
            _LAUNCH_CHECKED[key] = layouts_agree(kernel.warmup(*args, grid=grid, **consts))
        if not _LAUNCH_CHECKED[key]:
            consts = {**consts, **fallback}
    kernel[grid](*args, **consts)


def layouts_agree(compiled) -> bool:
    """Whether a compiled GEMV's inline PTX runs in the layouts it was written for, checked once a kernel in its
    IR (a kernel that fails warns and runs with tl.gather lookups, without inline PTX):
    - the lane ids are read in the layout its table shuffles run in. The shuffle reads the lane that holds
      table[index % 16]; were the per-lane table moved between threads by a layout conversion that Triton is free
      to insert, it would read another value (Triton 3.6 did so for a table made before the loop, so it is made
      from each step's packed units, in their layout);
    - each 4-element pack of inline PTX (one scale load for 4 consecutive words) takes 4 consecutive elements of
      the fastest axis: a blocked layout with a multiple of 4 elements a thread along it."""
    key = compiled.hash
    if key not in _LAYOUTS_CHECKED:
        ir = compiled.asm["ttgir"]
        blocked = {name: (list(map(int, per.split(","))), int(order.split(",")[0])) for name, per, order in re.findall(
            r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\].*order = \[([\d, ]+)\]", ir, re.M)}
        lane, shuffle, packs_ok = set(), set(), True
        for line in ir.splitlines():
            if "elementwise_inline_asm" in line:
                layouts = set(re.findall(r"tensor<[^,>]*, (#[\w.]+(?:<[^>]*>)?)", line.split(" : ", 1)[-1]))
                (lane if "%laneid" in line else shuffle if "shfl.sync" in line else set()).update(layouts)
                if "packed_element = 4" in line:
                    packs_ok &= all(name in blocked and blocked[name][0][blocked[name][1]] % 4 == 0
                                    for name in layouts)
        ok = (len(lane) == 1 and lane == shuffle or not lane | shuffle) and packs_ok
        if not ok:
            warnings.warn("fastplug: this Triton build laid out the 4-bit GEMV's inline PTX in another way than it "
                          "was written for; the GEMV runs with tl.gather lookups instead (correct, slower)",
                          stacklevel=4)
        _LAYOUTS_CHECKED[key] = ok
    return _LAYOUTS_CHECKED[key]


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
        x2, *u.args, out, M, N, K, x2.stride(0), out.stride(0), **u.consts, ROW_SCALE=row_scale, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
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
        cfg = _default_config(M, N, K, p.blocksize, x2.device)
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


def require_bitsandbytes():
    """bitsandbytes, imported now (never at fastplug's import); ImportError saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(f"4-bit (QLoRA) loading needs bitsandbytes: {INSTALL_HINT}") from error
    return bitsandbytes
