"""FSDP2 (`torch.distributed.fsdp.fully_shard`) of a transformers model, in the units accelerate 1.15 uses.

    handle = fastplug.patch_model(model)          # first: patching reads module structure, not parameters
    shard_model(model, mesh=mesh)                 # every decoder layer, an untied head and embedding, the root

For the places that shard themselves: the `fastkernels_fsdp` Lightning strategy, the multi-GPU benchmark and
the tests. The HF Trainer and TRL shard through accelerate (`fsdp_config={"fsdp_version": 2}`).

fastplug's patched modules keep FSDP2's hooks firing: every patched forward reads only the parameters of its
own module or of submodules inside the same FSDP unit, and the fused LM-head loss runs inside a call of the
head module, whose pre-forward hook gathers the head when it is a unit of its own.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from torch import nn

from ..models.rules import is_fsdp
from ..models.structure import decoder_layers, unwrap

__all__ = ["accelerate_fsdp2_plugin", "peft_units_for_accelerate", "shard_model"]

# peft's FSDP wrap policy reads the decoder layers' class names from here when set (else the model's
# `_no_split_modules`)
_PEFT_CLASS_NAMES = "FSDP_TRANSFORMER_CLS_TO_WRAP"


def shard_model(model: nn.Module, **fsdp_kwargs) -> nn.Module:
    """Apply `fully_shard` to each decoder layer, to an untied LM head and input embedding and to `model` (the
    root), in place.

    `fsdp_kwargs` go to every `fully_shard` call (mesh, mp_policy, offload_policy, reshard_after_forward).
    A model that already holds FSDP2 modules is returned as it is.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return model
    base = unwrap(model)
    for layer in decoder_layers(base):
        fully_shard(layer, **fsdp_kwargs)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if isinstance(head, nn.Module) and getattr(head, "weight", None) is not getattr(embed, "weight", None):
        # Gathered at the end of forward and needed again at the start of backward: kept gathered in between.
        fully_shard(head, **{**fsdp_kwargs, "reshard_after_forward": False})
        if isinstance(embed, nn.Module):
            # Else the root holds it, and torch keeps the root gathered from forward to the end of backward: the
            # whole table (1 GiB at the 8B width) on every rank for the step, more than DDP's peak at 4 layers.
            fully_shard(embed, **fsdp_kwargs)
    root_kwargs = {k: v for k, v in fsdp_kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, **root_kwargs)  # torch keeps the root's parameters gathered between forward and backward
    return model


def accelerate_fsdp2_plugin(accelerator=None):
    """accelerate's FSDP plugin when it shards with FSDP2 (the accelerator's, or the process's AcceleratorState,
    read without creating one), else None."""
    if accelerator is not None:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
    else:
        state = sys.modules.get("accelerate.state")
        shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None) or {}
        plugin = shared.get("fsdp_plugin")
    return plugin if plugin is not None and getattr(plugin, "fsdp_version", 1) == 2 else None


def peft_units_for_accelerate(model: nn.Module, plugin) -> Callable[[], None] | None:
    """Make accelerate's FSDP2 shard a peft model per decoder layer, as it shards the model without peft.

    For a PeftModel, Trainer.train() replaces the plugin's wrap policy with peft's FSDP1 one (transformers'
    `update_fsdp_plugin_peft`: an `_or_policy` of a policy for trainable leaves and one for decoder layers).
    accelerate 1.15's FSDP2 turns only the decoder-layer and size policies into units: with peft's it shards
    the root alone: each rank gathers the whole model at once, for every forward and backward. So at
    `prepare`, before accelerate reads it, such a policy becomes the decoder-layer policy over the layers the
    model has; FSDP2 keeps frozen and trained parameters in one unit, so the adapters need no units of their
    own. A model already sharded per layer (`shard_model`) names its layers FSDP<Name>: peft's lookup by
    the plain name would fail, so it is given the names the model has.

    Returns undo (the plugin's own method back, the environment as it was); None when `plugin` is None or
    `model` is not a peft model.
    """
    if plugin is None or unwrap(model) is model:
        return None
    from torch.distributed.fsdp.wrap import _or_policy, transformer_auto_wrap_policy

    layers = decoder_layers(unwrap(model))
    names = sorted({type(layer).__name__ for layer in layers})
    own_method = plugin.set_auto_wrap_policy

    renamed = any(is_fsdp(layer) for layer in layers)
    names_before = plugin.transformer_cls_names_to_wrap

    def set_auto_wrap_policy(prepared: nn.Module) -> None:
        policy = plugin.auto_wrap_policy
        policy = policy.func if isinstance(policy, functools.partial) else policy
        if policy is _or_policy and names:
            plugin.auto_wrap_policy = transformer_auto_wrap_policy
            plugin.transformer_cls_names_to_wrap = names
        elif policy is transformer_auto_wrap_policy and renamed:
            # The Trainer prepares model and optimizer together (no peft policy): the plugin holds the
            # classes' plain names (from `_no_split_modules`), which a presharded model no longer has.
            plugin.transformer_cls_names_to_wrap = names
        own_method(prepared)

    vars(plugin)["set_auto_wrap_policy"] = set_auto_wrap_policy
    env_before = os.environ.get(_PEFT_CLASS_NAMES)
    if renamed and env_before is None:
        os.environ[_PEFT_CLASS_NAMES] = ",".join(names)

    def undo() -> None:
        if vars(plugin).get("set_auto_wrap_policy") is set_auto_wrap_policy:
            del vars(plugin)["set_auto_wrap_policy"]
            plugin.transformer_cls_names_to_wrap = names_before
        if renamed and env_before is None:
            os.environ.pop(_PEFT_CLASS_NAMES, None)

    return undo
