"""The trainers' walks of the whole module tree at every step, read from a list kept while the tree is unchanged.

The HF Trainer walks every module of the model four times a step: `model.train()` (each module's flag), the FLOP
count (`model.num_parameters(exclude_embeddings=True)`: every module for embeddings, every parameter by its
qualified name), the gradient clipping (`model.parameters()`) and `model.zero_grad()`. On Gemma2-2B's 2,219
modules these took 12.9, 11.7, 11.9 and 7.9 ms of host time a step on an H200 host, where its replayed layers need
about 90 ms of GPU time: the host set the pace (`python scripts/trainer_step_phases.py --model gemma2`).

Here the patched model instance (and the base model under a peft wrapper) takes instance attributes for these
methods that read one list of the tree's modules and parameters (`TreeSnapshot`), kept between calls while the
tree is unchanged:
- `train(mode)` returns at once where every module is in `mode` already and no module's class overrides `train`
  beyond setting flags (transformers' models' override only acts on a change of mode); otherwise the model's
  own `train` runs;
- `zero_grad()` sets each parameter's gradient to None (`set_to_none=False` takes nn.Module's own);
- `parameters()` gives each module's parameters as `named_parameters` would (same order, duplicates once);
- `num_parameters(...)` (transformers' models) is the model's own method's result, kept while the same modules
  hold the same parameters of the same sizes; `only_trainable=True` is counted afresh.

How a change of the tree is seen. From the patch on, every module of the tree holds its `_modules` and
`_parameters` in a `WatchedDict`: a dict that counts its writes (setting, deleting, update, pop...), so a submodule
or parameter added, replaced or deleted, through `setattr` or written straight into the dict as FSDP2 and
accelerate do, makes the next walk read the tree again (and watch the modules it finds). A dict replaced as a
whole, or a module's class changed, is seen by comparing each module's dicts and class with the list's (C-level
`map`s, a fraction of a millisecond on Gemma2's tree). No hook is registered: torch's global registration hooks
would also fire inside compiled forwards, where transformers slices its layers' ModuleList anew, and recompile
them; these dicts count writes to this tree only. Dynamo guards a dict subclass's type and length: a model
compiled after the patch traces the watched dicts from the start, and only adding or deleting a submodule (or
restore()) recompiles it, once. `python scripts/module_walks_ms.py` times the four walks against nn.Module's.
restore() gives every module plain dicts again and removes the attributes, and only those it set.
"""

from __future__ import annotations

import sys
from itertools import repeat
from operator import attrgetter, is_

from torch import nn

_TRAINING, _MODULES, _PARAMETERS = attrgetter("training"), attrgetter("_modules"), attrgetter("_parameters")


class WriteCount:
    """How many writes the watched dicts of one tree took."""

    __slots__ = ("writes",)

    def __init__(self):
        self.writes = 0


class WatchedDict(dict):
    """A module's `_modules` or `_parameters` that counts each write on the trees' `WriteCount`s that watch it.
    Reads are dict's own (no override), so attribute lookups through nn.Module.__getattr__ cost the same."""

    __slots__ = ("counts",)

    def _wrote(self) -> None:
        for count in self.counts:
            count.writes += 1

    def __setitem__(self, key, value):
        self._wrote()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._wrote()
        dict.__delitem__(self, key)

    def __ior__(self, other):
        self._wrote()
        return dict.__ior__(self, other)

    def pop(self, *args):
        self._wrote()
        return dict.pop(self, *args)

    def popitem(self):
        self._wrote()
        return dict.popitem(self)

    def setdefault(self, key, default=None):
        self._wrote()
        return dict.setdefault(self, key, default)

    def update(self, *args, **kwargs):
        self._wrote()
        dict.update(self, *args, **kwargs)

    def clear(self):
        self._wrote()
        dict.clear(self)

    def __reduce__(self):
        # copies and pickles of the model hold plain dicts (a deep copy's own walks watch its tree anew)
        return dict, (dict(self),)


class TreeCounts:
    """The writes one tree's watched dicts took: `modules` counts its `_modules` dicts' (the tree's shape),
    `parameters` its `_parameters` dicts' (FSDP2 swaps its units' parameters there at every forward and
    backward: the parameter list is read again, the modules' list stays)."""

    __slots__ = ("modules", "parameters")

    def __init__(self):
        self.modules, self.parameters = WriteCount(), WriteCount()

    def by_dict(self) -> tuple:
        """(the module attribute holding a watched dict, the count its writes go to)"""
        return ("_modules", self.modules), ("_parameters", self.parameters)


class TreeSnapshot:
    """The modules under one root in `modules()` order, their classes and dicts as they were at the tree's
    `modules` write count `shape_at`, and their parameters at its `parameters` count."""

    def __init__(self, root: nn.Module, counts: TreeCounts):
        self.modules = modules_in_order(root)
        for module in self.modules:
            _watch(module, counts)
        self.shape_at = counts.modules.writes
        self.classes = list(map(type, self.modules))
        self.module_dicts = list(map(_MODULES, self.modules))
        self.parameter_dicts = list(map(_PARAMETERS, self.modules))
        flags_only = _flags_only_trains()
        self.trains_set_flags_only = all(cls.train in flags_only for cls in set(self.classes))
        self._parameters, self._parameters_at = [], None

    def holds(self, counts: TreeCounts) -> bool:
        """No `_modules` dict written since, and every module holds the same dicts and class."""
        modules = self.modules
        return (
            counts.modules.writes == self.shape_at
            and all(map(is_, map(_MODULES, modules), self.module_dicts))
            and all(map(is_, map(_PARAMETERS, modules), self.parameter_dicts))
            and all(map(is_, map(type, modules), self.classes))
        )

    def parameters(self, counts: TreeCounts) -> list:
        """The modules' parameters as `parameters()` gives them, read again after a `_parameters` write."""
        if self._parameters_at != counts.parameters.writes:
            self._parameters, self._parameters_at = _parameters(self.modules), counts.parameters.writes
        return self._parameters


