"""The 4-bit GEMV's word-wise loop as `@triton.jit` functions (x [M, K] @ W^T straight from the packed bytes,
never dequantized to memory): `words_row_sums` reads the packed weight as 32-bit words and looks each nibble up
once for all rows of x. The one GEMV kernel that runs it is the decode GEMV's (`kernels.decode.gemv_kernels`);
`gemv.gemv_4bit` launches it for a lone 4-bit weight. The inline PTX it may run (LOOKUP_SHFL) lives in
`fastplug.kernels.ptx`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ptx import bf16x8_load, lane_table, table_lookup
from ..ptx import block_scale as block_scale_ptx
from .dequant import block_scale

# How the CUDA-core GEMVs look their 16 table values up: global loads (L1), tl.gather (shared memory, two
# barriers a call) or a warp shuffle (registers; inline PTX, so compiled CUDA only; the word-wise kernel then also
# loads x and the block scales by inline PTX). See `_table_values`.
LOOKUP_LOAD, LOOKUP_GATHER, LOOKUP_SHFL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
LOOKUPS = {"load": LOOKUP_LOAD, "gather": LOOKUP_GATHER, "shfl": LOOKUP_SHFL}


@triton.jit
def _gemv_chunk(
    units_ptr,
    c0,
    stop,
    row_unit,
    nmask,
    sub,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    ELEMS: tl.constexpr,
    NB: tl.constexpr,
    SUB: tl.constexpr,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    PTX: tl.constexpr = False,
    offset=0.0,
    EVEN: tl.constexpr = False,
):
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
        units = tl.load(
            units_ptr + (row_unit[:, None, None] + cu[None, :, :]),
            mask=nmask[:, None, None] & (cu < stop)[None, :, :],
            other=0,
            eviction_policy="evict_first",
        )
        valid = nmask[:, None] & (first < stop)[None, :]
    blk = ((row_unit[:, None] + first[None, :]) * ELEMS) >> BLOCKSIZE_LOG2
    if PTX:  # `offset`: *offset_ptr, loaded once by the caller
        scale = block_scale_ptx(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset, BLOCKSIZE2_LOG2, NESTED)
    else:
        scale = block_scale(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED)
    return units, scale


@triton.jit
def _lookup_table(code_ptr, units, LOOKUP: tl.constexpr):
    """What `_table_values` looks the 16 values up in. For LOOKUP_SHFL it is this thread's share of the table,
    table[lane % 16], for every element of `units` (the packed int32 units of the loop's step, so that it is made in
    the layout the shuffles run in: made before the loop, or by a tl.load, Triton 3.6 gave it another layout and
    moved it between threads; `layouts_agree` checks). The lane id and the load are one inline PTX block
    (`ptx.lane_table`).
    Otherwise the table, made before the loop."""
    if LOOKUP == LOOKUP_SHFL:
        return lane_table(code_ptr, units)
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
        return table_lookup(table, index)
    elif LOOKUP == LOOKUP_GATHER:
        return tl.reshape(tl.gather(table, tl.reshape(index & 15, (index.numel,)), 0), index.shape)
    else:
        return tl.load(code_ptr + (index & 15))


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
    return bf16x8_load(x_ptr, word, valid)


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
def _word_scales(
    blk,
    valid,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    offset,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The fp32 absmax of each word's block `blk` [BLOCK_N, W]. In inline PTX where the tile is whole (EVEN), a
    block holds 32+ elements and the tile gives each thread 4+ words, each thread's 4 consecutive words share a
    block, so one load (chain) serves four words: the 16-byte word loads give every thread 4 consecutive words,
    which `layouts_agree` checks in the compiled kernel."""
    if PTX:
        pack4: tl.constexpr = EVEN and BLOCKSIZE_LOG2 >= 5 and blk.numel >= 4 * tl.extra.cuda.num_threads()
        return block_scale_ptx(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset, BLOCKSIZE2_LOG2, NESTED, pack4)
    else:
        return block_scale(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, BLOCKSIZE2_LOG2, NESTED)


