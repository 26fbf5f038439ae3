"""Qwen3.5's Gated DeltaNet kernels on CUDA at real widths (head dim 128, grouped values, many chunks): the delta
rule (fastplug's Triton scan, and fla's kernels when flash-linear-attention is found: installed, or unpacked where
$FASTPLUG_BENCH_FLA points) against float64, no worse than torch's own chunked maths at the same precision; the
causal conv1d and the gated RMSNorm at a layer's widths; a patched bf16 Qwen3.5 that the self-check keeps whole."""

import pytest
import torch

from fastplug.kernels import delta_rule
from fastplug.kernels.causal_conv import causal_conv1d, causal_conv1d_reference
from fastplug.kernels.norms import rms_norm_gated, rms_norm_gated_reference
from tests.helpers import TOL, assert_close, rel_err


def _why_no_fla() -> str | None:
    """Why fla's kernels cannot run here, or None. A refusal on this GPU is decided first, without putting fla
    on sys.path: transformers' Qwen3.5 modules created later in this worker would pick up fla's kernels and
    raise in their forward."""
    from fastplug.bench import _fla

    refused = delta_rule.fla_refusal(torch.device("cuda"))
    if refused is not None:
        return refused
    try:
        _fla.select(True)
    except RuntimeError as exc:
        return str(exc)
    delta_rule.fla_available.cache_clear()
    delta_rule._fla_chunk_rule.cache_clear()
    return None if delta_rule._fla_chunk_rule() is not None else "flash-linear-attention not found"


def _inputs(dtype, batch=2, tokens=1000, k_heads=4, heads=8, dim=128):
    q, k = (torch.randn(batch, tokens, k_heads, dim, device="cuda") for _ in range(2))
    v = torch.randn(batch, tokens, heads, dim, device="cuda")
    g = -torch.nn.functional.softplus(torch.randn(batch, tokens, heads, device="cuda")) * 2
    beta = torch.rand(batch, tokens, heads, device="cuda")
    return [
        t.to(dtype).requires_grad_(True) if i != 3 else t.requires_grad_(True) for i, t in enumerate((q, k, v, g, beta))
    ]


def _run(inputs, do, **kw):
    o, _ = delta_rule.gated_delta_rule(*inputs, **kw)
    return [o, *torch.autograd.grad(o, inputs, do)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("implementation", ["triton", "fla"])
def test_gated_delta_rule_gpu(dtype, implementation):
    if implementation == "fla" and (reason := _why_no_fla()) is not None:
        pytest.skip(reason)
    inputs = _inputs(dtype)
    do = torch.randn(inputs[2].shape, device="cuda", dtype=dtype)
    exact = [t.detach().double().requires_grad_(True) for t in inputs]
    o, _ = delta_rule._scan_reference(delta_rule._prepare(*exact).parts, False)
    o = delta_rule._finish(o, exact[0].shape[0], exact[0].shape[1], torch.float64)
    truth = [o, *torch.autograd.grad(o, exact, do.double())]
    torch_maths = _run(inputs, do, implementation="torch")  # transformers' chunked maths in this dtype
    ours = _run(inputs, do, implementation=implementation)
    for name, got, base, ref in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), ours, torch_maths, truth):
        bound = max(TOL[dtype], 2 * rel_err(base, ref))
        assert_close(got, ref, dtype, f"{implementation} {name}", tol=bound)


def test_causal_conv_and_gated_norm_gpu():
    """A 2B-class layer's shapes: the conv over q, k and v (8192 channels), the norm over 16 heads of 128."""
    x = torch.randn(2, 2048, 8192 + 64, device="cuda", dtype=torch.bfloat16)[:, :, :8192].requires_grad_(True)
    w = torch.randn(8192, 4, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(2, 2048, 8192, device="cuda", dtype=torch.bfloat16)
    exact = [t.detach().double().requires_grad_(True) for t in (x, w)]
    for got, ref in zip(
        [causal_conv1d(x, w), *torch.autograd.grad(causal_conv1d(x, w), (x, w), dy)],
        [causal_conv1d_reference(*exact), *torch.autograd.grad(causal_conv1d_reference(*exact), exact, dy.double())],
    ):
        assert_close(got, ref, torch.bfloat16, "causal conv1d")
    h, z = (torch.randn(2 * 2048 * 16, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(2))
    weight = torch.randn(128, device="cuda").requires_grad_(True)
    dy = torch.randn_like(h)
    exact = [t.detach().double().requires_grad_(True) for t in (h, z, weight)]
    out, ref = rms_norm_gated(h, z, weight), rms_norm_gated_reference(*exact)
    for got, want in zip(
        [out, *torch.autograd.grad(out, (h, z, weight), dy)], [ref, *torch.autograd.grad(ref, exact, dy.double())]
    ):
        assert_close(got, want, torch.bfloat16, "gated RMSNorm")


def test_patched_qwen3_5_keeps_every_kind_gpu():
    """A bf16 Qwen3.5 (4 layers, hidden 512): the self-check keeps every kind; the loss is transformers'."""
    import copy

    import transformers

    from fastplug.patch.engine import patch_model

    config = transformers.Qwen3_5TextConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, vocab_size=1024, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
        linear_num_value_heads=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 1024, (2, 300), device="cuda")
    with patch_model(model, gradient_checkpointing=False) as handle:
        assert handle.check.ran and not handle.check.declined, handle.summary()
        assert handle.counts["linear_attention"] == 3 and handle.counts["rms_norm_gated"] == 3
        model.train(), reference.train()
        loss, ref = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        assert_close(loss.float(), ref.float(), torch.bfloat16, "loss")
