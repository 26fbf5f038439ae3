"""The self-check's float64 arbiter: a patch that differs from the original modules by more than the bound is kept
when a float64 run of the original modules shows it as close to the truth as the original (the original may be the
side that is off: bf16 rounding, a random-init MoE's routing ties), and still declined, with both errors in the
warning, when it is the one that is off."""

import warnings

import pytest
import torch
from transformers.models.llama import modeling_llama

import fastplug.models.norms
from fastplug.patch import self_check
from fastplug.patch.engine import patch_model
from tests.models.tiny import tiny_model

pytestmark = pytest.mark.torch_reference  # the kernels' numbers are tests/kernels'; here, the check's decision


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    self_check.forget()
    yield
    self_check.forget()


def _coarse_original_norm(monkeypatch, bits_lost: int = 6):
    """transformers' RMSNorm as an implementation that keeps `bits_lost` bits fewer than its dtype holds (its
    output on a grid of 2**bits_lost eps; gradients pass straight through): in bf16 it is the one that is off, and
    in float64 its grid is nothing."""
    forward = modeling_llama.LlamaRMSNorm.forward

    def coarse(self, hidden_states):
        out = forward(self, hidden_states)
        step = 2**bits_lost * torch.finfo(out.dtype).eps
        return out + (torch.round(out / step) * step - out).detach()

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", coarse)


def _patch(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patch_model(model)
    return handle, [str(w.message) for w in caught if "disagrees" in str(w.message)]


def test_a_patch_closer_to_float64_than_a_coarse_original_is_kept(monkeypatch):
    _coarse_original_norm(monkeypatch)
    model = tiny_model("llama", seed=3).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle, disagreements = _patch(model)
    report = handle.check
    assert not disagreements and not report.declined, handle.summary()
    assert "rms_norm" in report.passed
    (note,) = report.float64
    assert note.startswith("float64 sided with the patches") and "with the original modules" in note, note
    assert report.float64_seconds > 0 and "in float64" in handle.summary()
    for name, p in model.named_parameters():  # the float64 run put every weight back, dtype and bits
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name]), name
    handle.restore()


def test_without_a_float64_run_the_difference_declines_as_before(monkeypatch):
    """The same coarse original, float64 unavailable (quantized weights, out of memory): the bound decides."""
    _coarse_original_norm(monkeypatch)

    def unavailable(model):
        raise TypeError("no float64 here")

    monkeypatch.setattr(self_check, "_in_float64", unavailable)
    handle, disagreements = _patch(tiny_model("llama", seed=3).to(torch.bfloat16))
    assert "rms_norm" in [kind for kind, _ in handle.check.declined], handle.summary()
    assert any("no float64 run (TypeError: no float64 here)" in message for message in disagreements), disagreements
    handle.restore()


def test_a_patch_off_by_ten_percent_is_still_declined(monkeypatch):
    rms_norm = fastplug.models.norms.rms_norm
    monkeypatch.setattr(fastplug.models.norms, "rms_norm", lambda x, w, **kw: 1.1 * rms_norm(x, w, **kw))
    model = tiny_model("llama", seed=3).to(torch.bfloat16)
    handle, disagreements = _patch(model)
    assert [kind for kind, _ in handle.check.declined] == ["rms_norm"], handle.summary()
    (message,) = disagreements
    assert "patched rms_norm disagrees" in message and "against float64" in message, message
    assert "with the patches and by" in message and "with the original modules" in message, message
    assert not handle.check.float64 and {"attention", "mlp"} <= set(handle.check.passed)
    handle.restore()


def test_float64_is_not_run_when_the_patches_agree():
    handle, disagreements = _patch(tiny_model("llama").to(torch.bfloat16))
    assert not disagreements and not handle.check.float64 and handle.check.float64_seconds == 0
    handle.restore()
