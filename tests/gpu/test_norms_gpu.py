"""rms_norm / layer_norm on CUDA at realistic shapes: numbers against float64 references and transformers."""

import pytest
import torch

from fastplug.kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from tests.helpers import assert_close

# (shape, dtype): a 7B-class batch, a wide row on the looped path, a q/k norm over head dim 128
CASES = [
    ((16384, 4096), torch.bfloat16),
    ((8, 65536), torch.bfloat16),
    ((8, 65536), torch.float32),
    ((4, 1024, 3000), torch.float16),
    ((2, 2048, 32, 128), torch.bfloat16),
]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _check(fn, ref_fn, tensors, dy, dtype, names):
    out = fn(*tensors)
    grads = torch.autograd.grad(out, tensors, dy)
    doubles = [_leaf(t.double()) for t in tensors]
    ref_out = ref_fn(*doubles)
    ref_grads = torch.autograd.grad(ref_out, doubles, dy.double())
    assert out.shape == ref_out.shape
    assert_close(out, ref_out, dtype, "out")
    for name, t, g, ref_g in zip(names, tensors, grads, ref_grads):
        assert g.dtype == t.dtype
        assert_close(g, ref_g, dtype, f"d{name}")


@pytest.mark.parametrize("shape, dtype", CASES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_gpu(shape, dtype, offset):
    x = _leaf(torch.randn(shape, device="cuda", dtype=dtype) * 3 + 0.5)
    w = _leaf(torch.randn(shape[-1], device="cuda", dtype=dtype))
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    _check(
        lambda x, w: rms_norm(x, w, 1e-6, offset),
        lambda x, w: rms_norm_reference(x, w, 1e-6, offset),
        [x, w],
        dy,
        dtype,
        ["x", "weight"],
    )


@pytest.mark.parametrize("shape, dtype", CASES)
def test_layer_norm_gpu(shape, dtype):
    x = _leaf(torch.randn(shape, device="cuda", dtype=dtype) * 2 + 4)
    w = _leaf(torch.randn(shape[-1], device="cuda", dtype=dtype))
    b = _leaf(torch.randn(shape[-1], device="cuda", dtype=dtype))
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    _check(layer_norm, layer_norm_reference, [x, w, b], dy, dtype, ["x", "weight", "bias"])


def test_frozen_weight_and_non_contiguous_gpu():
    x = _leaf(torch.randn(4096, 2, 4096, device="cuda", dtype=torch.bfloat16))[:, 1]  # row stride 8192
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = rms_norm(x, w)
    (dx,) = torch.autograd.grad(out, [x], dy)
    x64 = _leaf(x.double())
    (ref_dx,) = torch.autograd.grad(rms_norm_reference(x64, w.double()), [x64], dy.double())
    assert_close(dx, ref_dx, torch.bfloat16, "dx")


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_matches_transformers_modules_gpu(kind, w_dtype):
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Module
    else:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Module
    module = Module(4096, eps=1e-6).cuda()
    with torch.no_grad():
        module.weight.copy_(torch.randn(4096) * 0.5)
    module = module.to(w_dtype)
    x = _leaf(torch.randn(4, 1024, 4096, device="cuda", dtype=torch.bfloat16))
    x_hf = _leaf(x)
    w = _leaf(module.weight)
    out = rms_norm(x, w, 1e-6, 1.0 if kind == "gemma" else 0.0)
    out_hf = module(x_hf)
    assert out.dtype == out_hf.dtype and out.shape == out_hf.shape
    assert_close(out, out_hf, torch.bfloat16, "out")
    dy = torch.randn_like(out_hf)
    out.backward(dy)
    out_hf.backward(dy)
    assert_close(x.grad, x_hf.grad, torch.bfloat16, "dx")
    assert_close(w.grad, module.weight.grad, torch.bfloat16, "dweight")
