"""Every inline PTX of fastplug's kernels, with the `@triton.jit` functions that run it, and the check that a
compiled kernel lays them out as they were written for (`layouts_agree`).

The 4-bit GEMVs (`quant.gemv_kernels`, the decode GEMV) use inline PTX for three things Triton does not do by
itself: a table lookup in registers (warp shuffle), and loads that take the layout of their use (a tl.load gets
a layout of its own, and Triton moves its result to the consumer's layout through shared memory behind two
barriers a loop step). They run compiled on CUDA only; under the interpreter the kernels take the tl.gather or
tl.load paths (`gemv_config` never picks "shfl" there). Each variant:

1. `block_scale(...)` (SCALE_NESTED / SCALE_FLAT, one element an instance; SCALE_NESTED4 / SCALE_FLAT4, four):
   the fp32 absmax of quantization block `blk` of a bitsandbytes 4-bit weight, 0 where not `valid`.
   Flat: `absmax[blk]` (fp32). Nested (double quantization): `code2[absmax[blk]] * absmax2[blk >> log2 b2] +
   offset` (absmax uint8, code2 fp32 [256], absmax2 fp32), one fused multiply-add, as `quant.block_scale`.
   Layout: any for one element an instance (elementwise). Four an instance (`pack=4`): the load runs once, for
   the first of each 4 consecutive elements of a thread, and its value goes to all four, so those four must
   share a block. It assumes a blocked layout with a multiple of 4 elements a thread along the fastest axis
   (16-byte word loads give that); `layouts_agree` checks every `packed_element = 4` inline asm of the IR has
   such a layout. Reference: `quant.dequantize_4bit_reference`'s absmax.
2. `lane_table(code_ptr, units)` (LANE_TABLE): each element gets `code[lane % 16]` (fp32 bits as int32), this
   lane's share of the 16-entry table for `table_lookup`. Layout: it must be the layout the shuffles run in
   (a lane id read in one layout and used in another names another thread's value), so it is made from each
   loop step's packed units, in their layout; `layouts_agree` checks that the `%laneid` asm and the
   `shfl.sync` asm of the IR have one and the same layout.
3. `table_lookup(table, index)` (TABLE_SHUFFLE): `code[index & 15]` as fp32: `shfl.sync.idx` reads `table`
   from lane `index & 31`; lanes 16-31 hold what 0-15 hold, so the low 4 bits decide. Layout: as 2.
   Reference: `code[index & 15]`.
4. `bf16x8_load(x_ptr, word, valid)` (BF16X8_LOAD): x[8 word .. 8 word + 7] of a bf16 vector as eight fp32
   tensors (zeros where not `valid`), one 16-byte `ld.global.nc.v4` a word; x must be 16-byte aligned at
   8 word. Layout: any (elementwise). Reference: `x.view(-1, 8)[word].float()`.

tests/gpu/test_ptx_gpu.py launches each variant on CUDA against its reference. The PTX text must stay exactly
as measured (docs/benchmarks/kernels.md, "4-bit GEMV"); a change is a performance change.
"""

from __future__ import annotations

import re
import warnings

import triton
import triton.language as tl

from . import state


