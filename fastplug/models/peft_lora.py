"""The fused view of a peft LoRA layer: when `fastplug.kernels.lora` may compute it, and why not otherwise.

Decided at call time, not at patch time: `disable_adapter()`, `merge_adapter()` and `set_adapter()` change a
layer's state after patching (TRL's DPO reference pass runs inside `disable_adapter()`). A patched module
asks `lora_projection(proj)` on every call and runs `proj(x)` itself when the answer is None.

peft is never imported here: a layer can only be a peft LoRA layer if peft is already loaded.
"""

from __future__ import annotations

import sys

import torch.nn as nn

from ..kernels.lora import LoRAProjection, invalidate_adapter_casts


def _peft_lora_linear_class():
    layer_module = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer_module, "Linear", None)


def _has_hooks(module: nn.Module) -> bool:
    # The fused path skips module.__call__: hooks (accelerate's offload, user hooks) or a replaced forward
    # would be bypassed.
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _plain_linear_reason(module: nn.Module, what: str) -> str | None:
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        # quantized layers (bitsandbytes, ...) subclass nn.Linear with their own forward
        return f"{what} is not nn.Linear ({type(module).__name__})"
    if _has_hooks(module):
        return f"{what} has forward hooks"
    return None


def _drops_nothing(dropout: nn.Module) -> bool:
    # peft uses nn.Identity for lora_dropout=0; a Dropout in eval mode drops nothing either
    if isinstance(dropout, nn.Identity):
        return True
    return isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)


def _base_only(base: nn.Linear) -> LoRAProjection:
    return LoRAProjection(base.weight, base.bias, None, None, 0.0)


def _fused_view(module: nn.Module) -> tuple[LoRAProjection | None, str | None]:
    """(projection, None) when the fused path computes exactly what module(x) would; else (None, reason)."""
    lora_linear_class = _peft_lora_linear_class()
    if lora_linear_class is None or not isinstance(module, lora_linear_class):
        reason = _plain_linear_reason(module, "layer")
        return (None, reason) if reason else (_base_only(module), None)
    if type(module) is not lora_linear_class:
        return None, f"{type(module).__name__} is a subclass of peft's lora.Linear"
    if _has_hooks(module):
        return None, "LoRA layer has forward hooks"
    base = module.base_layer  # not get_base_layer(): a wrapper in between must not be skipped over
    reason = _plain_linear_reason(base, "base layer")
    if reason:
        return None, reason
    if module.fan_in_fan_out:
        return None, "fan_in_fan_out"
    if module.disable_adapters:
        if module.merged:  # peft unmerges the weights on this call: let it
            return None, "merged adapter inside disable_adapter()"
        return _base_only(base), None
    if module.merged:  # the base weight already holds the adapter; peft runs the base layer alone
        return _base_only(base), None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if not active:
        return _base_only(base), None
    if len(active) > 1:
        return None, "several active adapters"
    name = active[0]
    if name in module.lora_variant or name in module.lora_magnitude_vector:
        variant = module.lora_variant.get(name)
        is_dora = module.use_dora.get(name, False) or name in module.lora_magnitude_vector
        return None, "DoRA" if is_dora else f"LoRA variant {type(variant).__name__}"
    if not _drops_nothing(module.lora_dropout[name]):
        return None, "lora_dropout > 0"
    if module.lora_bias.get(name, False):
        return None, "lora_bias"
    lora_A, lora_B = module.lora_A[name], module.lora_B[name]
    for part, what in ((lora_A, "lora_A"), (lora_B, "lora_B")):
        reason = _plain_linear_reason(part, what)
        if reason:
            return None, reason
    return LoRAProjection(base.weight, base.bias, lora_A.weight, lora_B.weight, float(module.scaling[name])), None


def lora_projection(module: nn.Module) -> LoRAProjection | None:
    """The fused view of a plain nn.Linear or a peft lora.Linear, as of now; None: call module(x) instead.

    Disabled adapters (inside `disable_adapter()`) and merged adapters give the base layer alone, as peft does.
    """
    return _fused_view(module)[0]


def unfused_reason(module: nn.Module) -> str | None:
    """Why `lora_projection(module)` is None right now (for the patch summary); None when it can be fused."""
    return _fused_view(module)[1]


def watch_adapter_writes(model: nn.Module):
    """Make the fused path recast its adapter copies at each forward of this model; returns the hook handle.

    The hook sits on the decoder stack (which every forward calls through `__call__`, whether from peft,
    TRL's fused LM head or a DDP wrapper), so writes that no version counter sees, `.data` assignments
    among them, are picked up by the next forward. A checkpoint recompute of that forward runs in backward,
    before any new forward, and so reuses the same copies."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    target = decoder if isinstance(decoder, nn.Module) else model
    return target.register_forward_pre_hook(invalidate_adapter_casts)
