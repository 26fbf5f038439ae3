"""What a matching rule returns: a Patch to apply to one module, a Skip to report, or None (not ours)."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..kernels._utils import kernel_path, triton_available
from ..options import KernelOptions
from .families import Family

if TYPE_CHECKING:  # padding imports fast_attention, which imports this module
    from .padding import RowLengths


@dataclass(frozen=True)
class Patch:
    kind: str  # summary key: "rms_norm", "mlp", "attention", "lm_head_loss", ...
    forward: Callable | None  # function(self, ...) that becomes this instance's `forward`; None: keep it
    lora_fused: bool = False  # takes the fused LoRA path (as the adapters stand at patch time)
    notes: tuple[tuple[str, str], ...] = ()  # (submodule path, reason) to report, e.g. LoRA layers left unfused
    # Instance state to change besides `forward` (the model's experts implementation): called once when
    # the patch is applied, it returns the function that puts the previous state back.
    switch: Callable[[], Callable[[], None]] | None = None
    path_taken: str = ""  # which implementation this module runs and why, listed by summary()


def off_the_gpu(module: nn.Module) -> str | None:
    """For the summary's paths: None where the kernels run compiled for the GPU (the module's parameters on
    CUDA, Triton installed); elsewhere words for what they run on the module's device instead (the Triton
    interpreter or the torch references, as `use_triton` decides)."""
    parameter = next(module.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    if device.type == "cuda" and triton_available():
        return None
    return f"on {device.type}: {kernel_path(device)}"


def combine_switches(*switches):
    """One Patch switch applying each given one (None ones skipped); its undo runs theirs in reverse."""
    switches = [s for s in switches if s is not None]
    if len(switches) < 2:
        return switches[0] if switches else None

    def apply():
        undos = [s() for s in switches]

        def undo_all():
            for undo in reversed(undos):
                undo()

        return undo_all

    return apply


@dataclass(frozen=True)
class Skip:
    kind: str
    reason: str


@dataclass(frozen=True)
class MatchContext:
    root: nn.Module  # the transformers model being patched (peft unwrapped)
    decoder: nn.Module  # its decoder stack (structure.decoder_stack), derived once per patch
    family: Family | None  # None: unknown model type, structural rules only
    options: KernelOptions
    batch_paths: Counter  # the patch's tally of training batches by path (models/padding.BatchPaths)
    row_lengths: RowLengths | None  # what training rows are padded on to (models/padding.py); None: as they are


Rule = Callable[[nn.Module, MatchContext], "Patch | Skip | None"]


def is_fsdp(module: nn.Module) -> bool:
    """Whether FSDP2's `fully_shard` was applied to this module (its hooks gather and reshard the parameters)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whoever sharded it
    return fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ()))


def own_class(module: nn.Module) -> type:
    """The module's class as its library made it: `fully_shard` swaps in a subclass FSDP<Name> defined in torch,
    whose `__module__` no longer says where the model comes from."""
    cls = type(module)
    if not is_fsdp(module):
        return cls
    fsdp_module = sys.modules["torch.distributed.fsdp"].FSDPModule
    return next(c for c in cls.__mro__ if not issubclass(c, fsdp_module))