@triton.jit
def words_row_sums(
    x_ptr,
    words_ptr,
    absmax_ptr,
    code_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    row_word,
    nmask,
    start,
    stop,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    NB: tl.constexpr,
    SUBW: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
    M=1,
    stride_xm=0,
    BLOCK_M: tl.constexpr = 1,
):
    """x . W[n] in fp32 over the words [start, stop) of the rows whose first words are `row_word`: [BLOCK_N] for
    one row of x (BLOCK_M 1), else [BLOCK_M, BLOCK_N] for its M rows (stride_xm apart; 8-element aligned for
    PTX). The packed weight is read as 32-bit words: a word holds elements 8i..8i+7, element 8i+j in byte j // 2
    (little-endian), high nibble for even j. The bytes stay packed in registers and each of the eight nibbles is
    shifted out and looked up once for all rows of x, NB * SUBW words of each row a step."""
    if BLOCK_M == 1:
        total = _words_one_x_row(
            x_ptr,
            words_ptr,
            absmax_ptr,
            code_ptr,
            absmax2_ptr,
            code2_ptr,
            offset_ptr,
            row_word,
            nmask,
            start,
            stop,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            NB * SUBW,
            LOOKUP,
            PTX,
            EVEN,
        )
    else:
        total = _words_x_rows(
            x_ptr,
            words_ptr,
            absmax_ptr,
            code_ptr,
            absmax2_ptr,
            code2_ptr,
            offset_ptr,
            row_word,
            nmask,
            start,
            stop,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            NB,
            SUBW,
            LOOKUP,
            PTX,
            EVEN,
            M,
            stride_xm,
            BLOCK_M,
        )
    return total


@triton.jit
def _words_one_x_row(
    x_ptr,
    words_ptr,
    absmax_ptr,
    code_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    row_word,
    nmask,
    start,
    stop,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    W: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
):
    """`words_row_sums` for one row of x, on [BLOCK_N, W] tiles of words, each word scaled by its block's absmax.
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
        scale = _word_scales(
            (woff * 8) >> BLOCKSIZE_LOG2,
            wvalid | EVEN,
            absmax_ptr,
            absmax2_ptr,
            code2_ptr,
            offset_ptr,
            offset,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            PTX,
            EVEN,
        )
        lut = _step_table(code_ptr, words, table, LOOKUP)
        if PTX:  # [1, W] each, like the one-sub-chunk split below
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_words(x_ptr, cu[None, :], ((cu < stop) | EVEN)[None, :])
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _eight_of_words(x_ptr, c0, stop, tl.arange(0, 1), True, 1, W, 0)
        acc += _eight_terms(words, x0, x1, x2, x3, x4, x5, x6, x7, code_ptr, lut, LOOKUP) * scale
    return tl.sum(acc, axis=1)


@triton.jit
def _words_x_rows(
    x_ptr,
    words_ptr,
    absmax_ptr,
    code_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    row_word,
    nmask,
    start,
    stop,
    BLOCKSIZE_LOG2: tl.constexpr,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    NB: tl.constexpr,
    SUBW: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
    EVEN: tl.constexpr,
    M,
    stride_xm,
    BLOCK_M: tl.constexpr,
):
    """`words_row_sums` for M (2..BLOCK_M) rows of x, on tiles [BLOCK_N, NB, SUBW] of words, a sub-chunk of SUBW
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
        words, scale = _gemv_chunk(
            words_ptr,
            c0,
            stop,
            row_word,
            nmask,
            sub,
            absmax_ptr,
            absmax2_ptr,
            code2_ptr,
            offset_ptr,
            8,
            NB,
            SUBW,
            BLOCKSIZE_LOG2,
            BLOCKSIZE2_LOG2,
            NESTED,
            PTX,
            offset,
            EVEN,
        )
        valid = (c0 + sub < stop) | EVEN
        words = tl.expand_dims(words, 0)
        lut = _step_table(code_ptr, words, table, LOOKUP)
        row = (rm < M)[:, None, None]
        if PTX:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_of_words(
                x_ptr, (c0 + sub)[None, :, :] + rm[:, None, None] * (stride_xm // 8), valid[None, :, :] & row
            )
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _eight_of_words(
                x_ptr + rm[:, None, None] * stride_xm, c0, stop, jb, row, NB, SUBW, BLOCK_M
            )
        acc += (
            _eight_terms(
                words,
                x0[:, None, :, :],
                x1[:, None, :, :],
                x2[:, None, :, :],
                x3[:, None, :, :],
                x4[:, None, :, :],
                x5[:, None, :, :],
                x6[:, None, :, :],
                x7[:, None, :, :],
                code_ptr,
                lut,
                LOOKUP,
            )
            * scale[None, :, :, None]
        )
    return tl.sum(tl.sum(acc, axis=3), axis=2)
