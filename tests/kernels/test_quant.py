"""4-bit (bitsandbytes) weights: Triton dequantization and the GEMV against the float64 values of the bytes
(`dequantize_float64`, never bitsandbytes' CPU dequantization, wrong on AVX-512 CPUs where a block straddles two
rows: tests/test_bnb_layouts.py), and the fused LoRA linear / QKV / MLP on 4-bit bases against peft's Linear4bit
LoRA layers.

bitsandbytes' CPU backend quantizes here; the Triton kernels run under the interpreter: shapes stay tiny.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from fastplug.kernels import quant  # noqa: E402
from fastplug.kernels.lora import QUANTIZED_STACK, LoRAProjection, lora_linear, lora_mlp, lora_qkv  # noqa: E402
from fastplug.kernels.quant import (  # noqa: E402
    GEMV_MAX_ROWS,
    dequantize_4bit,
    dequantize_4bit_reference,
    dequantize_4bit_scratch,
    dequantize_4bit_stacked,
    gemv_4bit,
    gemv_config,
    require_bitsandbytes,
)
from fastplug.models.peft_lora import lora_projection, unfused_reason  # noqa: E402
from fastplug.models.projections import fused_projections, unfused_notes  # noqa: E402
from tests.helpers import assert_close, dequantize_float64, rel_err  # noqa: E402

HIDDEN, INTERMEDIATE, KV_OUT, RANK = 48, 40, 16, 4


def quantized(out, inn, quant_type="nf4", double_quant=True, blocksize=64, dtype=torch.bfloat16, storage=torch.uint8):
    w = torch.randn(out, inn, dtype=dtype)
    p = bnb.nn.Params4bit(
        w,
        requires_grad=False,
        blocksize=blocksize,
        compress_statistics=double_quant,
        quant_type=quant_type,
        quant_storage=storage,
    )
    return p._quantize("cpu")


# fp32 dequantization against float64: the product (with a nested absmax, a product and a sum too) rounded to fp32
FP32_RTOL = 2**-21


def values(weights, dtype=torch.float64):
    """The float64 values of the weights' bytes one under another, in `dtype`."""
    return torch.cat([dequantize_float64(p) for p in weights]).to(dtype)


def same_fp32_values(out, weights):
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), values(weights), rtol=FP32_RTOL, atol=0)


def same_rounded(out, weights):
    """One rounding of the same value to out's dtype; the interpreter truncates where a GPU rounds to nearest."""
    rtol = 2**-7 if out.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out, values(weights, out.dtype), rtol=rtol, atol=0)


# ------------------------------------------------------------------------------------------ dequantize

# (16, 48) with blocksize 64: blocks straddle rows, where bitsandbytes' AVX-512 CPU dequantization is wrong
CASES = [((37, 51), 64), ((16, 64), 32), ((9, 300), 128), ((5, 7), 4096), ((3, 333), 256), ((16, 48), 64)]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,blocksize", CASES)
def test_dequantize_equals_float64(quant_type, double_quant, shape, blocksize):
    p = quantized(*shape, quant_type, double_quant, blocksize, dtype=torch.float32)
    out = dequantize_4bit(p)
    same_fp32_values(out, [p])
    assert torch.equal(dequantize_4bit_reference(p), out), "the torch path: the same fp32 products"
    # in float64 (the self-check's reference for 4-bit layers on the CPU): the products formed in float64 too
    torch.testing.assert_close(dequantize_4bit_reference(p, torch.float64), values([p]), rtol=1e-15, atol=0)
    for dtype in (torch.bfloat16, torch.float16):
        same_rounded(dequantize_4bit(p, dtype=dtype), [p])


def test_dequantize_into_buffer_and_other_storage():
    p = quantized(24, 40, storage=torch.bfloat16)  # quant_storage for FSDP: the same bytes in bf16 elements
    buf = torch.empty(24, 40, dtype=torch.bfloat16)
    assert dequantize_4bit(p, out=buf) is buf
    same_rounded(buf, [p])
    shared = dequantize_4bit_scratch(p, torch.bfloat16)
    assert torch.equal(shared, buf)
    small = quantized(8, 40)
    again = dequantize_4bit_scratch(small, torch.bfloat16)
    assert again.data_ptr() == shared.data_ptr(), "one buffer serves every layer"