class ModuleWalks:
    """The walks of one model tree; `install()` puts them on `model` (and `base`), returns the undo."""

    def __init__(self, model: nn.Module, base: nn.Module):
        self.model, self.base = model, base
        self._counts = TreeCounts()
        self._snapshots: dict[int, TreeSnapshot] = {}  # by id of the root: the model's and the base's
        # num_parameters' last result: (exclude_embeddings, the parameters and their sizes it counted, the count)
        self._last_count: tuple | None = None

    def __reduce__(self):
        # a deep copy of the model (TRL's reference models) or a pickle walks its own tree
        return ModuleWalks, (self.model, self.base)

    def snapshot(self, root: nn.Module) -> TreeSnapshot:
        """The tree under `root` as it is now: the kept snapshot while it holds, else a new one."""
        snapshot = self._snapshots.get(id(root))
        if snapshot is None or not snapshot.holds(self._counts):
            snapshot = self._snapshots[id(root)] = TreeSnapshot(root, self._counts)
        return snapshot

    def _parameters_of(self, root: nn.Module) -> list:
        return self.snapshot(root).parameters(self._counts)

    # -- the walks
    def train(self, mode: bool = True) -> nn.Module:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        # The trainers call train() at every step on a model in training mode already: then nothing changes. A
        # change of mode, or a class whose `train` may do more than set flags, takes the model's own method.
        snapshot = self.snapshot(self.model)
        if snapshot.trains_set_flags_only and all(map(is_, map(_TRAINING, snapshot.modules), repeat(mode))):
            return self.model
        return type(self.model).train(self.model, mode)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none or getattr(self.model, "_is_replica", False):
            return type(self.model).zero_grad(self.model, set_to_none)
        for param in self._parameters_of(self.model):
            if param.grad is not None:
                param.grad = None

    def parameters(self, recurse: bool = True):
        if not recurse:
            return type(self.model).parameters(self.model, recurse)
        return iter(self._parameters_of(self.model))

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        count = type(self.base).num_parameters
        if only_trainable:  # requires_grad changes between calls: counted afresh
            return count(self.base, only_trainable=True, exclude_embeddings=exclude_embeddings)
        # the same modules holding the same parameters of the same sizes: the same count
        params = self._parameters_of(self.base)
        key = (exclude_embeddings, tuple(map(id, params)), tuple(p.numel() for p in params))
        if self._last_count is None or self._last_count[:3] != key:
            self._last_count = (*key, count(self.base, exclude_embeddings=exclude_embeddings))
        return self._last_count[3]

    # -- installing
    def install(self):
        """Watch the tree now (a model compiled later sees its watched dicts from its first trace on, so the
        first walk does not recompile it), set the walks as instance attributes where none is set; returns the
        undo."""
        self.snapshot(self.model)
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
            for module in modules_in_order(self.model):
                _unwatch(module, self._counts)
            self._snapshots.clear()
            self._last_count = None

        return undo

    @staticmethod
    def _place(target: nn.Module, name: str, method):
        if name in vars(target):  # the user's or another library's own: left as it is
            return None
        vars(target)[name] = method  # a plain instance attribute (nn.Module.__setattr__ would register nothing)
        return target, name, method


def _watch(module: nn.Module, counts: TreeCounts) -> None:
    state = vars(module)
    for name, count in counts.by_dict():
        held = state[name]
        if type(held) is not WatchedDict:
            held = state[name] = WatchedDict(held)
            held.counts = []
        if count not in held.counts:
            held.counts.append(count)


def _unwatch(module: nn.Module, counts: TreeCounts) -> None:
    state = vars(module)
    for name, count in counts.by_dict():
        held = state[name]
        if type(held) is WatchedDict and count in held.counts:
            held.counts.remove(count)
            if not held.counts:
                state[name] = dict(held)


def modules_in_order(root: nn.Module) -> list[nn.Module]:
    """`root.modules()` as a list (depth first, each module once, at its first place), read from the `_modules`
    dicts without named_modules' names and generators (a recursive visit: on Gemma2-2B's 2,219 modules, 2.3x
    faster than `list(modules())` on a 2-core CPU, and 1.5x faster than a loop over a stack)."""
    seen, order = set(), []

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        order.append(module)
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                visit(child)

    visit(root)
    return order


def _parameters(modules: list[nn.Module]) -> list:
    """The modules' parameters as `parameters()` gives them (in order, each once)."""
    seen, params = set(), []
    for module in modules:
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _flags_only_trains() -> set:
    """The `train` methods that only set the training flags when the mode does not change: nn.Module's, and
    transformers' PreTrainedModel's (it re-applies hub kernels on a change of mode only)."""
    trains = {nn.Module.train}
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None:
        trains.add(modeling.PreTrainedModel.train)
    return trains
