"""Fused LoRA QKV / O / MLP at Llama-3.2-1B shapes on CUDA, bf16, against peft's modules in float64."""

import pytest
import torch

from fastplug.kernels.lora import lora_linear, lora_qkv
from fastplug.kernels.rope import rope
from fastplug.models.peft_lora import lora_projection
from tests.helpers import assert_close
from tests.kernels.test_lora import assert_matches_peft, fused_mlp, fused_qkv, layers, peft_block, peft_mlp, peft_qkv

# hidden 2048, intermediate 8192, 32 query heads and 8 key/value heads of 64; LoRA rank 16 on every projection
LLAMA_1B = dict(hidden=2048, intermediate=8192, q_out=32 * 64, kv_out=8 * 64)
BATCH, SEQ = 4, 512


def llama_1b_block(**lora):
    return peft_block(torch.bfloat16, device="cuda", sizes=LLAMA_1B, r=16, lora_alpha=32, **lora)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_llama_1b_attention_projections(qkv_bias):
    model, ref = llama_1b_block(qkv_bias=qkv_bias, use_rslora=qkv_bias)
    x = torch.randn(BATCH, SEQ, LLAMA_1B["hidden"], device="cuda")
    kv = LLAMA_1B["kv_out"]
    assert_matches_peft(model, ref, fused_qkv, peft_qkv, x, [LLAMA_1B["q_out"], kv, kv], torch.bfloat16)
    o = torch.randn(BATCH, SEQ, LLAMA_1B["q_out"], device="cuda")
    fused_o = lambda m, t: lora_linear(t, lora_projection(m.o_proj))  # noqa: E731
    assert_matches_peft(model, ref, fused_o, lambda m, t: m.o_proj(t), o, [LLAMA_1B["hidden"]], torch.bfloat16)


def test_llama_1b_qkv_with_rotary_in_the_node():
    """RoPE in place inside the QKV node on CUDA (aliased loads and stores in the rope kernel) equals the
    projections followed by the separate rope op, forward and every gradient, in bf16."""
    model, _ = llama_1b_block()
    m = layers(model)
    projs = [lora_projection(p) for p in (m.q_proj, m.k_proj, m.v_proj)]
    x = torch.randn(BATCH, SEQ, LLAMA_1B["hidden"], device="cuda", dtype=torch.bfloat16)
    angles = torch.arange(SEQ, device="cuda")[:, None] * (1e4 ** -(torch.arange(32, device="cuda") / 32))
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16).expand(BATCH, -1, -1)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16).expand(BATCH, -1, -1)
    grads_out = [
        torch.randn(BATCH, SEQ, n, device="cuda", dtype=torch.bfloat16)
        for n in (LLAMA_1B["q_out"], LLAMA_1B["kv_out"], LLAMA_1B["kv_out"])
    ]

    def run(in_node):
        model.zero_grad(set_to_none=True)
        t = x.clone().requires_grad_()
        if in_node:
            outs = lora_qkv(t, *projs, rotary=(cos, sin, 64))
        else:
            q, k, v = lora_qkv(t, *projs)
            q4, k4 = (y.view(BATCH, SEQ, -1, 64).transpose(1, 2) for y in (q, k))
            q4, k4 = rope(q4, k4, cos, sin)
            outs = (q4.transpose(1, 2).reshape(q.shape), k4.transpose(1, 2).reshape(k.shape), v)
        torch.autograd.backward(outs, grads_out)
        return [o.detach() for o in outs], t.grad, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (outs, dx, grads), (ref_outs, ref_dx, ref_grads) = run(True), run(False)
    for out, ref in zip(outs, ref_outs):
        assert_close(out, ref, torch.bfloat16, "output")
    assert_close(dx, ref_dx, torch.bfloat16, "dX")
    assert len(grads) == len(ref_grads) > 0
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, torch.bfloat16, "LoRA gradient")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_llama_1b_mlp(activation):
    model, ref = llama_1b_block()
    x = torch.randn(BATCH, SEQ, LLAMA_1B["hidden"], device="cuda")
    fused, reference = fused_mlp(activation), peft_mlp(activation)
    assert_matches_peft(model, ref, fused, reference, x, [LLAMA_1B["hidden"]], torch.bfloat16)


def test_llama_1b_disabled_adapter_is_the_base_model():
    model, ref = llama_1b_block()
    x = torch.randn(BATCH, SEQ, LLAMA_1B["hidden"], device="cuda")
    with model.disable_adapter(), ref.disable_adapter(), torch.no_grad():
        assert lora_projection(layers(model).up_proj).lora_A is None
        fused = fused_mlp("silu")(layers(model), x.bfloat16())
        assert_close(fused, peft_mlp("silu")(layers(ref), x.double()), torch.bfloat16)
