"""Where a model keeps its parts: the transformers model inside a peft wrapper, the decoder stack, its layers.

Queries only, nothing is changed: the rules, the patch engine, checkpointing, the FSDP integration and
generation all ask here.
"""

from __future__ import annotations

from torch import nn

from .rules import own_class


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft PeftModel (or the model itself), FSDP2-sharded ones included."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and own_class(model).__module__.startswith("peft"):
        return get_base_model()
    return model


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module that runs the decoder layers (transformers' `get_decoder()`), else the model: every forward
    calls it through `__call__`, from peft, TRL's fused LM head or a DDP wrapper alike, so its hooks fire."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers under `model` (transformers' GradientCheckpointingLayer modules), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
