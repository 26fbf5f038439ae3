"""Each inline PTX variant of fastplug/kernels/ptx.py, launched alone on CUDA in a small kernel and compared with
its torch reference; and the layout check (`ptx.layouts_agree`) passes on the kernels that use the layout-bound
variants. The 4-bit GEMVs that use them are tested at real shapes in test_quant_gpu.py."""

import pytest
import torch
import triton
import triton.language as tl

from fastplug.kernels import ptx

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX runs on CUDA only")

BLOCK = 1024  # elements a program; 4 warps: 8 a thread


@triton.jit
def _scale_kernel(
    blk_ptr,
    valid_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    out_ptr,
    n,
    BLOCKSIZE2_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    PACK4: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # 16-byte loads: 4 consecutive elements a thread, the layout PACK4 needs (as the GEMV's word loads give)
    blk = tl.load(blk_ptr + offs, mask=offs < n, other=0)
    valid = tl.load(valid_ptr + offs, mask=offs < n, other=0) != 0
    offset = 0.0
    if NESTED:
        offset = tl.load(offset_ptr)
    scale = ptx.block_scale(blk, valid, absmax_ptr, absmax2_ptr, code2_ptr, offset, BLOCKSIZE2_LOG2, NESTED, PACK4)
    tl.store(out_ptr + offs, scale, mask=offs < n)


@cuda
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("pack4", [False, True])
def test_block_scale_matches_torch(nested, pack4):
    """Variant 1 (SCALE_FLAT, SCALE_NESTED, and their 4-element packs): a block's fp32 absmax, 0 where not valid."""
    torch.manual_seed(0)
    blocks, blocksize2, n = 300, 256, 4 * BLOCK + 64
    blk = torch.randint(0, blocks, (n // 4,), device="cuda", dtype=torch.int32)
    blk = blk.repeat_interleave(4) if pack4 else torch.randint(0, blocks, (n,), device="cuda", dtype=torch.int32)
    draws = torch.rand(n // 4, device="cuda").repeat_interleave(4) if pack4 else torch.rand(n, device="cuda")
    valid = draws > 0.2
    valid = valid.to(torch.int32)
    code2 = torch.randn(256, device="cuda")
    absmax2 = torch.rand(blocks // blocksize2 + 1, device="cuda") + 0.5
    offset = torch.tensor(0.25, device="cuda")
    if nested:
        absmax = torch.randint(0, 256, (blocks,), device="cuda", dtype=torch.uint8)
        product = code2[absmax.long()] * absmax2[torch.arange(blocks, device="cuda") // blocksize2]
        ref = product + offset
        terms = product.abs() + offset.abs()  # what one rounding of the sum is relative to
    else:
        absmax = torch.rand(blocks, device="cuda") * 3
        ref = terms = absmax
    ref = torch.where(valid != 0, ref[blk.long()], 0.0)
    terms = torch.where(valid != 0, terms[blk.long()], 0.0)
    out = torch.empty(n, device="cuda")
    compiled = _scale_kernel[(triton.cdiv(n, BLOCK),)](
        blk,
        valid,
        absmax,
        absmax2,
        code2,
        offset,
        out,
        n,
        BLOCKSIZE2_LOG2=blocksize2.bit_length() - 1,
        NESTED=nested,
        PACK4=pack4,
        BLOCK=BLOCK,
        num_warps=4,
    )
    assert ptx.layouts_agree(compiled)
    # fma.rn rounds once, torch's multiply then add twice: they differ by an ulp of the terms, more than an ulp of
    # the sum where the offset cancels the product
    assert ((out - ref).abs() <= 2 * torch.finfo(torch.float32).eps * terms).all()


@triton.jit
def _lookup_kernel(index_ptr, code_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    index = tl.load(index_ptr + offs, mask=offs < n, other=0)
    table = ptx.lane_table(code_ptr, index)  # made in the layout of `index`, as the GEMV makes it
    tl.store(out_ptr + offs, ptx.table_lookup(table, index), mask=offs < n)


@cuda
def test_lane_table_and_shuffle_lookup_match_torch():
    """Variants 2 and 3 (LANE_TABLE, TABLE_SHUFFLE): code[index & 15] by warp shuffle; higher bits ignored; and
    `layouts_agree` accepts the compiled kernel (the lane ids read in the shuffles' layout)."""
    torch.manual_seed(0)
    n = 3 * BLOCK + 100
    index = torch.randint(-(2**31), 2**31 - 1, (n,), device="cuda", dtype=torch.int32)
    code = torch.randn(16, device="cuda")
    out = torch.empty(n, device="cuda")
    compiled = _lookup_kernel[(triton.cdiv(n, BLOCK),)](index, code, out, n, BLOCK=BLOCK, num_warps=4)
    assert ptx.layouts_agree(compiled)
    assert torch.equal(out, code[(index & 15).long()])


@triton.jit
def _bf16x8_kernel(x_ptr, out_ptr, n_words, n_valid, BLOCK_W: tl.constexpr):
    word = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    x0, x1, x2, x3, x4, x5, x6, x7 = ptx.bf16x8_load(x_ptr, word, (word < n_valid) & (word < n_words))
    mask = word < n_words
    tl.store(out_ptr + 0 * n_words + word, x0, mask=mask)
    tl.store(out_ptr + 1 * n_words + word, x1, mask=mask)
    tl.store(out_ptr + 2 * n_words + word, x2, mask=mask)
    tl.store(out_ptr + 3 * n_words + word, x3, mask=mask)
    tl.store(out_ptr + 4 * n_words + word, x4, mask=mask)
    tl.store(out_ptr + 5 * n_words + word, x5, mask=mask)
    tl.store(out_ptr + 6 * n_words + word, x6, mask=mask)
    tl.store(out_ptr + 7 * n_words + word, x7, mask=mask)


@cuda
def test_bf16x8_load_matches_torch():
    """Variant 4 (BF16X8_LOAD): eight bf16 of a 16-byte word as fp32 (exact), zeros where not valid."""
    torch.manual_seed(0)
    n_words, n_valid = 1000, 937
    x = torch.randn(n_words * 8, device="cuda", dtype=torch.bfloat16)
    assert x.data_ptr() % 16 == 0
    out = torch.empty(8, n_words, device="cuda")
    _bf16x8_kernel[(triton.cdiv(n_words, 256),)](x, out, n_words, n_valid, BLOCK_W=256, num_warps=4)
    ref = x.view(n_words, 8).float().t().clone()
    ref[:, n_valid:] = 0.0
    assert torch.equal(out, ref)


def test_ptx_text_is_the_measured_text():
    """The scale template's output for each variant (its text is what the GEMV's timings measured)."""
    flat, flat_c = ptx.scale_ptx(False, 1)
    assert flat.value == (
        "{ .reg .pred p; .reg .f32 r; setp.ne.b32 p, $2, 0; mov.b32 r, 0; @p ld.global.nc.f32 r, [$1]; mov.b32 $0, r; }"
    )
    assert flat_c.value == "=f,l,r"
    assert ptx.SCALE_NESTED4_CONSTRAINTS.value == "=f,=f,=f,=f," + ",".join(c for c in "lllrf" for _ in range(4))
