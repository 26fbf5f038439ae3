"""4-bit bitsandbytes weights on CUDA at Llama shapes: Triton dequantization equals bitsandbytes' CUDA
dequantization bit for bit, the GEMV matches a float64 product, and the fused 4-bit LoRA MLP / QKV match a
float64 reference built on the same dequantized base (and are no worse than peft + bitsandbytes)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from fastplug.kernels.lora import lora_mlp, lora_qkv  # noqa: E402
from fastplug.kernels.quant import (  # noqa: E402
    dequantize_4bit,
    dequantize_4bit_reference,
    dequantize_4bit_stacked,
    gemv_4bit,
    gemv_config,
)
from fastplug.models.projections import fused_projections  # noqa: E402
from tests.helpers import assert_close, rel_err  # noqa: E402


def quantized(out, inn, quant_type="nf4", double_quant=True, blocksize=64):
    w = torch.randn(out, inn, dtype=torch.bfloat16, device="cuda")
    p = bnb.nn.Params4bit(
        w.cpu(), requires_grad=False, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    return p.to("cuda")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,blocksize", [((14336, 4096), 64), ((4096, 14336), 128), ((1001, 333), 256)])
def test_dequantize_equals_bitsandbytes_cuda(quant_type, double_quant, shape, blocksize):
    p = quantized(*shape, quant_type, double_quant, blocksize)
    ref = bnb.functional.dequantize_4bit(p.data, p.quant_state)
    out = dequantize_4bit(p)
    assert out.dtype == ref.dtype == torch.bfloat16
    mismatch = (out != ref).float().mean().item()
    # double quant: bitsandbytes adds the offset in a separate op; a fused multiply-add may round once less
    bound = 1e-3 if double_quant else 0.0
    assert mismatch <= bound, f"{mismatch:.2e} of the values differ"
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)


@pytest.mark.parametrize("outs", [(2048, 512, 512), (8192, 8192), (300, 77)])
def test_dequantize_stacked_cuda(outs):
    """A group (Llama-1B q/k/v, gate/up; odd sizes) in one launch equals the weights' own dequantizations."""
    group = [quantized(o, 2048) for o in outs]
    out = dequantize_4bit_stacked(group, torch.bfloat16)
    assert torch.equal(out, torch.cat([dequantize_4bit(p) for p in group]))


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize(
    "shape,blocksize",
    [((14336, 4096), 64), ((4096, 14336), 64), ((777, 1030), 128), ((512, 2048), 64), ((300, 333), 64)],
)
def test_gemv_cuda(rows, shape, blocksize):
    p = quantized(*shape, blocksize=blocksize)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16, device="cuda")
    ref = x.double() @ dequantize_4bit_reference(p, torch.float64).t()
    assert_close(gemv_4bit(x, p), ref, torch.bfloat16, f"gemv rows={rows}")


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(
    "tile",
    [
        dict(),
        dict(lookup="gather"),
        dict(lookup="load"),
        dict(split=2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_tiles_cuda(rows, tile, dtype):
    """The word-wise loop at up to GEMV_MAX_ROWS rows (explicit tiles), split-K included (512 rows). The default
    lookup is the warp shuffle: a layout conversion of its per-lane table would show here."""
    for shape in ((4096, 14336), (512, 2048)):
        p = quantized(*shape)
        x = torch.randn(rows, shape[1], dtype=dtype, device="cuda")
        ref = x.double() @ dequantize_4bit_reference(p, torch.float64).t()
        cfg = gemv_config(rows, *shape, 64, x.device, **tile)
        assert_close(gemv_4bit(x, p, cfg), ref, dtype, f"gemv rows={rows} {cfg}")


@pytest.mark.parametrize(
    "tile",
    [
        dict(),
        dict(lookup="gather"),
        dict(lookup="load"),
        dict(split=2, block_n=16, chunk=1024),
        dict(block_n=16, chunk=256, num_warps=2),
        dict(block_n=2, chunk=1024, num_warps=8),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_words_cuda(tile, dtype):
    """The word-wise kernel at one row of x, split-K included; the shuffle's per-lane table passes the layout
    check (a warning there would mean this Triton moved it and the GEMV fell back to tl.gather)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastplug: this Triton build")
        for shape in ((4096, 14336), (14336, 4096), (512, 2048), (4096, 4104)):
            p = quantized(*shape)
            x = torch.randn(1, shape[1], dtype=dtype, device="cuda")
            ref = x.double() @ dequantize_4bit_reference(p, torch.float64).t()
            cfg = gemv_config(1, *shape, 64, x.device, **tile)
            assert_close(gemv_4bit(x, p, cfg), ref, dtype, f"gemv words {cfg}")


@pytest.mark.parametrize(
    "quant_type,double_quant,blocksize",
    [
        ("fp4", False, 64),
        ("nf4", False, 128),
        ("nf4", True, 256),
        ("fp4", True, 32),
    ],
)
def test_gemv_words_formats_cuda(quant_type, double_quant, blocksize):
    """The default one-row path (shuffle lookups, x and scales by inline PTX) for both 4-bit types, plain and
    nested absmax, several blocksizes; and x 2 bytes off a 16-byte boundary, which takes tl.load for x."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastplug: this Triton build")
        for shape in ((2048, 8192), (1000, 2056)):
            p = quantized(*shape, quant_type, double_quant, blocksize)
            w = dequantize_4bit_reference(p, torch.float64)
            buf = torch.randn(1, shape[1] + 1, dtype=torch.bfloat16, device="cuda")
            for x in (buf[:, : shape[1]], buf[:, 1:]):
                assert_close(
                    gemv_4bit(x, p),
                    x.double() @ w.t(),
                    torch.bfloat16,
                    f"{quant_type} nested={double_quant} blocksize={blocksize} x at +{x.data_ptr() % 16}",
                )


class Block4bit(torch.nn.Module):
    def __init__(self, hidden, intermediate, kv):
        super().__init__()

        def linear(i, o):
            return bnb.nn.Linear4bit(
                i, o, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True
            )

        self.q_proj, self.k_proj, self.v_proj = linear(hidden, hidden), linear(hidden, kv), linear(hidden, kv)
        self.gate_proj, self.up_proj = linear(hidden, intermediate), linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)


def _llama_1b_4bit():
    block = Block4bit(2048, 8192, 512).to("cuda")
    config = peft.LoraConfig(
        r=16,
        lora_alpha=32,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = peft.get_peft_model(block, config).to(torch.bfloat16)
    return model.base_model.model


def _leaves64(layer):
    w = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state).double()
    a, b = (t.detach().double().requires_grad_() for t in (layer.lora_A.default.weight, layer.lora_B.default.weight))
    return w, a, b, layer.scaling["default"]


def _lin64(x, leaves):
    w, a, b, s = leaves
    return x @ w.t() + s * (x @ a.t()) @ b.t()


def _adapters(layers):
    return [t for l in layers for t in (l.lora_A.default.weight, l.lora_B.default.weight)]


def test_llama_1b_4bit_mlp_and_qkv():
    block = _llama_1b_4bit()
    x = torch.randn(2, 512, 2048, dtype=torch.bfloat16, device="cuda")
    # MLP
    mlp = [block.gate_proj, block.up_proj, block.down_proj]
    refs = [_leaves64(l) for l in mlp]
    x64 = x.double().requires_grad_()
    y64 = _lin64(F.silu(_lin64(x64, refs[0])) * _lin64(x64, refs[1]), refs[2])
    g = torch.randn_like(y64, dtype=torch.bfloat16)
    ref_grads = torch.autograd.grad(y64, [x64] + [t for r in refs for t in r[1:3]], g.double())
    outs = {}
    for name, fn in (
        ("fused", lambda t: lora_mlp(t, *fused_projections(*mlp))),
        ("peft", lambda t: block.down_proj(F.silu(block.gate_proj(t)) * block.up_proj(t))),
    ):
        xb = x.clone().requires_grad_()
        y = fn(xb)
        outs[name] = (y, *torch.autograd.grad(y, [xb] + _adapters(mlp), g))
    for i, ref in enumerate((y64, *ref_grads)):
        assert_close(outs["fused"][i], ref, torch.bfloat16, f"mlp output/grad {i}")
        assert rel_err(outs["fused"][i], ref) <= 2 * rel_err(outs["peft"][i], ref) + 1e-3
    # QKV
    qkv = [block.q_proj, block.k_proj, block.v_proj]
    refs = [_leaves64(l) for l in qkv]
    ys64 = [_lin64(x64, r) for r in refs]
    gs = [torch.randn_like(y, dtype=torch.bfloat16) for y in ys64]
    ref_grads = torch.autograd.grad(ys64, [x64] + [t for r in refs for t in r[1:3]], [t.double() for t in gs])
    xb = x.clone().requires_grad_()
    ys = lora_qkv(xb, *fused_projections(*qkv))
    grads = torch.autograd.grad(ys, [xb] + _adapters(qkv), gs)
    for got, ref in zip((*ys, *grads), (*ys64, *ref_grads)):
        assert_close(got, ref, torch.bfloat16, "qkv output/grad")


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_decode_gemv_word_wise_cuda(rows):
    """The decode kernels' GEMV on 4-bit weights at 1-8 rows of bf16 x (the word-wise loop: shuffle lookups, x
    and scales by inline PTX) against the same launch on the dequantized weights: q/k/v with the norm and LoRA,
    gate/up with the activation, down with an in-place residual. A shuffle-layout warning is an error here."""
    from fastplug.kernels.decode import gemv

    torch.manual_seed(rows)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastplug: this Triton build")
        h, inter = 1024, 4096
        qkv = [quantized(n, h) for n in (h, 256, 256)]
        x = torch.randn(rows, h, dtype=torch.bfloat16, device="cuda")
        xi = torch.randn(rows, inter, dtype=torch.bfloat16, device="cuda")
        lora = (
            torch.randn(rows, 16, dtype=torch.bfloat16, device="cuda"),
            [
                torch.randn(h, 8, dtype=torch.bfloat16, device="cuda"),
                None,
                torch.randn(256, 8, dtype=torch.bfloat16, device="cuda"),
            ],
            [0.5, 0.0, 2.0],
        )
        norm = (torch.rand(h, dtype=torch.bfloat16, device="cuda") + 0.5, 1e-6, 0.0)
        down = [quantized(h, inter)]
        residual = torch.randn(rows, h, dtype=torch.bfloat16, device="cuda")
        for x_in, weights, kw in (
            (x, qkv, dict(norm=norm, lora=lora)),
            (x, [quantized(inter, h) for _ in range(2)], dict(activation="silu")),
            (xi, down, dict(residual=residual)),
        ):
            dense = [dequantize_4bit(w, dtype=torch.bfloat16) for w in weights]
            ref = gemv(x_in, dense, **kw).float()
            if "residual" in kw:
                out = residual.clone()
                gemv(x_in, weights, **{**kw, "residual": out}, out=out)
            else:
                out = gemv(x_in, weights, **kw)
            assert rel_err(out.float(), ref) < 2e-2, (rows, sorted(kw), rel_err(out.float(), ref))
