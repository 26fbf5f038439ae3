"""fused_linear_log_probs (the per-token log-probs and entropies of RL trainers) against a float64 reference,
under the Triton interpreter: values and gradients of both outputs, temperature after the softcap, ignored
rows, odd sizes over several vocab blocks and row chunks, and bad input."""

import importlib

import pytest
import torch

from fastplug.kernels import fused_linear_cross_entropy, fused_linear_log_probs, fused_linear_log_probs_reference
from tests.helpers import assert_close, rel_err

ce_module = importlib.import_module("fastplug.kernels.cross_entropy")

IGNORE = -100
VOCAB, HIDDEN = 333, 24  # odd: the last vocab block and the last row chunk are partial
OPTIONS = {
    "plain": {},
    "temperature_bias": {"temperature": 0.7},
    "softcap_scale_temperature": {"temperature": 1.3, "softcap": 3.0, "logit_scale": 0.8},
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(ce_module, "ROW_BLOCK", 128)  # 3 blocks per row
    monkeypatch.setattr(ce_module, "LOGITS_CHUNK_BYTES", 8 * VOCAB * 4)  # 8 fp32 / 16 bf16 rows per chunk


def _inputs(shape, dtype, bias):
    leaf = lambda t: t.to(dtype).requires_grad_(True)  # noqa: E731
    hidden = leaf(torch.randn(*shape, HIDDEN))
    weight = leaf(torch.randn(VOCAB, HIDDEN) * HIDDEN**-0.5 * 3)
    b = leaf(torch.randn(VOCAB)) if bias else None
    labels = torch.randint(0, VOCAB, shape)
    flat = labels.view(-1)
    flat[: flat.numel() // 3] = IGNORE  # a prompt-like run of ignored rows (a whole chunk), plus scattered ones
    flat[flat.numel() // 3 + 1 :: 4] = IGNORE
    return hidden, weight, b, labels


def _outputs_and_grads(fn, tensors, labels, kw, weights):
    """(log_probs, entropy) of fn on tensors (hidden, weight, bias or None) and, for each (w_lp, w_ent) in
    weights, the gradients of sum(w_lp * log_probs + w_ent * entropy) (a None weight leaves that output out)."""
    log_probs, entropy = fn(tensors[0], tensors[1], labels, bias=tensors[2], entropy=True, **kw)
    leaves = [t for t in tensors if t is not None]
    grads = []
    for w_lp, w_ent in weights:
        loss = sum((out * w.to(out.dtype)).sum() for out, w in ((log_probs, w_lp), (entropy, w_ent)) if w is not None)
        grads.append(torch.autograd.grad(loss, leaves, retain_graph=True))
    return log_probs, entropy, grads


def _torch_in(dtype, tensors, labels, kw):
    """What plain torch computes at `dtype`: logits from a `dtype` matmul, the rest in fp32 (TRL's own path)."""

    def fn(h, w, labels, bias=None, entropy=True, **kw):
        logits = h @ w.t() + (0 if bias is None else bias)
        return fused_linear_log_probs_reference(logits.float(), torch.eye(VOCAB), labels, entropy=entropy, **kw)

    return fn


@pytest.mark.parametrize(
    "dtype, option",
    [(torch.float32, "plain"), (torch.float32, "softcap_scale_temperature"), (torch.bfloat16, "temperature_bias")],
)
def test_log_probs_and_entropy_match_float64(dtype, option):
    kw = OPTIONS[option]
    hidden, weight, bias, labels = _inputs((2, 7), dtype, bias=option != "plain")
    tensors = (hidden, weight, bias)
    as64 = [None if t is None else t.detach().double().requires_grad_(True) for t in tensors]
    g_lp, g_ent = torch.randn(labels.shape), torch.randn(labels.shape)
    weights = [(g_lp, g_ent), (g_lp, None), (None, g_ent)]  # both outputs, the log-probs alone, the entropy alone
    names = ["both", "log_probs", "entropy"]
    out = _outputs_and_grads(fused_linear_log_probs, tensors, labels, kw, weights)
    ref = _outputs_and_grads(fused_linear_log_probs_reference, as64, labels, kw, weights)
    bounds = [None] * (2 + 3 * len(names))
    if dtype != torch.float32:  # no worse than torch at this precision (docs/contributing.md, tolerances)
        theirs = _outputs_and_grads(_torch_in(dtype, tensors, labels, kw), tensors, labels, kw, weights)
        flat_theirs = [theirs[0], theirs[1], *[g for gs in theirs[2] for g in gs]]
        flat_ref = [ref[0], ref[1], *[g for gs in ref[2] for g in gs]]
        bounds = [2 * rel_err(t, r) + 1e-3 for t, r in zip(flat_theirs, flat_ref)]
    log_probs, entropy, grads = out
    assert log_probs.shape == entropy.shape == labels.shape and log_probs.dtype == torch.float32
    assert_close(log_probs, ref[0], dtype, "log_probs", bounds[0])
    assert_close(entropy, ref[1], dtype, "entropy", bounds[1])
    ignored = labels == IGNORE
    assert (log_probs[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert (log_probs[~ignored] < 0).all() and (entropy[~ignored] > 0).all()
    leaves = [t for t in tensors if t is not None]
    bound = iter(bounds[2:])
    for name, gs, ref_gs in zip(names, grads, ref[2]):
        for arg, g, ref_g, t in zip(("hidden", "weight", "bias"), gs, ref_gs, leaves):
            assert g.dtype == t.dtype and g.shape == t.shape
            assert_close(g, ref_g, dtype, f"grad {arg} ({name})", next(bound))
        assert (gs[0][ignored] == 0).all(), "ignored rows pass no gradient"


def test_log_probs_are_minus_the_cross_entropy_and_run_without_grad():
    hidden, weight, _, labels = _inputs((29,), torch.float32, bias=False)
    log_probs, entropy = fused_linear_log_probs(hidden, weight, labels)
    assert entropy is None
    ce = fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
    assert torch.equal(log_probs, -ce)
    with torch.no_grad():  # the old-policy and reference passes
        again, entropy = fused_linear_log_probs(hidden, weight, labels, temperature=2.0, entropy=True)
    assert not again.requires_grad and not entropy.requires_grad
    expected = fused_linear_log_probs_reference(hidden, weight, labels, temperature=2.0, entropy=True)
    assert_close(again, expected[0], torch.float32)
    # no rows, and rows that are all ignored: zeros and zero gradients
    for n in (0, 5):
        h = torch.randn(n, HIDDEN, requires_grad=True)
        out, ent = fused_linear_log_probs(h, weight, torch.full((n,), IGNORE), entropy=True)
        assert out.shape == (n,) and not out.any() and not ent.any()
        (grad,) = torch.autograd.grad((out + ent).sum(), h)
        assert not grad.any()


@pytest.mark.torch_reference  # the path a bf16 GRPO trainer takes on CPU; autocast made its outputs bf16 (issue 40)
@pytest.mark.parametrize("bias", [False, True])
def test_torch_reference_under_autocast_returns_fp32(bias):
    hidden, weight, b, labels = _inputs((3, 7), torch.bfloat16, bias)
    tensors = [t for t in (hidden, weight, b) if t is not None]
    kw = dict(temperature=0.7, softcap=3.0, logit_scale=0.8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, entropy = fused_linear_log_probs(hidden, weight, labels, bias=b, entropy=True, **kw)
    as64 = [t.detach().double().requires_grad_(True) for t in tensors]
    z = as64[0] @ as64[1].t() + (as64[2] if bias else 0)
    log_p = torch.log_softmax(3.0 * torch.tanh(z * 0.8 / 3.0) / 0.7, dim=-1)
    valid = labels != IGNORE
    expected = torch.where(valid, log_p.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    expected_entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    assert log_probs.dtype == entropy.dtype == torch.float32  # as the kernel returns
    assert_close(log_probs, expected, torch.float32, "log_probs")  # fp32 logits, as the kernel's fp32 accumulation
    assert_close(entropy, expected_entropy, torch.float32, "entropy")
    g_lp, g_ent = torch.randn(labels.shape), torch.randn(labels.shape)
    grads = torch.autograd.grad((log_probs * g_lp + entropy * g_ent).sum(), tensors)
    ref_grads = torch.autograd.grad((expected * g_lp + expected_entropy * g_ent).sum(), as64)
    for name, g, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == torch.bfloat16
        assert_close(g, ref, torch.bfloat16, f"grad {name}")


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": True}, ValueError, "temperature"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"logit_scale": 0.0}, ValueError, "logit_scale"),
        ({"ignore_index": None}, ValueError, "ignore_index"),
        ({"labels": torch.arange(5)}, ValueError, "labels"),
        ({"labels": torch.zeros(6)}, ValueError, "labels"),
        ({"weight": torch.randn(50, 31)}, ValueError, "hidden"),
        ({"hidden": torch.randn(6, 32).int()}, ValueError, "hidden"),
        ({"labels": torch.tensor([0, 1, 2, 50, 4, 5])}, IndexError, "out of bounds"),
        ({"labels": torch.tensor([0, 1, -3, 3, 4, 5])}, IndexError, "out of bounds"),
    ],
)
def test_bad_input_names_the_argument(change, error, match):
    kw = {"hidden": torch.randn(6, 32), "weight": torch.randn(50, 32), "labels": torch.arange(6)}
    kw.update(change)
    with pytest.raises(error, match=match):
        fused_linear_log_probs(kw.pop("hidden"), kw.pop("weight"), kw.pop("labels"), **kw)
