"""Gated activations (SwiGLU, GeGLU): forward and backward against float64 references, on odd shapes and layouts."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import fastplug.kernels.activations as activations
import fastplug.kernels.tuning as kernel_tuning
from fastplug.kernels.activations import (
    ACTIVATIONS,
    geglu,
    geglu_reference,
    glu_backward,
    glu_forward,
    swiglu,
    swiglu_reference,
)
from tests.helpers import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# activation name -> (public function, float64 reference)
PUBLIC = {
    "silu": (swiglu, swiglu_reference),
    "gelu_tanh": (lambda g, u: geglu(g, u, "tanh"), lambda g, u: geglu_reference(g, u, "tanh")),
    "gelu": (lambda g, u: geglu(g, u, approximate="none"), lambda g, u: geglu_reference(g, u, "none")),
}


def _inputs(shape, dtype, scale=2.0):
    gate = (torch.randn(shape) * scale).to(dtype)
    up = torch.randn(shape).to(dtype)
    return gate, up


def _reference_grads(activation, gate, up, grad_h):
    """h, dgate, dup in float64 through autograd on the reference."""
    g64 = gate.double().requires_grad_()
    u64 = up.double().requires_grad_()
    h = PUBLIC[activation][1](g64, u64)
    h.backward(grad_h.double())
    return h.detach(), g64.grad, u64.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(37, 129), (2, 3, 200)], ids=["37x129", "2x3x200"])
def test_public_forward_backward(activation, dtype, shape):
    gate, up = _inputs(shape, dtype)
    gate.requires_grad_()
    up.requires_grad_()
    h = PUBLIC[activation][0](gate, up)
    grad_h = torch.randn(shape).to(dtype)
    h.backward(grad_h)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate.detach(), up.detach(), grad_h)
    assert h.dtype == dtype and h.shape == gate.shape
    assert_close(h, ref_h, dtype, "h")
    assert_close(gate.grad, ref_dgate, dtype, "dgate")
    assert_close(up.grad, ref_dup, dtype, "dup")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_chunks_of_fused_gate_up_and_transposed_inputs(activation):
    # gate/up as the halves of one [.., 2I] projection (row stride 2I, no copy) and as a transposed view.
    fused = torch.randn(3, 11, 2 * 96, requires_grad=True)
    gate, up = fused.chunk(2, dim=-1)
    h = PUBLIC[activation][0](gate, up)
    grad_h = torch.randn_like(h)
    h.backward(grad_h)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate.detach(), up.detach(), grad_h)
    assert_close(h, ref_h, torch.float32, "h")
    assert_close(fused.grad, torch.cat([ref_dgate, ref_dup], dim=-1), torch.float32, "d(gate_up)")

    gate_t = torch.randn(129, 37).t()
    up_t = torch.randn(129, 37).t()
    ref = PUBLIC[activation][1](gate_t.double(), up_t.double())
    assert_close(glu_forward(gate_t, up_t, activation), ref, torch.float32, "h (transposed inputs)")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_extreme_values_stay_finite(activation):
    gate = torch.tensor([[-1e4, -100.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 100.0, 1e4]])
    up = torch.randn_like(gate)
    grad_h = torch.randn_like(gate)
    h, dgate, dup = glu_backward(grad_h, gate, up, activation, recompute_h=True)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate, up, grad_h)
    assert_close(h, ref_h, torch.float32, "h")
    assert_close(dgate, ref_dgate, torch.float32, "dgate")
    assert_close(dup, ref_dup, torch.float32, "dup")


def test_matches_transformers_activations():
    from transformers.activations import ACT2FN

    gate, up = _inputs((37, 129), torch.float32)
    assert_close(swiglu(gate, up), ACT2FN["silu"](gate) * up, torch.float32, "swiglu vs ACT2FN['silu']")
    assert_close(geglu(gate, up), ACT2FN["gelu_pytorch_tanh"](gate) * up, torch.float32, "geglu vs gelu_pytorch_tanh")
    assert_close(geglu(gate, up, "none"), ACT2FN["gelu"](gate) * up, torch.float32, "geglu vs gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("recompute_h", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_glu_backward_variants(activation, dtype, recompute_h, inplace):
    gate, up = _inputs((37, 129), dtype)
    grad_h = torch.randn(37, 129).to(dtype)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate, up, grad_h)
    buffers = (grad_h.data_ptr(), gate.data_ptr(), up.data_ptr())
    h, dgate, dup = glu_backward(grad_h, gate, up, activation, recompute_h=recompute_h, inplace=inplace)
    if inplace:
        assert (dgate.data_ptr(), dup.data_ptr()) == buffers[1:]
        assert dgate is gate and dup is up
    if recompute_h:
        assert_close(h, ref_h, dtype, "h")
        assert (h.data_ptr() == buffers[0]) == inplace  # h goes into grad_h's buffer only when inplace
    else:
        assert h is None
    assert_close(dgate, ref_dgate, dtype, "dgate")
    assert_close(dup, ref_dup, dtype, "dup")


@pytest.mark.parametrize(
    "tuning",
    [dict(flat=True, tile_elements=512, num_warps=4), dict(max_block_cols=64, tile_elements=256)],
    ids=["flat", "small-2d-tiles"],
)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_tuning_variants_match_float64(request, tuning, activation):
    # The launch shapes scripts/tune_kernels.py may pick. Flat: 37 x 129 is not a multiple of the block
    # (a masked tail); the chunks of a fused gate_up are not contiguous and take the 2-D path even then.
    constants = dataclasses.replace(activations.GLU_CONSTANTS, **tuning)
    request.addfinalizer(
        kernel_tuning.override("glu", functools.partial(activations.glu_config, constants=constants)).undo
    )
    gate, up = _inputs((37, 129), torch.bfloat16)
    grad_h = torch.randn(37, 129).to(torch.bfloat16)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate, up, grad_h)
    assert_close(glu_forward(gate, up, activation), ref_h, torch.bfloat16, "h")
    for inplace in (False, True):
        h, dgate, dup = glu_backward(
            grad_h.clone(), gate.clone(), up.clone(), activation, recompute_h=True, inplace=inplace
        )
        assert_close(h, ref_h, torch.bfloat16, "h (backward)")
        assert_close(dgate, ref_dgate, torch.bfloat16, "dgate")
        assert_close(dup, ref_dup, torch.bfloat16, "dup")
    gate_up = torch.cat([gate, up], dim=-1).requires_grad_()
    g, u = gate_up.chunk(2, dim=-1)
    PUBLIC[activation][0](g, u).backward(grad_h)
    assert_close(gate_up.grad, torch.cat([ref_dgate, ref_dup], dim=-1), torch.bfloat16, "d gate_up")


def test_glu_backward_inplace_into_buffers_that_are_not_row_views():
    # Transposed buffers cannot be viewed as [rows, I]: the results are copied back into them.
    gate = (torch.randn(129, 37) * 2).t()
    up = torch.randn(129, 37).t()
    grad_h = torch.randn(129, 37).t()
    ref_h, ref_dgate, ref_dup = _reference_grads("silu", gate, up, grad_h)
    h, dgate, dup = glu_backward(grad_h, gate, up, "silu", recompute_h=True, inplace=True)
    assert h is grad_h and dgate is gate and dup is up
    assert_close(grad_h, ref_h, torch.float32, "h in grad_h")
    assert_close(gate, ref_dgate, torch.float32, "dgate in gate")
    assert_close(up, ref_dup, torch.float32, "dup in up")


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_path_without_triton(monkeypatch, inplace):
    monkeypatch.setattr(activations, "use_triton", lambda *tensors: False)
    gate, up = _inputs((5, 33), torch.float32)
    grad_h = torch.randn(5, 33)
    ref_h, ref_dgate, ref_dup = _reference_grads("gelu", gate, up, grad_h)
    assert_close(glu_forward(gate, up, "gelu"), ref_h, torch.float32, "h")
    assert_close(geglu(gate, up, "none"), ref_h, torch.float32, "geglu")
    h, dgate, dup = glu_backward(grad_h, gate, up, "gelu", recompute_h=True, inplace=inplace)
    assert_close(h, ref_h, torch.float32, "h")
    assert_close(dgate, ref_dgate, torch.float32, "dgate")
    assert_close(dup, ref_dup, torch.float32, "dup")


def test_empty_input():
    gate = torch.randn(0, 16, requires_grad=True)
    up = torch.randn(0, 16, requires_grad=True)
    h = swiglu(gate, up)
    h.sum().backward()
    assert h.shape == (0, 16) and gate.grad.shape == (0, 16)


def test_bad_input_raises_value_error_naming_the_argument():
    gate, up = _inputs((4, 8), torch.float32)
    with pytest.raises(ValueError, match="activation"):
        glu_forward(gate, up, "relu")
    with pytest.raises(ValueError, match="up"):
        swiglu(gate, up[:, :4])
    with pytest.raises(ValueError, match="up"):
        swiglu(gate, up.half())
    with pytest.raises(ValueError, match="gate"):
        swiglu(gate.to(torch.int32), up)
    with pytest.raises(ValueError, match="approximate"):
        geglu(gate, up, approximate="erf")
    with pytest.raises(ValueError, match="grad_h"):
        glu_backward(torch.randn(4, 7), gate, up, "silu")
    with pytest.raises(ValueError, match="grad_h"):
        glu_backward(torch.randn(4, 8).to(torch.float64), gate, up, "silu")


def test_reference_is_the_plain_torch_formula():
    gate, up = _inputs((3, 10), torch.float64)
    assert torch.equal(swiglu_reference(gate, up), F.silu(gate) * up)
    assert torch.equal(geglu_reference(gate, up, "none"), F.gelu(gate) * up)


REUSING = {
    "silu": lambda g, u: swiglu(g, u, reuse_inputs=True),
    "gelu_tanh": lambda g, u: geglu(g, u, "tanh", reuse_inputs=True),
}


@pytest.mark.parametrize("activation", list(REUSING))
def test_reuse_inputs_writes_the_gradients_into_gate_and_up(activation):
    """As an MLP calls it: gate and up are fresh projection outputs (views of their matmuls). The gradients
    come back in their buffers, equal to the float64 reference, and reach x through the projections."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    w_gate, w_up = torch.randn(24, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    grad_h = torch.randn(2, 5, 24)
    seen = {}

    def keep(name):
        return lambda g: seen.__setitem__(name, g)

    gate, up = F.linear(x, w_gate), F.linear(x, w_up)
    gate.register_hook(keep("dgate"))
    up.register_hook(keep("dup"))
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate.detach(), up.detach(), grad_h)
    gate_ptr, up_ptr = gate.data_ptr(), up.data_ptr()
    h = REUSING[activation](gate, up)
    h.backward(grad_h)
    assert_close(h, ref_h, torch.float32, "h")
    assert_close(seen["dgate"], ref_dgate, torch.float32, "dgate")
    assert_close(seen["dup"], ref_dup, torch.float32, "dup")
    assert seen["dgate"].data_ptr() == gate_ptr and seen["dup"].data_ptr() == up_ptr
    assert_close(x.grad, (ref_dgate @ w_gate.double() + ref_dup @ w_up.double()), torch.float32, "dx")


