"""Gradient checkpointing for one trainer run, for FastKernels and the TRL trainers alike (`RunCheckpointing`).

fastplug does not enable checkpointing on the model itself under a Trainer: it sets the Trainer's arguments
(`activation_checkpointing`, or the older `gradient_checkpointing`, with non-reentrant kwargs) and
Trainer.train() turns it on, on every layer, with its own set-up around it. Then the options' mode goes on those
layers (the last layer unchecked, "offload", "auto"). What fastplug changed (the layers, the arguments, and the
model's checkpointing state before) goes back when training ends.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..models.structure import unwrap
from ..patch import checkpointing

_FLAGS = ("activation_checkpointing", "gradient_checkpointing")


def checkpointing_in(args) -> bool:
    """Whether the Trainer's arguments turn gradient checkpointing on."""
    return any(getattr(args, name, False) for name in _FLAGS)


class CheckpointingArgs:
    """The checkpointing arguments fastplug set on a Trainer, and the model's checkpointing state before."""

    def __init__(self):
        self.args_before: dict | None = None  # the arguments we changed, to put back
        self.model_before: checkpointing.CheckpointingSnapshot | None = None

    @property
    def turned_on(self) -> bool:
        """Whether fastplug (rather than the user) turned checkpointing on in the arguments."""
        return self.args_before is not None

    def ask(self, args, model, mode) -> None:
        """Turn checkpointing on in `args` when the options' `mode` asks for it, unless the user already did."""
        names = [n for n in _FLAGS if hasattr(args, n)]
        if not mode or any(getattr(args, n) for n in names):
            return  # off in the options, or already on in the arguments (TRL's default): the user's setting
        kwargs_names = [n + "_kwargs" for n in names if hasattr(args, n + "_kwargs")]
        self.args_before = {n: getattr(args, n) for n in names + kwargs_names}
        if model is not None:
            self.model_before = checkpointing.snapshot(unwrap(model))
        for n in names:
            setattr(args, n, True)
        for n in kwargs_names:  # transformers 5.17 defaults to reentrant checkpointing
            setattr(args, n, {"use_reentrant": False, **(getattr(args, n) or {})})

    def restore(self, args, model) -> None:
        """Put the arguments back, and the checkpointing state of `model` (the Trainer's model now) where it is
        the one asked about: a model that `model_init` replaced is no longer trained."""
        for name, value in (self.args_before or {}).items():
            setattr(args, name, value)
        if self.model_before is not None and self.model_before.model is unwrap(model):
            checkpointing.restore(self.model_before)
        self.args_before = self.model_before = None


class RunCheckpointing(TrainerCallback):
    """The options' checkpointing `mode` for one trainer run. `ask` (before train()) sets the Trainer's arguments;
    `follow` (at the run's begin, and at each step's begin as a callback) puts the mode on the layers the trainer
    turned checkpointing on for, and again after the trainer turned it on anew (TRL's DPO does around each
    reference pass); `restore` puts back the layers, the arguments and the model's state before."""

    def __init__(self, mode, memory_budget: float):
        self.mode, self.memory_budget = mode, memory_budget
        self.asked = CheckpointingArgs()  # what we changed to turn checkpointing on, to put back
        self.layers: checkpointing.TrainerCheckpointing | None = None  # once the trainer turned it on

    def ask(self, args, model) -> None:
        self.asked.ask(args, model, self.mode)

    def follow(self, model) -> None:
        if not self.mode or model is None or not checkpointing.is_enabled(unwrap(model)):
            return
        if self.layers is None:
            self.layers = checkpointing.TrainerCheckpointing(unwrap(model), self.mode, self.memory_budget)
        else:
            self.layers.reapply()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.follow(model)

    def checkpointed_layers(self) -> int | None:
        """How many layers "auto" checkpoints now (None in the other modes)."""
        auto = self.layers.auto if self.layers is not None else None
        return auto.checkpointed() if auto is not None else None

    def describe(self, args) -> str:
        if not checkpointing_in(args):
            return "off"
        if self.layers is not None:
            return f"on, {self.layers}"
        last = ", the last layer unchecked"
        if self.mode == "offload":
            where = "layer inputs in pinned CPU memory" if torch.cuda.is_available() else "offload needs CUDA: plain"
            return f"on, offload ({where}){last}"
        if self.mode == "auto":
            return "on, auto (the layers memory needs, planned at the first training step)"
        if not self.mode:
            return "on (the trainer's own setting, on every layer)"
        return "on" + (", turned on by fastplug" if self.asked.turned_on else "") + last

    def restore(self, args, model) -> None:
        if self.layers is not None:
            self.layers.undo()
        self.layers = None
        self.asked.restore(args, model)