def test_dequantize_errors():
    p = quantized(8, 16)
    with pytest.raises(ValueError, match="weight must be a bitsandbytes 4-bit weight"):
        dequantize_4bit(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(8, 16\)"):
        dequantize_4bit(p, out=torch.empty(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must have dtype"):
        dequantize_4bit(p, out=torch.empty(8, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 16\]"):
        gemv_4bit(torch.randn(2, 15), p)


def test_cached_fields_follow_the_weight():
    """The fields read from a weight are kept per weight: new bytes or a new quant_state are seen."""
    p, other = quantized(24, 40), quantized(24, 40, quant_type="fp4")
    x = torch.randn(3, 40)

    same_rounded(dequantize_4bit(p), [p])
    gemv_4bit(x, p)
    p.data, p.quant_state = other.data, other.quant_state  # what module._apply and re-quantization do
    same_rounded(dequantize_4bit(p), [other])
    assert_close(
        gemv_4bit(x, p), x.double() @ dequantize_float64(other).t(), torch.float32, "gemv after the weight changed"
    )
    p.data = quantized(24, 40).data  # new bytes, the same state
    same_rounded(dequantize_4bit_scratch(p, torch.bfloat16), [p])
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        dequantize_4bit_scratch(p, torch.int8)


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("fp4", False)])
def test_dequantize_stacked(quant_type, double_quant):
    """A group's weights one under another, one launch; each row block equals its own dequantization."""
    group = [quantized(o, 40, quant_type, double_quant, 32, torch.float32) for o in (24, 8, 9)]
    out = dequantize_4bit_stacked(group, torch.float32)
    assert out.shape == (41, 40) and torch.equal(out, torch.cat([dequantize_4bit(p) for p in group]))
    same_fp32_values(out, group)
    for dtype in (torch.bfloat16, torch.float16):
        out = dequantize_4bit_stacked(group, dtype)
        same_rounded(out, group)
    assert out.data_ptr() == dequantize_4bit_scratch(group[0], torch.float16).data_ptr(), "the shared buffer"
    group[1].data, group[1].quant_state = (
        (q := quantized(8, 40, quant_type, double_quant, 32, torch.float32)).data,
        q.quant_state,
    )
    same_fp32_values(dequantize_4bit_stacked(group, torch.float32)[24:32], [q])


def test_dequantize_stacked_mixed_and_errors():
    # mixed settings, odd element counts: one launch a weight, the same result
    f32 = torch.float32
    for group in (
        [quantized(6, 40, dtype=f32), quantized(5, 40, "fp4", False, 128, f32)],
        [quantized(5, 7, dtype=f32), quantized(3, 7, dtype=f32)],
    ):
        same_fp32_values(dequantize_4bit_stacked(group, torch.float32), group)
    with pytest.raises(ValueError, match="share their input width"):
        dequantize_4bit_stacked([quantized(4, 40), quantized(4, 32)], torch.bfloat16)
    with pytest.raises(ValueError, match="at least one"):
        dequantize_4bit_stacked([], torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be"):
        dequantize_4bit_stacked([quantized(4, 40)], torch.int32)


def test_require_bitsandbytes_says_how_to_install(monkeypatch):
    assert require_bitsandbytes() is bnb
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r'pip install "fastplug\[qlora\]"'):
        require_bitsandbytes()


def test_fastplug_never_imports_bitsandbytes():
    code = (
        "import sys, fastplug, fastplug.kernels.quant, fastplug.kernels.lora, fastplug.models.peft_lora;"
        "assert 'bitsandbytes' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------- gemv


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize(
    "quant_type,double_quant,shape,blocksize",
    [
        ("nf4", True, (19, 64), 64),
        ("fp4", False, (13, 45), 32),
        ("nf4", False, (7, 130), 128),
        ("nf4", True, (5, 1030), 64),  # K even, blocks straddle rows, a row is 515 bytes: 1-byte sub-chunks
    ],
)
def test_gemv_matches_reference(rows, quant_type, double_quant, shape, blocksize):
    p = quantized(*shape, quant_type, double_quant, blocksize)
    w = dequantize_float64(p)  # the values unrounded (one row of 16-bit x takes them rounded to x's dtype)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, shape[1], dtype=dtype)
        assert_close(gemv_4bit(x, p), x.double() @ w.t(), dtype, f"gemv rows={rows} {dtype}")
    x3 = torch.randn(2, 1, shape[1], dtype=torch.bfloat16)  # leading dims, like a decode step's [B, 1, H]
    assert gemv_4bit(x3, p).shape == (2, 1, shape[0])


@pytest.mark.parametrize(
    "quant_type,double_quant,shape,blocksize",
    [
        ("nf4", True, (11, 256), 64),
        ("fp4", True, (6, 320), 128),
        ("nf4", False, (9, 512), 256),
        ("fp4", False, (5, 96), 32),
        ("nf4", True, (7, 136), 32),
        ("nf4", True, (16, 512), 64),
    ],
)
@pytest.mark.parametrize(
    "override",
    [
        dict(),
        dict(lookup="gather", split=2, block_n=2),
        dict(chunk=32, split=3),
        dict(block_n=1, chunk=64, num_warps=1),
    ],
)
def test_gemv_words(quant_type, double_quant, shape, blocksize, override):
    """The word-wise loop (the packed weight read as int32, eight nibbles shifted out of each, little-endian)
    gives the product of one row of x and of several (each nibble looked up once for all), with tiles that fill
    the weight (no masks: 16 x 512) or not, and K split over programs (fp32 sums added by a second launch)."""
    p = quantized(*shape, quant_type, double_quant, blocksize)
    w = dequantize_float64(p)
    for m in (1, 3, GEMV_MAX_ROWS):
        x = torch.randn(m, shape[1])
        cfg = gemv_config(m, shape[0], shape[1], blocksize, x.device, **override)
        assert_close(gemv_4bit(x, p, cfg), x.double() @ w.t(), torch.float32, f"gemv words {m} rows {override}")


def test_gemv_config_errors():
    """The tile refuses more rows than the loop takes and unknown overrides; where the loop cannot read the weight
    (K not a multiple of 8, blocksize under 8) there is none, and the product takes the other paths."""
    with pytest.raises(ValueError, match="takes 1 to 8 rows"):
        gemv_config(GEMV_MAX_ROWS + 1, 11, 256, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown gemv_config override"):
        gemv_config(1, 11, 256, 64, torch.device("cpu"), block_m=2)
    assert gemv_config(1, 11, 300, 64, torch.device("cpu")) is None
    p = quantized(11, 300)
    x = torch.randn(1, 300)
    assert_close(gemv_4bit(x, p), x.double() @ dequantize_float64(p).t(), torch.float32, "gemv, K = 300")


def test_gemv_shuffle_lookup_needs_compiled_cuda():
    """The warp-shuffle lookup is inline PTX: off a compiled GPU it is refused by name, and never the default."""
    assert gemv_config(1, 11, 256, 64, torch.device("cpu")).lookup != "shfl"
    with pytest.raises(ValueError, match="'shfl' is inline PTX"):
        gemv_config(1, 11, 256, 64, torch.device("cpu"), lookup="shfl")
    with pytest.raises(ValueError, match="lookup must be one of"):
        gemv_config(1, 11, 256, 64, torch.device("cpu"), lookup="smem")


def test_shuffle_layout_check():
    """The check of a compiled shuffle GEMV: the lane ids read in the layout the shuffles run in pass; a table
    made in one layout and shuffled in another (what Triton 3.6 compiled for a table made before the loop) fails,
    with a warning."""
    from types import SimpleNamespace

    def ir(lane_layout, shuffle_layout):
        return SimpleNamespace(
            hash=f"{lane_layout}-{shuffle_layout}",
            asm={
                "ttgir": "\n".join(
                    [
                        f'%lane = tt.elementwise_inline_asm "mov.u32 $0, %laneid;" {{pure = true}} %u : tensor<8x16xi32, '
                        f"{lane_layout}> -> tensor<8x16xi32, {lane_layout}> loc(#loc1)",
                        f"%b = ttg.convert_layout %t : tensor<8x16xi32, {lane_layout}> -> tensor<8x16xi32, {shuffle_layout}>",
                        f'%bits = tt.elementwise_inline_asm "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;" {{pure = true}} '
                        f"%b, %i : tensor<8x16xi32, {shuffle_layout}>, tensor<8x16xi32, {shuffle_layout}> -> tensor<8x16xi32, "
                        f"{shuffle_layout}> loc(#loc2)",
                    ]
                )
            },
        )

    assert quant.layouts_agree(ir("#blocked1", "#blocked1"))
    with pytest.warns(UserWarning, match="tl.gather lookups instead"):
        assert not quant.layouts_agree(ir("#blocked1", "#blocked3"))
    with pytest.warns(UserWarning):
        assert not quant.layouts_agree(ir("#blocked1", "#ttg.slice<{dim = 0, parent = #blocked1}>"))


def test_pack4_layout_check():
    """A 4-element pack of inline PTX (one scale load for 4 consecutive words) passes in a layout with 4
    consecutive elements a thread along the fastest axis, and fails, with a warning, in one with 1 or 2."""
    from types import SimpleNamespace

    def ir(size_per_thread):
        return SimpleNamespace(
            hash=f"pack4-{size_per_thread}",
            asm={
                "ttgir": "\n".join(
                    [
                        f"#blocked = #ttg.blocked<{{sizePerThread = [{size_per_thread}], threadsPerWarp = [1, 32], "
                        "warpsPerCTA = [1, 1], order = [1, 0]}>",
                        '%s = tt.elementwise_inline_asm "ld.global.nc.f32 r, [$4];" {constraints = "=f,=f,=f,=f,l,l,l,l", '
                        "packed_element = 4 : i32, pure = true} %a : tensor<4x128xi64, #blocked> -> tensor<4x128xf32, "
                        "#blocked> loc(#loc1)",
                    ]
                )
            },
        )

    assert quant.layouts_agree(ir("1, 4"))
    assert quant.layouts_agree(ir("2, 8"))
    for bad in ("1, 1", "4, 2"):
        with pytest.warns(UserWarning, match="tl.gather lookups instead"):
            assert not quant.layouts_agree(ir(bad))


def test_gemv_words_on_bytes_off_a_word_boundary():
    """Packed bytes that do not start at a 4-byte boundary (a view into a larger buffer) take the other paths
    even with a word-wise tile given, with the same product."""
    p = quantized(11, 256)
    buf = torch.empty(p.data.numel() + 1, dtype=torch.uint8)
    buf[1:] = p.data.reshape(-1)
    shifted = bnb.nn.Params4bit(buf[1:], requires_grad=False, quant_state=p.quant_state, bnb_quantized=True)
    assert shifted.data_ptr() % 4
    x = torch.randn(1, 256)
    cfg = gemv_config(1, 11, 256, 64, x.device)
    w = dequantize_float64(p)
    assert_close(gemv_4bit(x, shifted, cfg), x.double() @ w.t(), torch.float32, "gemv off a word boundary")


# ------------------------------------------------------------------- fused LoRA on 4-bit bases vs peft


class TinyBlock4bit(nn.Module):
    def __init__(self, bias=False):
        super().__init__()

        def linear(i, o, b=False):
            return bnb.nn.Linear4bit(
                i, o, bias=b, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True
            )

        self.q_proj = linear(HIDDEN, HIDDEN, bias)
        self.k_proj, self.v_proj = linear(HIDDEN, KV_OUT, bias), linear(HIDDEN, KV_OUT, bias)
        self.o_proj = linear(HIDDEN, HIDDEN)
        self.gate_proj, self.up_proj = linear(HIDDEN, INTERMEDIATE), linear(HIDDEN, INTERMEDIATE)
        self.down_proj = linear(INTERMEDIATE, HIDDEN)


def peft_4bit_block(bias=False):
    block = TinyBlock4bit(bias).to("cpu")  # bitsandbytes quantizes on the move to a device
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
    model = peft.get_peft_model(block, config)
    model.to(torch.bfloat16)
    return model.base_model.model


def _reference(layer):
    """Float64 leaves of a peft 4-bit LoRA layer: the dequantized base, bias, A, B and the scaling. The base is
    dequantized from its bytes in float64, never by bitsandbytes: its CPU dequantization is wrong on AVX-512 CPUs
    where blocks straddle rows (tests/test_bnb_layouts.py), and peft's output is judged as fastplug's is."""
    w = dequantize_float64(layer.base_layer.weight)
    b = layer.base_layer.bias
    a, bb = (t.detach().double().requires_grad_() for t in (layer.lora_A.default.weight, layer.lora_B.default.weight))
    return w, None if b is None else b.detach().double(), a, bb, layer.scaling["default"]


def _linear64(x, ref):
    w, b, a, bb, s = ref
    y = x @ w.t() + s * (x @ a.t()) @ bb.t()
    return y if b is None else y + b


def _grads(outputs, inputs, grads_out):
    return torch.autograd.grad(outputs, inputs, grads_out)


@pytest.fixture
def no_bnb_dequantize(monkeypatch):
    """bitsandbytes' Python dequantization raises while a test builds its float64 reference."""

    def refuse(*_, **__):
        raise AssertionError("the float64 reference must not come from bitsandbytes' CPU dequantization")

    def reference(layer):
        with monkeypatch.context() as m:
            m.setattr(bnb.functional, "dequantize_4bit", refuse)
            return _reference(layer)

    return reference


@pytest.mark.parametrize("bias,stacked", [(False, False), (True, False), (False, True)])
def test_fused_4bit_linear_and_qkv_match_peft(bias, stacked, no_bnb_dequantize):
    """stacked: q/k/v dequantized together into one matrix for one GEMM (what a patched model does)."""
    block = peft_4bit_block(bias)
    names = ("q_proj", "k_proj", "v_proj")
    layers = [getattr(block, n) for n in names]
    projs = fused_projections(*layers)
    assert projs is not None and all(p.weight is l.base_layer.weight for p, l in zip(projs, layers))
    x = torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16)
    x64 = x.double().requires_grad_()
    refs = [no_bnb_dequantize(l) for l in layers]
    ys64 = [_linear64(x64, r) for r in refs]
    gouts = [torch.randn_like(y, dtype=torch.bfloat16) for y in ys64]
    leaves64 = [x64] + [t for r in refs for t in r[2:4]]
    ref_grads = _grads(ys64, leaves64, [g.double() for g in gouts])

    def run(fn):
        xb = x.clone().requires_grad_()
        ys = fn(xb)
        leaves = [xb] + [t for l in layers for t in (l.lora_A.default.weight, l.lora_B.default.weight)]
        return ys, _grads(ys, leaves, gouts)

    fused_ys, fused_grads = run(lambda xb: lora_qkv(xb, *projs, stacked=QUANTIZED_STACK if stacked else None))
    peft_ys, peft_grads = run(lambda xb: tuple(l(xb) for l in layers))
    what = ["dX"] + [f"{n}.{p}" for n in names for p in ("dA", "dB")]
    for y, py, ry, n in zip(fused_ys, peft_ys, ys64, names):
        assert_close(y, ry, torch.bfloat16, f"{n} forward")
        assert rel_err(y, ry) <= 2 * rel_err(py, ry) + 1e-3, f"{n}: fused no worse than peft"
    for g, pg, rg, n in zip(fused_grads, peft_grads, ref_grads, what):
        assert_close(g, rg, torch.bfloat16, n)
        assert rel_err(g, rg) <= 2 * rel_err(pg, rg) + 1e-3, f"{n}: fused no worse than peft"

    (o,) = fused_projections(block.o_proj)
    xo = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    assert_close(lora_linear(xo, o), _linear64(xo.double(), no_bnb_dequantize(block.o_proj)), torch.bfloat16, "o_proj")


@pytest.mark.parametrize("stacked", [False, True])
def test_fused_4bit_mlp_matches_peft(stacked, no_bnb_dequantize):
    block = peft_4bit_block()
    layers = [block.gate_proj, block.up_proj, block.down_proj]
    projs = fused_projections(*layers)
    x = torch.randn(2, 4, HIDDEN, dtype=torch.bfloat16)
    refs = [no_bnb_dequantize(l) for l in layers]
    x64 = x.double().requires_grad_()
    y64 = _linear64(F.silu(_linear64(x64, refs[0])) * _linear64(x64, refs[1]), refs[2])
    g = torch.randn_like(y64, dtype=torch.bfloat16)
    ref_grads = _grads(y64, [x64] + [t for r in refs for t in r[2:4]], g.double())

    xb = x.clone().requires_grad_()
    y = lora_mlp(xb, *projs, activation="silu", stacked=QUANTIZED_STACK if stacked else None)
    grads = _grads(y, [xb] + [t for l in layers for t in (l.lora_A.default.weight, l.lora_B.default.weight)], g)
    assert_close(y, y64, torch.bfloat16, "mlp forward")
    names = ["dX"] + [f"{n}.{p}" for n in ("gate", "up", "down") for p in ("dA", "dB")]
    for got, ref, n in zip(grads, ref_grads, names):
        assert_close(got, ref, torch.bfloat16, n)
    assert all(l.base_layer.weight.grad is None for l in layers), "the 4-bit base gets no grad"


def test_4bit_views_and_reasons():
    block = peft_4bit_block()
    q = block.q_proj
    assert lora_projection(q) is None, "callers reading a dense weight (generation, LM head) run the module"
    assert "4-bit" in unfused_reason(q)
    view = lora_projection(q, quantized=True)
    assert view.weight is q.base_layer.weight and view.lora_A is q.lora_A.default.weight
    assert unfused_reason(q, quantized=True) is None and unfused_notes(block, ("q_proj",)) == ()
    q.enable_adapters(False)
    assert lora_projection(q, quantized=True).lora_A is None, "disabled adapter: the 4-bit base alone"
    q.enable_adapters(True)
    # a plain (no LoRA) 4-bit layer is a base-only view
    assert lora_projection(q.base_layer, quantized=True).lora_A is None
    with pytest.raises(ValueError, match="proj.weight must have shape"):
        base_only = LoRAProjection(q.base_layer.weight, None, None, None, 0.0)
        lora_linear(torch.randn(2, HIDDEN + 1, dtype=torch.bfloat16), base_only)


def test_8bit_base_falls_back_with_reason():
    layer = nn.Module()
    layer.q_proj = bnb.nn.Linear8bitLt(HIDDEN, HIDDEN, bias=False, has_fp16_weights=False)
    model = peft.get_peft_model(layer, peft.LoraConfig(r=RANK, target_modules=["q_proj"]))
    q = model.base_model.model.q_proj
    assert fused_projections(q) is None
    (note,) = unfused_notes(model.base_model.model, ("q_proj",))
    assert "8-bit bitsandbytes" in note[1] and "only 4-bit bitsandbytes is fused" in note[1], note


def test_gptq_like_base_falls_back_with_reason():
    # GPTQ / AWQ libraries are not installed here: a layer class from such a package stands in for them
    quant_linear = type("QuantLinear", (nn.Module,), {"__module__": "auto_gptq.nn_modules.qlinear"})
    wrapper = nn.Module()
    wrapper.base_layer, wrapper.lora_A = quant_linear(), nn.ModuleDict()
    owner = nn.Module()
    owner.q_proj = wrapper
    (note,) = unfused_notes(owner, ("q_proj",))
    assert "quantized (GPTQ, QuantLinear)" in note[1], note
