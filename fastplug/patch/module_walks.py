"""The trainers' walks of the whole module tree at every step, done over a list of the modules kept current.

The HF Trainer walks every module of the model three or four times a step: `model.train()` (each module's flag),
the FLOP count (`model.num_parameters(exclude_embeddings=True)`: every module for embeddings, every parameter
by its qualified name), the gradient clipping (`model.parameters()`) and `model.zero_grad()`. On Gemma2-2B's
2,219 modules these took 12.9, 11.7, 11.9 and 7.9 ms of host time a step, where its replayed layers need about
100 ms of GPU time and the Trainer's whole step 119 ms of host time: the host set the pace
(`python scripts/trainer_step_phases.py --model gemma2`).

nn.Module pays for recursion, generators, name strings and a duplicate check per module. Here the patched
model instance (and the base model under a peft wrapper) takes instance attributes for these methods that walk
one flat list of its modules, in `modules()` order:
- `train(mode)` returns at once where every module is in `mode` already and no module's class overrides `train`
  beyond setting flags (transformers' models' override only acts on a change of mode); otherwise the model's
  own `train` runs;
- `zero_grad()` sets each parameter's gradient to None (`set_to_none=False` takes nn.Module's own);
- `parameters()` yields each module's parameters as `named_parameters` would (same order, duplicates once);
- `num_parameters(...)` (transformers' models) is computed once per arguments by the model's own method, again
  after the tree changed; `only_trainable=True` is never kept (freezing a parameter is no registration).
The list is read again once a submodule or parameter was assigned on any module of the tree (torch's global
registration hooks, as `layer_graphs._Fixed` watches them). Parameters are read live from each module's
`_parameters`, so a parameter swapped in place there (FSDP2 gathers and frees that way) is the one seen.
restore() removes the attributes, and only those it set."""

from __future__ import annotations

import sys
import weakref

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class ModuleWalks:
    """The flat walks of one model tree; `install()` puts them on `model` (and `base`), returns the undo."""

    def __init__(self, model: nn.Module, base: nn.Module):
        self.model, self.base = model, base
        self._modules: list[nn.Module] | None = None  # None: read again at the next walk
        self._counts: dict[tuple, int] = {}  # num_parameters' results by arguments
        self._ids: set[int] = set()
        this = weakref.ref(self)  # the process-wide hooks must not keep the model alive

        def registered(module, name, value):
            walks = this()
            if walks is not None and id(module) in walks._ids:
                walks._modules = None

        self._handles = [
            register_module_parameter_registration_hook(registered),
            register_module_module_registration_hook(registered),
        ]

    def __reduce__(self):
        # a deep copy of the model (TRL's reference models) or a pickle watches its own tree
        return ModuleWalks, (self.model, self.base)

    def modules(self) -> list[nn.Module]:
        if self._modules is None:
            self._modules = list(self.model.modules())
            self._ids = {id(m) for m in self._modules}
            self._counts.clear()
        return self._modules

    # -- the walks
    def train(self, mode: bool = True) -> nn.Module:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        modules = self.modules()
        # The trainers call train() at every step on a model in training mode already: then nothing changes. A
        # change of mode, or a class whose `train` may do more than set flags, takes the model's own method.
        # (Classes are read at each call: FSDP2's fully_shard swaps them without a registration.)
        flags_only = _flags_only_trains()
        if all(m.training is mode for m in modules) and all(type(m).train in flags_only for m in modules):
            return self.model
        return type(self.model).train(self.model, mode)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none or getattr(self.model, "_is_replica", False):
            return type(self.model).zero_grad(self.model, set_to_none)
        for module in self.modules():
            for param in module._parameters.values():
                if param is not None and param.grad is not None:
                    param.grad = None

    def parameters(self, recurse: bool = True):
        if not recurse:
            return type(self.model).parameters(self.model, recurse)
        return self._parameters(self.modules())

    @staticmethod
    def _parameters(modules: list[nn.Module]):
        seen = set()
        for module in modules:
            for param in module._parameters.values():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        count = type(self.base).num_parameters
        if only_trainable:  # requires_grad changes without a registration: counted afresh
            return count(self.base, only_trainable=True, exclude_embeddings=exclude_embeddings)
        self.modules()  # the tree's changes clear the counts
        key = (exclude_embeddings,)
        if key not in self._counts:
            self._counts[key] = count(self.base, exclude_embeddings=exclude_embeddings)
        return self._counts[key]

    # -- installing
    def install(self):
        """Set the walks as instance attributes where none is set; returns the undo."""
        placed = []
        for target, name in ((self.model, "train"), (self.model, "zero_grad"), (self.model, "parameters")):
            placed.append(self._place(target, name, getattr(self, name)))
        if hasattr(type(self.base), "num_parameters"):
            placed.append(self._place(self.base, "num_parameters", self.num_parameters))
        placed = [p for p in placed if p is not None]

        def undo():
            for target, name, method in placed:
                if vars(target).get(name) is method:
                    del vars(target)[name]
            for handle in self._handles:
                handle.remove()
            self._modules = None

        return undo

    @staticmethod
    def _place(target: nn.Module, name: str, method):
        if name in vars(target):  # the user's or another library's own: left as it is
            return None
        vars(target)[name] = method  # a plain instance attribute (nn.Module.__setattr__ would register nothing)
        return target, name, method


def _flags_only_trains() -> set:
    """The `train` methods that only set the training flags when the mode does not change: nn.Module's, and
    transformers' PreTrainedModel's (it re-applies hub kernels on a change of mode only)."""
    trains = {nn.Module.train}
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None:
        trains.add(modeling.PreTrainedModel.train)
    return trains
