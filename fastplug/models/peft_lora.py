"""The fused view of a peft LoRA layer: when `fastplug.kernels.lora` may compute it, and why not otherwise.

Decided at call time, not at patch time: `disable_adapter()`, `merge_adapter()` and `set_adapter()` change a
layer's state after patching (TRL's DPO reference pass runs inside `disable_adapter()`). A patched module
asks `lora_projection(proj)` on every call and runs `proj(x)` itself when the answer is None.

A frozen bitsandbytes 4-bit base (`bnb.nn.Linear4bit`, and peft's LoRA on it) is fused when the caller
asks for it (`quantized=True`: the fused LoRA blocks, which dequantize it, and generation, which decodes it
with the 4-bit kernels); callers that read `weight` as a dense matrix (the LM head) get None for it and run
the module. The FP8 layers of the fp8 option (`models.fp8`), whose weight carries its block scales, are fused
only inside the LoRA blocks. Other quantized bases (8-bit,
GPTQ, AWQ, transformers' FP8 layers left to transformers, ...) are never fused: the reason names the format.

peft and bitsandbytes are never imported here: a layer can only be one of theirs if they are already loaded.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from ..kernels.lora import LoRAProjection, invalidate_adapter_casts
from ..kernels.quant import layout_reason
from .fp8 import is_fp8_linear

_CLASSES: dict[tuple, type] = {}  # (module, name) -> a class, once its module is imported


def _loaded_class(module: str, name: str):
    """module.name if that module is already imported (it is never imported here), else None."""
    cls = _CLASSES.get((module, name))
    if cls is None:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            _CLASSES[module, name] = cls
    return cls


def _peft_lora_linear_class():
    return _loaded_class("peft.tuners.lora.layer", "Linear")


def _peft_lora_4bit_class():
    return _loaded_class("peft.tuners.lora.bnb", "Linear4bit")


def _bnb_linear_4bit_class():
    return _loaded_class("bitsandbytes.nn", "Linear4bit")


# Called for every projection on every forward: children and parameters are read from the module's dicts
# (`module.x` would go through nn.Module.__getattr__, the larger part of this file's cost per call).
def _child(module: nn.Module, name: str):
    return module._modules.get(name)


def _param(module: nn.Module, name: str):
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


# substrings of a quantized layer's module path or class name -> the format named in the summary
_FINEGRAINED_FP8 = "fine-grained FP8"
_QUANT_FORMATS = (
    ("finegrained_fp8", _FINEGRAINED_FP8),
    ("fp8", "FP8"),
    ("8bit", "8-bit bitsandbytes"),
    ("int8", "8-bit bitsandbytes"),
    ("gptq", "GPTQ"),
    ("awq", "AWQ"),
    ("hqq", "HQQ"),
    ("eetq", "EETQ"),
    ("aqlm", "AQLM"),
    ("quanto", "quanto"),
    ("torchao", "torchao"),
    ("bitsandbytes", "bitsandbytes"),
)


def _quant_format(module: nn.Module) -> str | None:
    """The quantization format of a layer that fastplug does not fuse, by where its class comes from."""
    where = f"{type(module).__module__}.{type(module).__name__}".lower()
    return next((name for key, name in _QUANT_FORMATS if key in where), None)


def _has_hooks(module: nn.Module) -> bool:
    # The fused path skips module.__call__: hooks (accelerate's offload, user hooks) or a replaced forward
    # would be bypassed.
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _plain_linear_reason(module: nn.Module, what: str) -> str | None:
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        # quantized layers (bitsandbytes, ...) subclass nn.Linear with their own forward
        fmt = _quant_format(module)
        if fmt is not None:
            if fmt == _FINEGRAINED_FP8:
                return f"{what} is transformers' {fmt} ({type(module).__name__}); fused with the fp8=True option"
            return f"{what} is quantized ({fmt}, {type(module).__name__}); only 4-bit bitsandbytes is fused"
        return f"{what} is not nn.Linear ({type(module).__name__})"
    if _has_hooks(module):
        return f"{what} has forward hooks"
    return None


def _is_bnb_4bit(module: nn.Module) -> bool:
    cls = _bnb_linear_4bit_class()
    return cls is not None and isinstance(module, cls)


def _base_reason(module: nn.Module, what: str, quantized: bool) -> str | None:
    """Why `module` cannot serve as the base of a fused projection (None: it can)."""
    if is_fp8_linear(module):  # its forward is fastplug's own: only real hooks count
        if not quantized:
            return f"{what} is FP8 (fused only inside the LoRA blocks)"
        return f"{what} has forward hooks" if module._forward_hooks or module._forward_pre_hooks else None
    if not _is_bnb_4bit(module):
        return _plain_linear_reason(module, what)
    if not quantized:
        return f"{what} is 4-bit (fused only inside the LoRA blocks)"
    if type(module).forward is not _bnb_linear_4bit_class().forward:
        return f"{what} is a subclass of bitsandbytes' Linear4bit with its own forward"
    if _has_hooks(module):
        return f"{what} has forward hooks"
    state = getattr(module.weight, "quant_state", None)
    if state is None:
        return f"{what} is 4-bit but not quantized yet (move it to its device)"
    if state.quant_type not in ("nf4", "fp4"):
        return f"{what} has 4-bit type {state.quant_type!r}"
    if getattr(state, "packing_format_for_cpu", False):  # bitsandbytes' CPU layout: read when it is the known one
        reason = layout_reason(module.weight)
        return f"{what}: {reason}" if reason else None
    return None


def _drops_nothing(dropout: nn.Module) -> bool:
    # peft uses nn.Identity for lora_dropout=0; a Dropout in eval mode drops nothing either
    if isinstance(dropout, nn.Identity):
        return True
    return isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)


def _base_only(base: nn.Linear) -> LoRAProjection:
    return LoRAProjection(_param(base, "weight"), _param(base, "bias"), None, None, 0.0)


def _lora_class(module: nn.Module):
    """The peft LoRA class `module` is an instance of (lora.Linear, or lora.bnb.Linear4bit), else None."""
    for cls in (_peft_lora_linear_class(), _peft_lora_4bit_class()):
        if cls is not None and isinstance(module, cls):
            return cls
    return None


def _fused_view(module: nn.Module, quantized: bool) -> tuple[LoRAProjection | None, str | None]:
    """(projection, None) when the fused path computes exactly what module(x) would; else (None, reason)."""
    lora_class = _lora_class(module)
    if lora_class is None:
        base = getattr(module, "base_layer", None)
        if hasattr(module, "lora_A") and isinstance(base, nn.Module) and _quant_format(base) is not None:
            return None, _base_reason(base, "base layer", quantized)  # peft's LoRA on 8-bit, GPTQ, AWQ...
        reason = _base_reason(module, "layer", quantized)
        return (None, reason) if reason else (_base_only(module), None)
    if type(module) is not lora_class:
        return None, f"{type(module).__name__} is a subclass of peft's {lora_class.__name__}"
    if _has_hooks(module):
        return None, "LoRA layer has forward hooks"
    base = _child(module, "base_layer")  # not get_base_layer(): a wrapper in between must not be skipped over
    reason = _base_reason(base, "base layer", quantized)
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
    a_dict = _child(module, "lora_A")._modules
    active = [name for name in module.active_adapters if name in a_dict]
    if not active:
        return _base_only(base), None
    if len(active) > 1:
        return None, "several active adapters"
    name = active[0]
    magnitudes = _child(module, "lora_magnitude_vector")._modules
    if name in module.lora_variant or name in magnitudes:
        variant = module.lora_variant.get(name)
        is_dora = module.use_dora.get(name, False) or name in magnitudes
        return None, "DoRA" if is_dora else f"LoRA variant {type(variant).__name__}"
    if not _drops_nothing(_child(module, "lora_dropout")._modules[name]):
        return None, "lora_dropout > 0"
    if module.lora_bias.get(name, False):
        return None, "lora_bias"
    lora_A, lora_B = a_dict[name], _child(module, "lora_B")._modules[name]
    for part, what in ((lora_A, "lora_A"), (lora_B, "lora_B")):
        reason = _plain_linear_reason(part, what)
        if reason:
            return None, reason
    return LoRAProjection(
        _param(base, "weight"),
        _param(base, "bias"),
        _param(lora_A, "weight"),
        _param(lora_B, "weight"),
        float(module.scaling[name]),
    ), None


def lora_projection(module: nn.Module, quantized: bool = False) -> LoRAProjection | None:
    """The fused view of a plain nn.Linear or a peft lora.Linear, as of now; None: call module(x) instead.

    quantized=True also accepts bitsandbytes 4-bit bases (and peft's LoRA on them): the view's weight is then
    the packed Params4bit, for `fastplug.kernels.lora`, which dequantizes it.
    Disabled adapters (inside `disable_adapter()`) and merged adapters give the base layer alone, as peft does.
    """
    return _fused_view(module, quantized)[0]


def unfused_reason(module: nn.Module, quantized: bool = False) -> str | None:
    """Why `lora_projection(module, quantized)` is None right now (for the patch summary); None when fused."""
    return _fused_view(module, quantized)[1]


def watch_adapter_writes(decoder: nn.Module):
    """Make the fused path recast its adapter copies at each forward of `decoder` (the decoder stack, which
    every forward of the model calls); returns the hook handle. Writes that no version counter sees, `.data`
    assignments among them, are so picked up by the next forward. A checkpoint recompute of that forward runs
    in backward, before any new forward, and so reuses the same copies."""
    return decoder.register_forward_pre_hook(_invalidate_unless_traced)


def _invalidate_unless_traced(*_):
    # A forward traced by torch.compile runs the fused LoRA as plain torch ops, with no cached casts; moving
    # the generation there would also make it a guard that fails at every step (a recompile per step).
    if not torch.compiler.is_compiling():
        invalidate_adapter_casts()
