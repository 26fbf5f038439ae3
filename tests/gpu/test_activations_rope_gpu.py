"""Gated activations and RoPE at the benchmark shapes on CUDA: numbers against torch references, no timings."""

import pytest
import torch

from fastplug.kernels.activations import ACTIVATIONS, geglu, glu_backward, swiglu
from fastplug.kernels.rope import rope
from tests.helpers import assert_close
from tests.kernels.test_rope import check_rope

PUBLIC = {
    "silu": (swiglu, lambda g, u: torch.nn.functional.silu(g) * u),
    "gelu_tanh": (lambda g, u: geglu(g, u, "tanh"), lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u),
    "gelu": (lambda g, u: geglu(g, u, "none"), lambda g, u: torch.nn.functional.gelu(g) * u),
}


def _reference_grads(activation, gate, up, grad_h, dtype):
    """h, dgate, dup through autograd on the torch formula in `dtype` (fp32 for the bf16 checks at 16K x 14K)."""
    gate_r = gate.detach().to(dtype).requires_grad_()
    up_r = up.detach().to(dtype).requires_grad_()
    h = PUBLIC[activation][1](gate_r, up_r)
    h.backward(grad_h.to(dtype))
    return h.detach(), gate_r.grad, up_r.grad


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_benchmark_shape_bf16(activation):
    gate = (torch.randn(16384, 14336, device="cuda") * 2).bfloat16().requires_grad_()
    up = torch.randn(16384, 14336, device="cuda").bfloat16().requires_grad_()
    grad_h = torch.randn(16384, 14336, device="cuda").bfloat16()
    h = PUBLIC[activation][0](gate, up)
    h.backward(grad_h)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate, up, grad_h, torch.float32)
    assert_close(h, ref_h, torch.bfloat16, "h")
    assert_close(gate.grad, ref_dgate, torch.bfloat16, "dgate")
    assert_close(up.grad, ref_dup, torch.bfloat16, "dup")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_fp32_and_fused_gate_up_slices(activation):
    fused = torch.randn(2, 2048, 2 * 11008, device="cuda", requires_grad=True)
    gate, up = fused.chunk(2, dim=-1)
    grad_h = torch.randn(2, 2048, 11008, device="cuda")
    h = PUBLIC[activation][0](gate, up)
    h.backward(grad_h)
    ref_h, ref_dgate, ref_dup = _reference_grads(activation, gate, up, grad_h, torch.float64)
    assert_close(h, ref_h, torch.float32, "h")
    assert_close(fused.grad, torch.cat([ref_dgate, ref_dup], dim=-1), torch.float32, "d(gate_up)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_glu_backward_inplace_recompute_h(dtype):
    gate = (torch.randn(8192, 14336, device="cuda") * 2).to(dtype)
    up = torch.randn(8192, 14336, device="cuda").to(dtype)
    grad_h = torch.randn(8192, 14336, device="cuda").to(dtype)
    ref_h, ref_dgate, ref_dup = _reference_grads("silu", gate, up, grad_h, torch.float32)
    h, dgate, dup = glu_backward(grad_h, gate, up, "silu", recompute_h=True, inplace=True)
    assert h is grad_h and dgate is gate and dup is up
    assert_close(h, ref_h, dtype, "h")
    assert_close(dgate, ref_dgate, dtype, "dgate")
    assert_close(dup, ref_dup, dtype, "dup")


def _hf_qk(batch, heads_q, heads_k, tokens, head_dim, dtype):
    """proj(x).view(B, T, H, D).transpose(1, 2), as transformers' attention builds q and k."""

    def make(heads):
        x = torch.randn(batch, tokens, heads, head_dim, device="cuda").to(dtype)
        return x.transpose(1, 2).requires_grad_()

    return make(heads_q), make(heads_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rope_benchmark_shape_with_llama_rotary_embedding(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
    position_ids = torch.arange(4096, device="cuda")[None].repeat(4, 1) + torch.arange(4, device="cuda")[:, None]
    hidden = torch.randn(1, 1, 1, device="cuda").to(dtype)
    cos, sin = LlamaRotaryEmbedding(config).to("cuda")(hidden, position_ids)
    q, k = _hf_qk(4, 32, 8, 4096, 128, dtype)
    with torch.no_grad():
        theirs = apply_rotary_pos_emb(q, k, cos, sin)
        ours = rope(q, k, cos, sin)
    for out, ref, name in zip(ours, theirs, ("q", "k")):
        assert_close(out, ref, dtype, f"{name} vs apply_rotary_pos_emb")
    check_rope(q, k, cos, sin, dtype)


@pytest.mark.parametrize(
    "heads_q,heads_k,head_dim,rot_dim,cos_form",
    [
        (32, 8, 64, 64, "batched"),
        (16, 2, 80, 80, "broadcast"),
        (32, 32, 80, 40, "2d"),  # partial rotary
        (12, 4, 96, 96, "batched"),
        (8, 1, 256, 256, "broadcast"),  # Gemma-like head dim, MQA
        (64, 8, 128, 64, "batched"),  # many heads: several head blocks per program, partial rotary
    ],
)
def test_rope_head_dims_and_cos_forms(heads_q, heads_k, head_dim, rot_dim, cos_form):
    batch, tokens = 2, 1000
    shape = {"batched": (batch, tokens, rot_dim), "broadcast": (1, tokens, rot_dim), "2d": (tokens, rot_dim)}[cos_form]
    cos = torch.randn(shape, device="cuda").bfloat16()
    sin = torch.randn(shape, device="cuda").bfloat16()
    q, k = _hf_qk(batch, heads_q, heads_k, tokens, head_dim, torch.bfloat16)
    check_rope(q, k, cos, sin, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_inplace_on_cuda(dtype):
    """The CPU test of in-place RoPE (buffers reused, values and gradients) with CUDA tensors."""
    from tests.kernels.test_rope import test_inplace_rotates_fresh_projections_in_their_buffers

    test_inplace_rotates_fresh_projections_in_their_buffers(dtype, device="cuda")
