"""Dequantization of bitsandbytes 4-bit weights in Triton: one weight (`dequantize_4bit`, or
`dequantize_4bit_scratch` into the buffer dequantized weights share), or a group of weights that read one input,
one under another, in one launch (`dequantize_4bit_stacked`) for QLoRA training. Values are formed in fp32 and
rounded once to the output dtype, as bitsandbytes does, so the result equals
`bitsandbytes.functional.dequantize_4bit`. `block_scale` (a block's fp32 absmax) is shared with the GEMVs.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _utils, state
from .._utils import cdiv, check_dtype, scratch, use_triton
from .formats import Packed4bit, _unpack, _Unpacked, _unpacked


@triton.jit
def block_scale(
    blk, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2: tl.constexpr, NESTED: tl.constexpr
):
    """fp32 absmax of the blocks `blk` (decoded from 8 bits when double-quantized)."""
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale2 = tl.load(absmax2_ptr + (blk >> BLOCKSIZE2_LOG2), mask=mask, other=0.0)
        return tl.load(code2_ptr + q, mask=mask, other=0.0) * scale2 + tl.load(offset_ptr)
    return tl.load(absmax_ptr + blk, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dequant_4bit_kernel(
    data_ptr,
    absmax_ptr,
    code_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    out_ptr,
    numel,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each program turns BLOCK bytes into 2*BLOCK contiguous outputs."""
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BLOCK + tl.arange(0, BLOCK)
    nbytes = (numel + 1) // 2
    mask = byte < nbytes
    packed = tl.load(data_ptr + byte, mask=mask, other=0).to(tl.int32)
    # blocksize >= 2 is even: both elements of a byte share their block
    scale = block_scale(
        (byte * 2) >> BLOCKSIZE_LOG2, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED
    )
    hi = tl.load(code_ptr + (packed >> 4)) * scale
    lo = tl.load(code_ptr + (packed & 15)) * scale
    vals = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))  # element 2i from the high nibble, 2i+1 from the low
    elem = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + elem, vals.to(out_ptr.dtype.element_ty), mask=elem < numel)


@triton.jit
def _dequant_4bit_group_kernel(
    table_ptr,
    out_ptr,
    G: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
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
    scale = block_scale(
        (byte * 2) >> BLOCKSIZE_LOG2, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED
    )
    hi = tl.load(code_ptr + (packed >> 4)) * scale
    lo = tl.load(code_ptr + (packed & 15)) * scale
    vals = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))
    elem = local * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_start + elem, vals.to(out_ptr.dtype.element_ty), mask=elem < numel)


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
        *u.args, out, u.numel, **u.consts, BLOCK=DEQUANT_BLOCK, num_warps=4
    )
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
    """Plain torch, the same maths: the path for tensors Triton cannot run, and the tests' second opinion. With
    dtype=float64 every product is formed in float64 (the self-check's reference for 4-bit layers on the CPU)."""
    return _reference(_unpack(weight), dtype)


def _reference(p: Packed4bit, dtype: torch.dtype | None) -> torch.Tensor:
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    numel = p.shape[0] * p.shape[1]
    bytes_ = p.data[: cdiv(numel, 2)].long()
    idx = torch.stack((bytes_ >> 4, bytes_ & 15), dim=1).reshape(-1)[:numel]
    blk = torch.arange(numel, device=idx.device) // p.blocksize
    absmax = p.absmax
    if p.nested is not None:
        absmax2, code2, blocksize2, offset = p.nested
        blocks = torch.arange(absmax.numel(), device=idx.device) // blocksize2
        absmax = code2.to(wide)[absmax.long()] * absmax2.to(wide)[blocks] + offset.to(wide)
    values = p.code.to(wide)[idx] * absmax.to(wide)[blk]
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
        raise ValueError(
            "weights must share their input width and device to be stacked; got "
            f"{[p.shape for p in ps]} on {sorted({str(p.data.device) for p in ps})}"
        )
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
            _dequantize_into(e, out[row : row + n])
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
