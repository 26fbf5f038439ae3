"""Gradient checkpointing through a Trainer's own arguments, for FastKernels and the TRL trainers alike.

fastplug does not enable checkpointing on the model itself under a Trainer: it sets the Trainer's arguments
(`activation_checkpointing`, or the older `gradient_checkpointing`, with non-reentrant kwargs) and
Trainer.train() turns it on, on every layer, with its own set-up around it. What fastplug changed (the
arguments, and the model's checkpointing state before) goes back when training ends.
"""

from __future__ import annotations

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
