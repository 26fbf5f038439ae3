"""The kernels' process-wide state lives in fastplug.kernels.state: after the last release no fastplug hook
remains on torch.optim.Optimizer and no kernel cache holds a tensor."""

import pytest
import torch
import torch.optim.optimizer as optim_hooks

from fastplug.kernels import lora_linear, rms_norm, state
from fastplug.kernels.lora import LoRAProjection, casts


def _fastplug_hooks() -> list:
    """The global optimizer hooks whose function comes from fastplug (the kernels, checkpointing and the gc
    freeze all register through `state.on_optimizer_step`, so the one hook is the registry's)."""
    hooks = list(optim_hooks._global_optimizer_post_hooks.values())
    hooks += list(optim_hooks._global_optimizer_pre_hooks.values())
    return [h for h in hooks if getattr(h, "__module__", "").startswith("fastplug")]


@pytest.fixture(autouse=True)
def clean_state():
    state.reset()
    yield
    state.reset()


def _fill_caches():
    """A training step of fused LoRA with fp32 adapters on a bf16 input (cached casts and stacks), and an
    RMSNorm backward (the cached ones vector of its partial sums)."""
    torch.manual_seed(0)
    w = torch.randn(24, 16, dtype=torch.bfloat16)
    a = torch.nn.Parameter(torch.randn(4, 16) * 0.1)
    b = torch.nn.Parameter(torch.randn(24, 4) * 0.1)
    norm_w = torch.nn.Parameter(torch.ones(16))
    opt = torch.optim.SGD([a, b, norm_w], lr=0.1)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    y = lora_linear(rms_norm(x, norm_w.to(torch.bfloat16)), LoRAProjection(w, None, a, b, 2.0))
    y.float().square().sum().backward()
    opt.step()
    return a, b, norm_w


def test_release_removes_hook_and_empties_caches():
    state.acquire()
    assert state.hook_installed() and _fastplug_hooks(), "acquire installs the optimizer hook"
    params = _fill_caches()
    held = state.cached_tensors()
    assert held["lora.adapter_casts"] > 0 and held["norms.ones"] > 0, held
    state.release()
    assert not _fastplug_hooks(), "a fastplug hook is left on torch.optim.Optimizer"
    assert not state.hook_installed()
    assert sum(state.cached_tensors().values()) == 0, state.cached_tensors()
    assert not casts._CAST_CACHE and not casts._STACKED_ADAPTERS
    del params


def test_ref_counted_and_steps_invalidate():
    state.acquire()
    state.acquire()
    state.release()
    assert state.hook_installed() and state.holders() == 1, "one holder left: the hook stays"
    generation, steps = casts._generation, state.optimizer_steps()
    _fill_caches()  # one optimizer step
    assert state.optimizer_steps() == steps + 1 and casts._generation > generation
    state.release()
    assert not _fastplug_hooks() and sum(state.cached_tensors().values()) == 0
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        state.release()


def test_functional_use_installs_the_hook_lazily_and_release_removes_it():
    """Without patch_model the fused LoRA ops still hear of optimizer steps (as before the registry)."""
    _fill_caches()
    assert state.hook_installed()
    state.acquire()
    state.release()
    assert not _fastplug_hooks()
