"""Cross-entropy kernels at LM-head sizes on CUDA (Llama-3 vocabulary), against fp32 torch references.

The references see the same bf16 inputs and materialise fp32 logits; the kernels keep bf16 chunks.
Numbers only: speed is measured by `python -m fastplug.bench micro`, never here.
"""

import pytest
import torch

from fastplug.kernels import (
    cross_entropy,
    cross_entropy_reference,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from tests.helpers import assert_close

VOCAB = 128256
IGNORE = -100


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _labels(n, vocab, ignored):
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[:ignored] = IGNORE  # a prompt that is not trained on: whole chunks are skipped
    labels[ignored::7] = IGNORE
    return labels


def _inputs(n, hidden_size, vocab, bias=False):
    hidden = _leaf(torch.randn(n, hidden_size, device="cuda", dtype=torch.bfloat16))
    weight = _leaf(torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16) * hidden_size**-0.5 * 2)
    b = _leaf(torch.randn(vocab, device="cuda", dtype=torch.bfloat16)) if bias else None
    return hidden, weight, b


def _grads(loss, tensors, grad_output):
    wanted = [t for t in tensors if t is not None]
    return torch.autograd.grad(loss, wanted, grad_output)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"softcap": 30.0, "z_loss": 1e-4, "reduction": "sum"},
        {"label_smoothing": 0.1, "logit_scale": 0.5, "num_items_in_batch": 5000},
    ],
    ids=["llama", "gemma2_softcap_zloss_sum", "smoothing_scale_num_items"],
)
def test_fused_linear_cross_entropy_llama3_head(kw):
    n, hidden_size = 4096, 2048
    tensors = _inputs(n, hidden_size, VOCAB, bias="logit_scale" in kw)
    labels = _labels(n, VOCAB, ignored=1100)
    grad_output = torch.tensor(1.0 if kw.get("reduction") != "sum" else 1 / 3000, device="cuda")

    loss = fused_linear_cross_entropy(tensors[0], tensors[1], labels, bias=tensors[2], **kw)
    grads = _grads(loss, tensors, grad_output)
    ref = fused_linear_cross_entropy_reference(tensors[0], tensors[1], labels, bias=tensors[2], **kw)
    assert_close(loss, ref, torch.bfloat16, "loss")
    ref_grads = _grads(ref, tensors, grad_output)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == torch.bfloat16
        assert_close(g, r, torch.bfloat16, f"grad {name}")


def test_fused_reduction_none_recomputes_per_row():
    n, hidden_size = 1024, 2048
    hidden, weight, _ = _inputs(n, hidden_size, VOCAB)
    labels = _labels(n, VOCAB, ignored=300)
    grad_output = torch.rand(n, device="cuda")
    loss = fused_linear_cross_entropy(hidden, weight, labels, reduction="none", softcap=30.0)
    grads = _grads(loss, (hidden, weight), grad_output)
    ref = fused_linear_cross_entropy_reference(hidden, weight, labels, reduction="none", softcap=30.0)
    ref_grads = _grads(ref, (hidden, weight), grad_output)
    assert_close(loss, ref, torch.bfloat16, "loss")
    assert_close(grads[0], ref_grads[0], torch.bfloat16, "grad hidden")
    assert_close(grads[1], ref_grads[1], torch.bfloat16, "grad weight")


def test_fused_memory_stays_near_inputs_and_grads():
    """The issue's target shape: at most 256 MiB above inputs and their gradients (logits would be 4 GiB)."""
    n, hidden_size = 8192, 4096
    hidden, weight, _ = _inputs(n, hidden_size, VOCAB)
    labels = _labels(n, VOCAB, ignored=0)
    torch.cuda.synchronize()
    inputs_and_grads = 2 * torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(hidden, weight, labels).backward()
    torch.cuda.synchronize()
    extra_mib = (torch.cuda.max_memory_allocated() - inputs_and_grads) / 2**20
    assert extra_mib <= 256, f"{extra_mib:.0f} MiB above inputs and their gradients"
    assert torch.isfinite(weight.grad.float().norm()) and torch.isfinite(hidden.grad.float().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_on_materialised_llama3_logits(dtype):
    n = 2048
    logits = _leaf(torch.randn(n, VOCAB, device="cuda", dtype=dtype) * 4)
    labels = _labels(n, VOCAB, ignored=500)
    kw = {"label_smoothing": 0.1, "softcap": 30.0, "z_loss": 1e-4}
    loss = cross_entropy(logits, labels, **kw)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = _leaf(logits.detach().float())
    ref = cross_entropy_reference(ref_logits, labels, **kw)
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    assert_close(loss, ref, dtype, "loss")
    assert_close(grad, ref_grad, dtype, "grad logits")
