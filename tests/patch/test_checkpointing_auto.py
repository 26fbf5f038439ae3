"""gradient_checkpointing="auto": checkpoint only as many layers as memory needs, measured at the first step.

On CPU there is no device memory to measure: every layer but the last (never checkpointed) stays checkpointed. The
planning is checked with torch.cuda's memory counters replaced by a fake device of a chosen size.
"""

import pytest
import torch

import fastplug
from fastplug.patch import checkpointing
from tests.helpers import checkpointing_on
from tests.models.tiny import tiny_model

HIDDEN = 64  # tiny_model's hidden size
SAVED_PER_TOKEN = 500  # bytes the fake device says one unchecked layer saves per token
BASE_PEAK = 10_000


def _flags(handle):
    return [layer.gradient_checkpointing for layer in handle.checkpointing.layers]


def _step(model, opt, tokens):
    ids = torch.randint(1, 128, (1, tokens))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


class FakeDevice:
    """torch.cuda's counters for a device of `total` bytes on which layer 0 saves SAVED_PER_TOKEN per token."""

    def __init__(self, monkeypatch, total):
        self.total, self.allocated = total, 0
        monkeypatch.setattr(checkpointing, "_first_device", lambda module: torch.device("cuda"))
        monkeypatch.setattr(torch.cuda, "memory_allocated", self.memory_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: BASE_PEAK)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, self.total))
        self.tokens = None

    def memory_allocated(self, device=None):
        # called before layer 0 (returns 0) and after it (its output, fp32, plus what it saved)
        value, self.allocated = self.allocated, self.tokens * (HIDDEN * 4 + SAVED_PER_TOKEN)
        return value


def test_cpu_keeps_every_layer_checkpointed_and_trains_like_unpatched():
    model = tiny_model("llama", num_hidden_layers=3)
    ref = tiny_model("llama", num_hidden_layers=3)
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with fastplug.patch_model(model, gradient_checkpointing="auto") as handle:
        assert "auto: 2 of 3 layers checkpointed until" in handle.summary()
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
        model.train(), ref.train()
        torch.manual_seed(0)
        losses = [_step(model, opts[0], 9) for _ in range(3)]
        torch.manual_seed(0)
        ref_losses = [_step(ref, opts[1], 9) for _ in range(3)]
        assert _flags(handle) == [True, True, False]
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert not checkpointing_on(model), "restore turns checkpointing off again"


def test_plan_leaves_unchecked_what_fits(monkeypatch):
    tokens = 10
    per_layer = SAVED_PER_TOKEN * tokens
    # room for the measured layer plus two more: 0.9 * total - BASE_PEAK = 2.5 layers
    device = FakeDevice(monkeypatch, total=(BASE_PEAK + 2.5 * per_layer) / 0.9)
    model = tiny_model("llama", num_hidden_layers=5)
    ref = tiny_model("llama", num_hidden_layers=5)
    with fastplug.patch_model(model, gradient_checkpointing="auto") as handle:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        device.tokens = tokens
        torch.manual_seed(0)
        first = _step(model, opt, tokens)
        assert handle.checkpointing.bytes_per_token == SAVED_PER_TOKEN
        assert _flags(handle) == [False, True, True, True, False], "layer 0 ran unchecked to be measured"
        second = _step(model, opt, tokens)
        assert _flags(handle) == [False, False, False, True, False]
        assert "auto: 1 of 5 layers checkpointed" in handle.summary()
        _step(model, opt, 2 * tokens)  # twice the tokens: only the measured layer's share fits... and one more
        assert _flags(handle) == [False, False, True, True, False]
    assert _flags(handle) == [True] * 5 or not checkpointing_on(model)
    assert vars(handle.checkpointing)["_hooks"] == [], "restore removes auto's hooks"
    # the mixed checkpointed / unchecked steps compute what the plain model computes
    ref.train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    torch.manual_seed(0)
    assert [first, second] == pytest.approx([_step(ref, ref_opt, tokens) for _ in range(2)], rel=1e-4)


@pytest.mark.parametrize("budget, unchecked, checked", [(0.01, 0, 4), (0.5, 5, 0)])
def test_memory_budget_bounds_the_plan(monkeypatch, budget, unchecked, checked):
    # a device of 10 base peaks: a budget under the base checkpoints every layer but the last, a roomy one none
    device = FakeDevice(monkeypatch, total=10 * BASE_PEAK)
    model = tiny_model("llama", num_hidden_layers=5)
    with fastplug.patch_model(model, gradient_checkpointing="auto", memory_budget=budget) as handle:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        device.tokens = 4
        _step(model, opt, 4)
        _step(model, opt, 4)
        assert handle.checkpointing.unchecked == unchecked
        assert f"auto: {checked} of 5 layers checkpointed" in handle.summary()


def test_bad_mode_is_a_value_error():
    with pytest.raises(ValueError, match="'auto'"):
        fastplug.KernelOptions(gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="memory_budget"):
        fastplug.KernelOptions(memory_budget=1.5)
