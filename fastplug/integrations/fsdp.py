"""FSDP2 (`torch.distributed.fsdp.fully_shard`) of a transformers model, in the units accelerate 1.15 uses.

    handle = fastplug.patch_model(model)          # first: patching reads module structure, not parameters
    shard_model(model, mesh=mesh)                 # every decoder layer, the LM head, then the model as root

For the places that shard themselves: the `fastkernels_fsdp` Lightning strategy, the multi-GPU benchmark and
the tests. The HF Trainer and TRL shard through accelerate (`fsdp_config={"fsdp_version": 2}`).

fastplug's patched modules keep FSDP2's hooks firing: every patched forward reads only the parameters of its
own module or of submodules inside the same FSDP unit, and the fused LM-head loss runs inside a call of the
head module, whose pre-forward hook gathers the head when it is a unit of its own.
"""

from __future__ import annotations

from torch import nn

from ..checkpointing import decoder_layers
from ..patching import unwrap

__all__ = ["shard_model"]


def shard_model(model: nn.Module, **fsdp_kwargs) -> nn.Module:
    """Apply `fully_shard` to each decoder layer, to an untied LM head and to `model` (the root), in place.

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
    root_kwargs = {k: v for k, v in fsdp_kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, **root_kwargs)  # torch keeps the root's parameters gathered between forward and backward
    return model
