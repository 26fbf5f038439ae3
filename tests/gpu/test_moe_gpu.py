"""MoE kernels at Qwen3-MoE-like sizes on CUDA (bf16 and fp32) against float64 references, and the tiny MoE
families patched on the GPU's transformers version."""

import pytest
import torch

from fastplug.kernels.moe import (
    ExpertLoRA,
    grouped_gemm,
    grouped_gemm_reference,
    moe_experts,
    moe_experts_reference,
    moe_router,
    moe_router_reference,
)
from tests.helpers import assert_close, rel_err
from tests.models import test_moe_models


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_large(dtype):
    E, K, N, T = 64, 2048, 768, 4096
    counts = torch.randint(0, 2 * T // E, (E,), device="cuda")
    counts[3], counts[7] = 0, 1
    offsets = counts.cumsum(0).to(torch.int32)
    M = int(offsets[-1])
    x = torch.randn(T, K, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(E, N, K, device="cuda") / K**0.5).to(dtype).requires_grad_()
    rw = torch.rand(M, device="cuda", requires_grad=True)
    kw = dict(gather_index=torch.randint(0, T, (M,), device="cuda"), scatter_index=torch.randperm(M, device="cuda"))
    out = grouped_gemm(x, w, offsets, row_weights=rw, **kw)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, rw)]
    ref = grouped_gemm_reference(ref_in[0], ref_in[1], offsets, row_weights=ref_in[2], **kw)
    assert_close(out, ref, dtype, "out")
    grad = torch.randn_like(out)
    for name, g, r in zip(
        ("dx", "dw", "drw"), torch.autograd.grad(out, (x, w, rw), grad), torch.autograd.grad(ref, ref_in, grad.double())
    ):
        assert_close(g, r, dtype, name)


@pytest.mark.parametrize("lora", [False, True])
def test_moe_experts_qwen3_shape(lora):
    T, H, I, E, k, r = 2048, 2048, 768, 64, 8, 16
    x = torch.randn(T, H, device="cuda").bfloat16().requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16().requires_grad_()
    down = (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    adapters = [
        (torch.randn(*s, device="cuda") / 8).requires_grad_() for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))
    ]
    inputs = [x, gate_up, down, logits] + (adapters if lora else [])
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    outs = []
    for fn, args in ((moe_experts, inputs), (moe_experts_reference, inputs64)):
        weights, index = moe_router(args[3], k) if fn is moe_experts else moe_router_reference(args[3], k)
        kw = dict(gate_up_lora=ExpertLoRA(*args[4:6], 2.0), down_lora=ExpertLoRA(*args[6:8], 2.0)) if lora else {}
        y = fn(args[0], args[1], args[2], index, weights.to(args[0].dtype), **kw)
        grad = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(y.dtype)
        outs.append([y, *torch.autograd.grad(y, args, grad)])
    for i, (got, want) in enumerate(zip(*outs)):
        assert_close(got, want, torch.bfloat16, f"output {i}", tol=2e-2)


def test_moe_experts_frozen_down_mixtral_like():
    """The split path (frozen down projection: ExpertsUp with the activation in the gate_up GEMM's epilogue,
    ExpertsDown) at Mixtral-like widths: 8 experts top-2, wide experts; x, gate_up and router grads."""
    T, H, I, E, k = 2048, 1024, 3584, 8, 2
    x = torch.randn(T, H, device="cuda").bfloat16().requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16().requires_grad_()
    down = (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16()
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    inputs = [x, gate_up, logits]
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    outs = []
    for fn, (xx, gu, lg) in ((moe_experts, inputs), (moe_experts_reference, inputs64)):
        weights, index = moe_router(lg, k) if fn is moe_experts else moe_router_reference(lg, k)
        y = fn(xx, gu, down.to(xx.dtype), index, weights.to(xx.dtype))
        grad = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).to(y.dtype)
        outs.append([y, *torch.autograd.grad(y, [xx, gu, lg], grad)])
    assert "ExpertsDown" in type(outs[0][0].grad_fn).__name__
    for name, got, want in zip(("out", "dx", "dgate_up", "dlogits"), *outs):
        assert_close(got, want, torch.bfloat16, name, tol=2e-2)


def test_moe_experts_gpt_oss_shape():
    """gpt-oss-20b's experts (32 of 2880 -> 2880, top-4) in bf16: [E, in, out] weights as transposed views, gate/up
    interleaved, biases, the clamped SwiGLU, LoRA on both weights; every gradient against float64 (the loop's
    layout is transformers' GptOssExperts', tests/kernels/test_moe.py)."""
    T, H, I, E, k, r = 1024, 2880, 2880, 32, 4, 16
    rand = lambda *s, scale=1.0: (scale * torch.randn(*s, device="cuda")).bfloat16().requires_grad_()  # noqa: E731
    x = rand(T, H)
    gate_up, down = rand(E, H, 2 * I, scale=H**-0.5), rand(E, I, H, scale=I**-0.5)  # gpt-oss's storage
    biases = [rand(E, 2 * I, scale=0.1), rand(E, H, scale=0.1)]
    adapters = [rand(*s, scale=1 / 8) for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))]
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    inputs = [x, gate_up, down, *biases, logits, *adapters]
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    outs = []
    # fastplug's kernels, torch's maths in bf16 (the loop transformers runs) and the float64 truth: the clamped
    # SwiGLU's gradient is cut where a gate crosses the clamp, and bf16 rounding moves gates across it, so the bound
    # is torch's own bf16 error where that is larger than the kernel test's 2e-2
    for fn, args in ((moe_experts, inputs), (moe_experts_reference, inputs), (moe_experts_reference, inputs64)):
        weights, index = moe_router(args[5], k) if fn is moe_experts else moe_router_reference(args[5], k)
        y = fn(
            args[0], args[1].transpose(1, 2), args[2].transpose(1, 2), index, weights.to(args[0].dtype),
            gate_up_lora=ExpertLoRA(*args[6:8], 2.0), down_lora=ExpertLoRA(*args[8:10], 2.0),
            gate_up_bias=args[3], down_bias=args[4], interleaved=True, activation="clamped_swiglu",
            swiglu_alpha=1.702, swiglu_limit=7.0,
        )  # fmt: skip
        grad = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(y.dtype)
        outs.append([y, *torch.autograd.grad(y, args, grad)])
    names = ("out", "dx", "dgate_up", "ddown", "dgate_up_bias", "ddown_bias", "dlogits", "dA1", "dB1", "dA2", "dB2")
    for name, got, torch_bf16, want in zip(names, *outs):
        torch_error = rel_err(torch_bf16, want)
        bound = max(2e-2, 2 * torch_error)
        assert_close(got, want, torch.bfloat16, f"{name} (torch's bf16: {torch_error:.2e})", tol=bound)


@pytest.mark.parametrize("family", test_moe_models.MOE_FAMILIES)
def test_tiny_moe_families_on_gpu(family):
    test_moe_models.test_moe_full_finetuning_matches_and_restores(family)
    test_moe_models.test_moe_lora_matches_peft(family, True)
