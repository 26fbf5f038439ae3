"""rms_norm / layer_norm: forward and backward against float64 references and transformers' modules.

On CPU the Triton kernels run under the interpreter, so shapes stay small; they still cover several row
tiles per program (300 x 64), packed narrow rows (2 x 3 x 80), odd widths and the looped wide-row path (3 x 9001).
"""

import dataclasses

import pytest
import torch

from fastplug.kernels import norms, tuning
from fastplug.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from tests.helpers import assert_close

SHAPES = [(37, 129), (2, 3, 80), (5, 1000), (300, 64), (3, 9001)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run(fn, tensors, dy):
    """Output and gradients (None where a tensor needs none) of fn(*tensors)."""
    out = fn(*tensors)
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, dy))
    return out, [next(grads) if t is not None and t.requires_grad else None for t in tensors]


def _check_against_float64(fn, ref_fn, tensors, dy, dtype, names):
    out, grads = _run(fn, tensors, dy)
    doubles = [_leaf(t.double()) if t is not None else None for t in tensors]
    ref_out, ref_grads = _run(ref_fn, doubles, dy.double())
    assert out.shape == ref_out.shape
    assert_close(out, ref_out, dtype, "out")
    for name, t, g, ref_g in zip(names, tensors, grads, ref_grads):
        if t is not None and t.requires_grad:
            assert g.dtype == t.dtype and g.shape == t.shape
            assert_close(g, ref_g, dtype, f"d{name}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_float64(shape, dtype, offset):
    x = _leaf(torch.randn(shape, dtype=dtype) * 3 + 0.5)
    w = _leaf(torch.randn(shape[-1], dtype=dtype))
    dy = torch.randn(shape, dtype=dtype)
    _check_against_float64(
        lambda x, w: rms_norm(x, w, 1e-6, offset),
        lambda x, w: rms_norm_reference(x, w, 1e-6, offset),
        [x, w],
        dy,
        dtype,
        ["x", "weight"],
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_float64(shape, dtype):
    # an offset mean, so a one-pass E[x^2] - E[x]^2 variance would show
    x = _leaf(torch.randn(shape, dtype=dtype) * 2 + 4)
    w = _leaf(torch.randn(shape[-1], dtype=dtype))
    b = _leaf(torch.randn(shape[-1], dtype=dtype))
    dy = torch.randn(shape, dtype=dtype)
    _check_against_float64(layer_norm, layer_norm_reference, [x, w, b], dy, dtype, ["x", "weight", "bias"])


# The launch alternatives scripts/tune_kernels.py may pick: each must give the same numbers.
TUNING_VARIANTS = {
    "pipelined_loop": dict(bwd_loop_stages=3),
    "packed_bwd_rows": dict(bwd_min_tile=1024, bwd_elems_per_warp=256, resident_warps_per_sm=32),
    "packed_fwd_rows": dict(fwd_min_tile=1024, fwd_elems_per_warp=128),
}


@pytest.mark.parametrize("variant", list(TUNING_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tuning_variants_match_float64(variant, dtype):
    def varied(n_cols, dtype, *, backward, center):  # RMSNorm's and LayerNorm's constants, changed alike
        base = norms.LAYER_NORM_CONSTANTS if center else norms.RMS_NORM_CONSTANTS
        constants = dataclasses.replace(base, **TUNING_VARIANTS[variant])
        return norms.norm_config(n_cols, dtype, backward=backward, center=center, constants=constants)

    with tuning.override("norm", varied):
        _check_variant(variant, dtype)
    assert tuning.overridden("norm") is None


def test_defaults_are_what_runs():
    cfg = norms.norm_config(4096, torch.bfloat16, backward=True, center=False)
    assert (cfg.num_warps, cfg.programs_per_sm, cfg.loop_stages) == (4, 5, 1)  # RMSNorm: 5 programs of 4 warps
    assert norms.norm_config(4096, torch.bfloat16, backward=True, center=True).programs_per_sm == 4


def _check_variant(variant, dtype):
    shape = (37, 129) if variant != "packed_bwd_rows" else (75, 64)
    x = _leaf(torch.randn(shape, dtype=dtype) * 2 + 1)
    w = _leaf(torch.randn(shape[-1], dtype=dtype))
    b = _leaf(torch.randn(shape[-1], dtype=dtype))
    dy = torch.randn(shape, dtype=dtype)
    for offset in (0.0, 1.0):
        _check_against_float64(
            lambda x, w: rms_norm(x, w, 1e-6, offset),
            lambda x, w: rms_norm_reference(x, w, 1e-6, offset),
            [x, w],
            dy,
            dtype,
            ["x", "weight"],
        )
    _check_against_float64(layer_norm, layer_norm_reference, [x, w, b], dy, dtype, ["x", "weight", "bias"])
    # frozen weight, trainable bias: the split backward computes db alone
    _check_against_float64(layer_norm, layer_norm_reference, [x, w.detach(), b], dy, dtype, ["x", "weight", "bias"])


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
@pytest.mark.parametrize("shape", [(37, 129), (3, 9001)])
def test_layer_norm_optional_weight_and_bias(affine, shape):
    x = _leaf(torch.randn(shape))
    w = _leaf(torch.randn(shape[-1])) if affine == "weight" else None
    b = _leaf(torch.randn(shape[-1])) if affine == "bias" else None
    dy = torch.randn(shape)
    _check_against_float64(layer_norm, layer_norm_reference, [x, w, b], dy, torch.float32, ["x", "weight", "bias"])


@pytest.mark.parametrize("shape", [(37, 129), (3, 9001)])
def test_rms_norm_without_weight(shape):
    x = _leaf(torch.randn(shape, dtype=torch.bfloat16))
    dy = torch.randn(shape, dtype=torch.bfloat16)
    _check_against_float64(
        lambda x: rms_norm(x, None), lambda x: rms_norm_reference(x, None), [x], dy, torch.bfloat16, ["x"]
    )


@pytest.mark.parametrize("which", ["strided_rows", "transposed"])
def test_non_contiguous_inputs_and_grad(which):
    if which == "strided_rows":  # unit last stride, row stride 200: read in place
        x = torch.randn(37, 200)[:, :129]
        dy = torch.randn(37, 300)[:, 7:136]
    else:  # last dim not unit-stride: copied once
        x = torch.randn(129, 37).t()
        dy = torch.randn(129, 37).t()
    x = x.requires_grad_(True)
    w = _leaf(torch.randn(129))
    b = _leaf(torch.randn(129))
    assert not x.is_contiguous() and not dy.is_contiguous()
    _check_against_float64(rms_norm, rms_norm_reference, [x, w], dy, torch.float32, ["x", "weight"])
    _check_against_float64(layer_norm, layer_norm_reference, [x, w, b], dy, torch.float32, ["x", "weight", "bias"])


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(37, 129), (3, 9001)])
def test_frozen_weight_gives_no_dw_and_right_dx(offset, shape):
    x = _leaf(torch.randn(shape, dtype=torch.bfloat16))
    w = torch.randn(shape[-1], dtype=torch.bfloat16)  # frozen
    dy = torch.randn(shape, dtype=torch.bfloat16)
    rms_norm(x, w, offset=offset).backward(dy)
    assert w.grad is None
    x64 = _leaf(x.detach().double())
    rms_norm_reference(x64, w.double(), offset=offset).backward(dy.double())
    assert_close(x.grad, x64.grad, torch.bfloat16, "dx")


def test_frozen_input_still_gives_dw():
    x = torch.randn(37, 129)
    w = _leaf(torch.randn(129))
    b = _leaf(torch.randn(129))
    dy = torch.randn(37, 129)
    _check_against_float64(layer_norm, layer_norm_reference, [x, w, b], dy, torch.float32, ["x", "weight", "bias"])


def _hf_module(kind, hidden, eps):
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return LlamaRMSNorm(hidden, eps=eps), lambda x, w: rms_norm(x, w, eps)
    if kind == "gemma4":  # x_norm * w in fp32, as Gemma's 1 + w
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        return Gemma4RMSNorm(hidden, eps=eps), lambda x, w: rms_norm(x, w, eps, scale_in_fp32=True)
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    return GemmaRMSNorm(hidden, eps=eps), lambda x, w: rms_norm(x, w, eps, offset=1.0)


@pytest.mark.parametrize("kind", ["llama", "gemma", "gemma4"])
@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],  # fp32 master weights, bf16 activations: Llama promotes, Gemma (and Gemma 4) does not
)
def test_matches_transformers_modules(kind, x_dtype, w_dtype):
    module, ours = _hf_module(kind, 80, 1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.randn(80) * 0.5)
    module = module.to(w_dtype)
    x = _leaf(torch.randn(2, 3, 80, dtype=x_dtype))
    x_hf = _leaf(x.detach())
    w = _leaf(module.weight.detach())
    out, out_hf = ours(x, w), module(x_hf)
    assert out.dtype == out_hf.dtype and out.shape == out_hf.shape
    tol_dtype = out_hf.dtype if x_dtype == w_dtype else x_dtype
    assert_close(out, out_hf, tol_dtype, "out")
    dy = torch.randn_like(out_hf)
    out.backward(dy)
    out_hf.backward(dy)
    assert x.grad.dtype == x_hf.grad.dtype and w.grad.dtype == module.weight.grad.dtype
    assert_close(x.grad, x_hf.grad, x_dtype, "dx")
    assert_close(w.grad, module.weight.grad, x_dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_torch_module(dtype):
    module = torch.nn.LayerNorm(129, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.randn(129))
        module.bias.copy_(torch.randn(129))
    x = torch.randn(37, 129)
    ref = module(x)
    out = layer_norm(x.to(dtype), module.weight.to(dtype), module.bias.to(dtype), 1e-5)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype, "out")


