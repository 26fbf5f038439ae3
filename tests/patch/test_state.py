"""patch_model holds the kernels' process-wide state (fastplug.kernels.state) and the last restore() gives it
back: after it no fastplug hook is left on torch.optim.Optimizer and no kernel cache holds a tensor."""

import gc

import peft
import pytest
import torch
import torch.optim.optimizer as optim_hooks

from fastplug.kernels import state
from fastplug.patch import host_gc
from fastplug.patch.engine import PatchHandle, patch_model
from tests.models.tiny import batch, tiny_model

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _fastplug_hooks() -> list:
    hooks = list(optim_hooks._global_optimizer_post_hooks.values())
    hooks += list(optim_hooks._global_optimizer_pre_hooks.values())
    return [h for h in hooks if getattr(h, "__module__", "").startswith("fastplug")]


@pytest.fixture(autouse=True)
def clean_state():
    state.reset()  # earlier tests may have used the functional ops (which install the hook lazily)
    yield
    state.reset()


def _lora_model(seed: int = 0):
    """A bf16 base with fp32 adapters (peft's default): fused LoRA caches compute-dtype copies of them."""
    return peft.get_peft_model(
        tiny_model("llama", seed=seed).to(torch.bfloat16), peft.LoraConfig(r=4, target_modules=_TARGETS)
    )


def _train_steps(model, steps: int) -> None:
    """What the HF Trainer does each step: forward with labels, backward, optimizer step, zero_grad."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs = batch()
    for _ in range(steps):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_restore_leaves_no_hook_and_no_cached_tensor():
    model = _lora_model()
    freezes_before = gc.get_freeze_count()
    handle = patch_model(model, gradient_checkpointing="auto", freeze_gc=True)
    assert state.holders() == 1 and state.hook_installed() and _fastplug_hooks()
    steps = state.optimizer_steps()
    _train_steps(model, 2)
    assert state.optimizer_steps() == steps + 2, "the registry's hook counts the steps (auto checkpointing reads it)"
    assert sum(state.cached_tensors().values()) > 0, state.cached_tensors()

    handle.restore()
    assert not _fastplug_hooks(), "a fastplug hook is left on torch.optim.Optimizer"
    assert not state.hook_installed() and state.holders() == 0
    assert sum(state.cached_tensors().values()) == 0, state.cached_tensors()
    assert not host_gc._armed and gc.get_freeze_count() == freezes_before
    handle.restore()  # a second restore releases nothing more
    assert state.holders() == 0


def test_the_last_restore_releases():
    first, second = patch_model(_lora_model()), patch_model(_lora_model(seed=1))
    assert state.holders() == 2
    first.restore()
    assert state.hook_installed() and state.holders() == 1, "the other patched model still uses the hook"
    second.restore()
    assert not _fastplug_hooks() and state.holders() == 0


def test_a_patch_that_fails_partway_holds_nothing(monkeypatch):
    def fail(self):
        raise RuntimeError("simulated failure while patching")

    monkeypatch.setattr(PatchHandle, "_install_graphs", fail)
    with pytest.raises(RuntimeError, match="simulated failure"):
        patch_model(tiny_model("llama"), gradient_checkpointing=False)
    assert state.holders() == 0 and not state.hook_installed()
