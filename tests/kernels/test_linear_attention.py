"""The Gated DeltaNet kernels: gated RMSNorm, causal conv1d and the chunked gated delta rule, forward and
backward against float64 references on odd shapes (fp32 and bf16), transformers' own torch functions, and
bad input. Shapes stay small: the kernels run under the Triton interpreter on CPU."""

import pytest
import torch

from fastplug.kernels.causal_conv import causal_conv1d, causal_conv1d_reference
from fastplug.kernels.delta_rule import gated_delta_rule, gated_delta_rule_reference
from fastplug.kernels.norms import rms_norm_gated, rms_norm_gated_reference
from tests.helpers import assert_close, rel_err


def _grads(fn, tensors, cotangents):
    outs = fn(*tensors)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o is not None]
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], wanted, [c.to(o.dtype) for o, c in pairs])
    return outs, grads


def _against_float64(fn, ref, tensors, cotangents, dtype, tol=None):
    outs, grads = _grads(fn, tensors, cotangents)
    doubles = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
    ref_outs, ref_grads = _grads(ref, doubles, [c.double() for c in cotangents])
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        if r is not None:
            assert o.shape == r.shape
            assert_close(o, r, dtype, f"output {i}", tol)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close(g, r, dtype, f"grad {i}", tol)


def _leaf(shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(shape) * scale + shift).to(dtype).requires_grad_(True)


@pytest.mark.parametrize(
    "shape, dtype", [((37, 129), torch.float32), ((2, 3, 80), torch.bfloat16), ((3, 9001), torch.float32)]
)
def test_gated_rms_norm_matches_float64(shape, dtype):
    """Llama's rounding of the normalised row, times silu(gate) in fp32; the wide row takes the looped path."""
    x, z, w = _leaf(shape, dtype, 2.0, 0.5), _leaf(shape, dtype, 2.0), _leaf(shape[-1], dtype)
    _against_float64(rms_norm_gated, rms_norm_gated_reference, [x, z, w], [torch.randn(shape)], dtype)


def test_gated_rms_norm_matches_transformers_and_rejects_bad_input():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    module = Qwen3_5RMSNormGated(48, eps=1e-6)
    with torch.no_grad():
        module.weight.add_(torch.randn(48))
    x, z = torch.randn(6, 48), torch.randn(6, 48)
    assert_close(rms_norm_gated(x, z, module.weight, 1e-6), module(x, z), torch.float32, "Qwen3_5RMSNormGated")
    with pytest.raises(ValueError, match="gate must have shape"):
        rms_norm_gated(x, z[:, :40], module.weight)
    with pytest.raises(ValueError, match="gate must have dtype"):
        rms_norm_gated(x, z.long(), module.weight)


@pytest.mark.parametrize(
    "batch, tokens, channels, kernel, bias, dtype",
    [(2, 37, 70, 4, False, torch.float32), (1, 3, 33, 4, True, torch.float32), (3, 40, 129, 3, True, torch.bfloat16)],
)
def test_causal_conv1d_matches_float64(batch, tokens, channels, kernel, bias, dtype):
    """x read as a column block of a wider projection output; fewer tokens than taps; odd channel counts."""
    x = torch.randn(batch, tokens, channels + 7)[:, :, 3 : 3 + channels].to(dtype).requires_grad_(True)
    w, b = _leaf((channels, kernel), dtype), _leaf(channels, dtype) if bias else None
    _against_float64(causal_conv1d, causal_conv1d_reference, [x, w, b], [torch.randn(batch, tokens, channels)], dtype)


def test_causal_conv1d_rejects_bad_input():
    x, w = torch.randn(1, 5, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"weight must have shape \(8, kernel_size\)"):
        causal_conv1d(x, w[:4])
    with pytest.raises(ValueError, match="kernel_size must be in"):
        causal_conv1d(x, torch.randn(8, 9))
    with pytest.raises(ValueError, match="activation must be 'silu'"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="unit stride"):
        causal_conv1d(x.transpose(1, 2).contiguous().transpose(1, 2), w)


def _rule_inputs(batch, tokens, k_heads, heads, dk, dv, dtype):
    q, k = _leaf((batch, tokens, k_heads, dk), dtype), _leaf((batch, tokens, k_heads, dk), dtype)
    v = _leaf((batch, tokens, heads, dv), dtype)
    g = (-torch.rand(batch, tokens, heads) * 0.7).to(dtype).requires_grad_(True)
    beta = torch.rand(batch, tokens, heads).to(dtype).requires_grad_(True)
    return [q, k, v, g, beta]


@pytest.mark.parametrize(
    "batch, tokens, k_heads, heads, dk, dv, dtype",
    [
        (2, 70, 2, 4, 16, 24, torch.float32),  # two chunks, the second partial; grouped values; Dv not a power of 2
        (1, 5, 1, 1, 32, 16, torch.float32),  # fewer tokens than a chunk
        (1, 130, 1, 2, 16, 80, torch.bfloat16),  # three chunks, Dv in two blocks (partials summed)
    ],
)
def test_gated_delta_rule_matches_the_recurrence_in_float64(batch, tokens, k_heads, heads, dk, dv, dtype):
    """Output and final state, and the gradients of q, k, v, g and beta through both, against the token-by-token
    recurrence in float64."""
    inputs = _rule_inputs(batch, tokens, k_heads, heads, dk, dv, dtype)
    cotangents = [torch.randn(batch, tokens, heads, dv), torch.randn(batch, heads, dk, dv)]
    _against_float64(
        lambda *t: gated_delta_rule(*t, output_final_state=True),
        lambda *t: gated_delta_rule_reference(*t, output_final_state=True),
        inputs,
        cotangents,
        dtype,
    )


def test_gated_delta_rule_equals_transformers_chunked_torch_path():
    """fp32: the Triton path and the torch path (tensors Triton cannot run) against transformers' own function."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    inputs = [t.detach() for t in _rule_inputs(2, 67, 1, 2, 16, 16, torch.float32)]
    q, k, v, g, beta = inputs
    kw = dict(initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if k.shape[2] != v.shape[2]:  # transformers 5.7 expects the layer to repeat q and k itself
        q, k = (t.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for t in (q, k))
    ref_o, ref_s = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    for implementation in ("triton", "torch"):
        o, s = gated_delta_rule(*inputs, output_final_state=True, implementation=implementation)
        assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5, implementation


def test_gated_delta_rule_rejects_bad_input():
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(1, 4, 2, 4, 8, 8, torch.float32))
    with pytest.raises(ValueError, match="q and k must have one shape"):
        gated_delta_rule(q, k[..., :4], v, g, beta)
    with pytest.raises(ValueError, match="must be a multiple of q/k's"):
        gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match=r"beta must have shape \(1, 4, 4\)"):
        gated_delta_rule(q, k, v, g, beta[..., :2])
    with pytest.raises(ValueError, match="head dims must be in"):
        gated_delta_rule(q.new_zeros(1, 4, 2, 300), k.new_zeros(1, 4, 2, 300), v, g, beta)
    with pytest.raises(ValueError, match="implementation 'fla' needs CUDA"):
        gated_delta_rule(q, k, v, g, beta, implementation="fla")