def test_reference_path_without_triton(monkeypatch):
    monkeypatch.setattr(norms, "use_triton", lambda *tensors: False)
    x = torch.randn(37, 129)
    w = torch.randn(129)
    b = torch.randn(129)
    assert torch.equal(rms_norm(x, w, offset=1.0), rms_norm_reference(x, w, offset=1.0))
    assert torch.equal(layer_norm(x, w, b), layer_norm_reference(x, w, b))


def test_empty_rows():
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    out = rms_norm(x, w)
    out.sum().backward()
    assert out.shape == (0, 64) and w.grad.shape == (64,)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: rms_norm(torch.randint(0, 5, (4, 8)), torch.randn(8)), "x"),
        (lambda: rms_norm(torch.randn(4, 8, dtype=torch.float64), torch.randn(8)), "x"),
        (lambda: rms_norm(torch.randn(4, 8), torch.randn(8, dtype=torch.float64)), "weight"),
        (lambda: rms_norm(torch.randn(4, 8), torch.randn(7)), "weight"),
        (lambda: rms_norm(torch.randn(4, 8), torch.randn(8), eps=0.0), "eps"),
        (lambda: rms_norm(torch.randn(4, 8), torch.randn(8), eps=-1e-6), "eps"),
        (lambda: rms_norm(torch.randn(4, 8), None, offset=1.0), "offset"),
        (lambda: rms_norm(torch.randn(4, 0), torch.randn(0)), "x"),
        (lambda: layer_norm(torch.randn(4, 8), torch.randn(8), torch.randn(4, 2)), "bias"),
        (lambda: layer_norm(torch.randn(4, 8), None, None, eps=float("nan")), "eps"),
        (lambda: layer_norm(torch.randn(4, 8), torch.randn(8, device="meta"), None), "weight"),
    ],
)
def test_bad_input_raises_value_error(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_backward_refuses_a_weight_changed_in_place_and_reads_strided_dy(kind):
    """The kept weight (held by reference, not saved) changed in place before the backward raises as autograd
    does for saved tensors; a dy whose last stride is not 1 gives the gradients of the same dy made contiguous."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 64, generator=gen).requires_grad_()
    weight = torch.randn(64, generator=gen).requires_grad_()
    bias = torch.randn(64, generator=gen).requires_grad_()

    def norm():
        return rms_norm(x, weight) if kind == "rms" else layer_norm(x, weight, bias)

    y = norm()
    with torch.no_grad():
        weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation between forward and backward"):
        y.backward(torch.randn_like(y))
    dy = torch.randn(64, 5, 3, generator=gen).permute(2, 1, 0)  # last stride 15
    grads = []
    for grad_out in (dy, dy.contiguous()):
        x.grad = weight.grad = bias.grad = None
        norm().backward(grad_out)
        grads.append((x.grad.clone(), weight.grad.clone()))
    (gx, gw), (wx, ww) = grads
    assert_close(gx, wx, torch.float32, "dx")
    assert_close(gw, ww, torch.float32, "dweight")