def scale_ptx(nested: bool, pack: int) -> tuple[tl.constexpr, tl.constexpr]:
    """The inline PTX (and its constraints) of `block_scale` for `pack` elements an instance: one load (chain)
    for the pack's first element, its value written to all `pack` outputs. Operands: the outputs $0.., then each
    input's `pack` elements (absmax, code2 and absmax2 addresses, valid, offset; or absmax address, valid)."""
    arg = [f"${pack * (i + 1)}" for i in range(5 if nested else 2)]
    if nested:
        absmax, code2, absmax2, valid, offset = arg
        load = (
            f"@p ld.global.nc.u8 q, [{absmax}]; @p mul.wide.u32 a, q, 4; @p add.s64 a, a, {code2}; "
            f"@p ld.global.nc.f32 c, [a]; @p ld.global.nc.f32 s, [{absmax2}]; @p fma.rn.f32 r, c, s, {offset};"
        )
        regs, inputs = ".reg .b32 q; .reg .b64 a; .reg .f32 c, s, r;", "l" * 3 + "r" + "f"
    else:
        absmax, valid = arg
        load, regs, inputs = f"@p ld.global.nc.f32 r, [{absmax}];", ".reg .f32 r;", "lr"
    copies = " ".join(f"mov.b32 ${i}, r;" for i in range(pack))
    asm = f"{{ .reg .pred p; {regs} setp.ne.b32 p, {valid}, 0; mov.b32 r, 0; {load} {copies} }}"
    return tl.constexpr(asm), tl.constexpr(",".join(["=f"] * pack + [c for c in inputs for _ in range(pack)]))


SCALE_NESTED, SCALE_NESTED_CONSTRAINTS = scale_ptx(True, 1)
SCALE_FLAT, SCALE_FLAT_CONSTRAINTS = scale_ptx(False, 1)
SCALE_NESTED4, SCALE_NESTED4_CONSTRAINTS = scale_ptx(True, 4)
SCALE_FLAT4, SCALE_FLAT4_CONSTRAINTS = scale_ptx(False, 4)

LANE_TABLE = tl.constexpr(
    "{ .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 15; mul.wide.u32 a, l, 4; "
    "add.s64 a, a, $2; ld.global.nc.b32 $0, [a]; }"
)
LANE_TABLE_CONSTRAINTS = tl.constexpr("=r,r,l")

TABLE_SHUFFLE = tl.constexpr("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;")
TABLE_SHUFFLE_CONSTRAINTS = tl.constexpr("=r,r,r")

BF16X8_LOAD = tl.constexpr(
    "{ .reg .pred p; .reg .b32 a, b, c, d; setp.ne.b32 p, $9, 0; mov.b32 a, 0; mov.b32 b, 0; mov.b32 c, 0; "
    "mov.b32 d, 0; @p ld.global.nc.v4.b32 {a, b, c, d}, [$8]; shl.b32 $0, a, 16; and.b32 $1, a, 0xffff0000; "
    "shl.b32 $2, b, 16; and.b32 $3, b, 0xffff0000; shl.b32 $4, c, 16; and.b32 $5, c, 0xffff0000; "
    "shl.b32 $6, d, 16; and.b32 $7, d, 0xffff0000; }"
)
BF16X8_LOAD_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,l,r")


@triton.jit
def block_scale(
    blk,
    valid,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    PACK4: tl.constexpr = False,
):
    """Variant 1: `quant.block_scale` with its loads in inline PTX (0 where not `valid`), so that it takes the
    layout of its use instead of one of its own and a trip through shared memory; `offset` is the nested offset,
    loaded once. PACK4: one load for each 4 consecutive elements of a thread, which must share a block."""
    valid = valid.to(tl.int32)
    if NESTED:
        args = [
            (absmax_ptr + blk).to(tl.int64, bitcast=True),
            (code2_ptr + 0 * blk).to(tl.int64, bitcast=True),
            (absmax2_ptr + (blk >> BLOCKSIZE2_LOG2)).to(tl.int64, bitcast=True),
            valid,
            tl.zeros(blk.shape, dtype=tl.float32) + offset,
        ]
        return tl.inline_asm_elementwise(
            SCALE_NESTED4 if PACK4 else SCALE_NESTED,
            SCALE_NESTED4_CONSTRAINTS if PACK4 else SCALE_NESTED_CONSTRAINTS,
            args,
            dtype=tl.float32,
            is_pure=True,
            pack=4 if PACK4 else 1,
        )
    return tl.inline_asm_elementwise(
        SCALE_FLAT4 if PACK4 else SCALE_FLAT,
        SCALE_FLAT4_CONSTRAINTS if PACK4 else SCALE_FLAT_CONSTRAINTS,
        [(absmax_ptr + blk).to(tl.int64, bitcast=True), valid],
        dtype=tl.float32,
        is_pure=True,
        pack=4 if PACK4 else 1,
    )


