"""Which LoRA projections take the fused path: asked at call time, reported at patch time.

The fused blocks (`lora_linear`, `lora_qkv`, `lora_mlp`) dequantize bitsandbytes 4-bit bases themselves, so
they ask for the quantized views too.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks

from ..kernels import state
from ..kernels.lora import LoRAProjection
from .peft_lora import lora_projection, unfused_reason


def fused_projections(*modules: nn.Module) -> list[LoRAProjection] | None:
    """The fused views of these projections as they stand NOW, or None to run the modules.

    None also when none of them carries an active adapter: plain linears gain nothing from the fused node.
    """
    projs = [lora_projection(m, quantized=True) for m in modules]
    if any(p is None for p in projs) or all(p.lora_A is None for p in projs):
        return None
    return projs


# first projection module -> (adapter state, its group's views) of the last forward that recorded autograd; the
# views hold the module's tensors: its patch's restore forgets them (`forget_step_views`)
_STEP_VIEWS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = state.register_cache(
    "models.step_views", weakref.WeakKeyDictionary()
)


def forget_step_views(model: nn.Module) -> None:
    """Drop the views the forwards of `model`'s projections recorded (`step_projections`)."""
    for module in model.modules():
        _STEP_VIEWS.pop(module, None)


def _adapter_state(modules) -> tuple:
    """What peft's context managers and trainers switch between calls (disable_adapter, merge, set_adapter),
    read from the instance dicts: a few dict reads per projection."""
    state = []
    for m in modules:
        d = m.__dict__
        merged = d.get("merged_adapters")
        state += (d.get("_disable_adapters"), d.get("_active_adapter"), tuple(merged) if merged else None)
    return tuple(state)


def step_projections(*modules: nn.Module) -> list[LoRAProjection] | None:
    """`fused_projections` for a patched module's forward. A checkpoint's recompute runs inside backward: it
    gets the views the last forward that recorded autograd used (forwards under no_grad, a DPO reference pass
    among them, are never recomputed) when the adapters' state is still the same, without asking peft again
    (on a host-bound step, a tenth of the Python work per layer)."""
    if torch.compiler.is_compiling():  # traced once; the compiled graph's backward recomputes nothing here
        return fused_projections(*modules)
    if torch._C._current_autograd_node() is not None:
        hit = _STEP_VIEWS.get(modules[0])
        if hit is not None and hit[0] == _adapter_state(modules):
            return hit[1]
        return fused_projections(*modules)
    projs = fused_projections(*modules)
    if torch.is_grad_enabled():
        _STEP_VIEWS[modules[0]] = (_adapter_state(modules), projs)
    return projs


def outputs_private(*modules: nn.Module) -> bool:
    """Whether no forward hook sees these modules' outputs, so that an op may reuse their buffers (one that
    keeps them would read other values later). Their submodules count too: a peft layer with its adapters
    off returns its base layer's output itself."""
    return not (_global_forward_hooks or any(sub._forward_hooks for m in modules for sub in m.modules()))


def unfused_notes(owner: nn.Module, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(child name, reason) for the peft LoRA children of `owner` that cannot be fused right now."""
    notes = []
    for name in names:
        child = getattr(owner, name)
        reason = unfused_reason(child, quantized=True)
        if reason is not None and hasattr(child, "lora_A"):  # plain layers are not worth reporting
            notes.append((name, f"LoRA left unfused: {reason}"))
    return tuple(notes)
