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
    """The decoder layers of `model`'s decoder stack (transformers' GradientCheckpointingLayer modules), in order:
    a multimodal model's vision blocks are not among them."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in decoder_stack(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def other_towers(model: nn.Module, decoder: nn.Module | None = None) -> list[str]:
    """Paths of the parts of a multimodal model off its language path (the vision tower, a projector), which
    fastplug leaves as they are: every module that is neither inside the decoder stack nor one of its ancestors.
    Empty for a model whose only sub-model is its decoder (a causal LM)."""
    from transformers import PreTrainedModel

    decoder = decoder_stack(model) if decoder is None else decoder
    if decoder is model:
        return []
    inside = {id(m) for m in decoder.modules()}
    path_of = {id(m): name for name, m in model.named_modules()}
    decoder_path = path_of.get(id(decoder), "")
    ancestors = {decoder_path.rsplit(".", i)[0] for i in range(decoder_path.count(".") + 1)} | {""}
    if not any(
        isinstance(m, PreTrainedModel) and id(m) not in inside and name not in ancestors
        for name, m in model.named_modules()
    ):
        return []
    # each child of an ancestor of the decoder that is off the path to it (the output embedding stays: the LM-head
    # rule patches the root around it); the modules below one of these are covered by it
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    return [
        name
        for name, m in model.named_modules()
        if name and name.rpartition(".")[0] in ancestors and name not in ancestors and id(m) not in inside
        and m is not head
    ]  # fmt: skip