@triton.jit
def lane_table(code_ptr, units):
    """Variant 2: this lane's share of the 16-entry table, code[lane % 16] (int32 bits), for every element of
    `units` (int32), in their layout. The lane id and the load are one inline PTX block, which nothing makes
    Triton re-lay out, and which ptxas computes once a step for all of a thread's elements."""
    table_addr = (code_ptr + tl.zeros(units.shape, dtype=tl.int32)).to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise(
        LANE_TABLE, LANE_TABLE_CONSTRAINTS, [units.to(tl.int32), table_addr], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def table_lookup(table, index):
    """Variant 3: code[index & 15] as fp32, by a warp shuffle from the lane that holds it (`table` from
    `lane_table`, in `index`'s layout): registers only, no shared memory, no barrier."""
    bits = tl.inline_asm_elementwise(
        TABLE_SHUFFLE, TABLE_SHUFFLE_CONSTRAINTS, [table, index], dtype=tl.int32, is_pure=True, pack=1
    )
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16x8_load(x_ptr, word, valid):
    """Variant 4: x[8 word .. 8 word + 7] as eight fp32 tensors (x bf16, 16-byte aligned; zeros where not
    `valid`), one 16-byte load a word, in the layout of `word`."""
    addr = (x_ptr + word * 8).to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise(
        BF16X8_LOAD, BF16X8_LOAD_CONSTRAINTS, [addr, valid.to(tl.int32)], dtype=(tl.float32,) * 8, is_pure=True, pack=1
    )


_LAYOUTS_CHECKED: dict[str, bool] = state.register_cache("ptx.layouts_checked", {})


def layouts_agree(compiled) -> bool:
    """Whether a compiled kernel's inline PTX runs in the layouts it was written for, checked once a kernel in its
    TTGIR (a GEMV that fails warns and runs with tl.gather lookups, without inline PTX):
    - variants 2 and 3: the lane ids are read in the layout its table shuffles run in. The shuffle reads the
      lane that holds table[index % 16]; were the per-lane table moved between threads by a layout conversion
      that Triton is free to insert, it would read another value (Triton 3.6 did so for a table made before the
      loop, so it is made from each step's packed units, in their layout);
    - variant 1 with 4 elements an instance takes 4 consecutive elements of the fastest axis: a blocked layout
      with a multiple of 4 elements a thread along it.
    Variant 4 and variant 1 with one element an instance are elementwise: any layout is right."""
    key = compiled.hash
    if key not in _LAYOUTS_CHECKED:
        ir = compiled.asm["ttgir"]
        blocked = {
            name: (list(map(int, per.split(","))), int(order.split(",")[0]))
            for name, per, order in re.findall(
                r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\].*order = \[([\d, ]+)\]", ir, re.M
            )
        }
        lane, shuffle, packs_ok = set(), set(), True
        for line in ir.splitlines():
            if "elementwise_inline_asm" in line:
                layouts = set(re.findall(r"tensor<[^,>]*, (#[\w.]+(?:<[^>]*>)?)", line.split(" : ", 1)[-1]))
                (lane if "%laneid" in line else shuffle if "shfl.sync" in line else set()).update(layouts)
                if "packed_element = 4" in line:
                    packs_ok &= all(name in blocked and blocked[name][0][blocked[name][1]] % 4 == 0 for name in layouts)
        ok = (len(lane) == 1 and lane == shuffle or not lane | shuffle) and packs_ok
        if not ok:
            warnings.warn(
                "fastplug: this Triton build laid out the 4-bit GEMV's inline PTX in another way than it "
                "was written for; the GEMV runs with tl.gather lookups instead (correct, slower)",
                stacklevel=4,
            )
        _LAYOUTS_CHECKED[key] = ok
    return _LAYOUTS_CHECKED[key]