def test_reuse_inputs_leaves_leaves_and_shared_storages_alone():
    """A leaf's data (or a view of it) never becomes its own gradient, and gate/up halves of one buffer keep
    apart: reuse_inputs is then ignored."""
    gate, up = _inputs((6, 40), torch.float32)
    gate.requires_grad_()
    up.requires_grad_()
    before = gate.detach().clone()
    swiglu(gate, up, reuse_inputs=True).sum().backward()
    assert torch.equal(gate.detach(), before) and gate.grad.data_ptr() != gate.data_ptr()
    fused = (torch.randn(6, 80) * 1.0).requires_grad_()
    g, u = (fused * 2).chunk(2, dim=-1)
    swiglu(g, u, reuse_inputs=True).sum().backward()
    _, ref_dgate, ref_dup = _reference_grads("silu", g.detach(), u.detach(), torch.ones(6, 40))
    assert_close(fused.grad, 2 * torch.cat([ref_dgate, ref_dup], dim=-1), torch.float32, "grad through the chunks")


def test_reuse_inputs_makes_another_saver_of_gate_fail_loudly():
    """Another autograd node that saved gate would read dgate after the reuse: it raises instead."""
    x = torch.randn(4, 8, requires_grad=True)
    gate, up = x * 1.5, x * 0.5
    other = gate * x  # saves gate
    loss = swiglu(gate, up, reuse_inputs=True).sum() + other.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
