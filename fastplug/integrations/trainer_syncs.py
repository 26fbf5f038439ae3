"""The HF Trainer's per-step waits for the device, removed for one `train()`: `SyncFreeSteps`.

When fastplug replays the layers, the host is otherwise ahead of the device, and each wait idles the GPU while
the host runs the step's edges: clipping, the optimizer, `zero_grad`, the next batch, `model.train()` and the FLOP
count, walks of every module (tens of ms of a Gemma2 LoRA step). Two such waits come with the Trainer's defaults
(transformers 5.7-5.24, accelerate 1.x):

- The NaN/inf loss filter (`logging_nan_inf_filter`, on by default) tests each step's loss on the host,
  `torch.isnan(loss) or torch.isinf(loss)`, and adds a non-finite one to its running loss as
  `_tr_loss / (1 + global_step - _globalstep_last_logged)` instead. Here `training_step` returns the loss where
  it is finite and that replacement where it is not (`torch.where`, no sync), and the flag is off from there
  until the step's next callback (`on_pre_optimizer_step`, or `on_substep_end` between accumulated
  micro-batches) turns it back on, before anything else reads it (evaluation filters its losses with it too).
  The logged losses are the Trainer's own. Where the trainer lacks that state (another transformers) or the loss
  is not a 0-d tensor on the running loss's device, the flag stays as the user set it and the Trainer filters,
  syncing.
- accelerate copies each batch to the device with `non_blocking=False` unless asked (`AcceleratorConfig
  (non_blocking=True)`), and torch waits for the stream after such a copy. With the DataLoader pinning its
  batches (`dataloader_pin_memory`, on by default) the copy is made non-blocking for the run: torch's pinned
  allocator keeps the source until the copy has run.

A third is fastplug's own: its forward reads the rows' lengths and checks their padding
(`models.padding.unmaskable`) to pack them, since the packed row's shape depends on them. Here the trainer's
collator is wrapped for the run (`_CollateReadingRows`): a padded batch is checked where it is collated, on the
host, and the result rides to the device on its mask, so the forward does not wait. A batch changed between the
collator and the forward (a new mask or labels, a write in place) is checked on the device as before.
"""

from __future__ import annotations

import functools

import torch
from transformers import BatchEncoding, TrainerCallback

from ..models.padding import host_padding_facts, note_batch_read_on_host


class SyncFreeSteps(TrainerCallback):
    """`with SyncFreeSteps(trainer): trainer.train()`: the loss filter and the batch copy without their syncs
    (module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.requested = False  # the user's logging_nan_inf_filter, read at __enter__
        self._wrapper = None  # the training_step set on the trainer, while it is set
        self._instance_step = None  # a training_step the trainer instance carried before, put back after
        self._loader_config = None  # accelerate's DataLoaderConfiguration made non-blocking for the run
        self._collator = None  # the trainer's data_collator, while it is wrapped

    def __enter__(self) -> SyncFreeSteps:
        trainer = self.trainer
        config = getattr(getattr(trainer, "accelerator", None), "dataloader_config", None)
        if getattr(trainer.args, "dataloader_pin_memory", False) and getattr(config, "non_blocking", True) is False:
            config.non_blocking, self._loader_config = True, config
        collator = getattr(trainer, "data_collator", None)
        if collator is not None and not isinstance(collator, _CollateReadingRows):
            self._collator = collator
            trainer.data_collator = _CollateReadingRows(self._collator)
        self.requested = bool(getattr(trainer.args, "logging_nan_inf_filter", False))
        if not self.requested:
            return self
        self._instance_step = vars(trainer).get("training_step")
        step = trainer.training_step

        @functools.wraps(step)
        def training_step_filtered_on_device(*args, **kwargs):
            return self._filtered(step(*args, **kwargs))

        trainer.training_step = self._wrapper = training_step_filtered_on_device
        # first, so that no other callback of the step sees the flag off
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def __exit__(self, *exc) -> None:
        if self._loader_config is not None:
            self._loader_config.non_blocking, self._loader_config = False, None
        if self._collator is not None:
            if isinstance(self.trainer.data_collator, _CollateReadingRows):
                self.trainer.data_collator = self._collator
            self._collator = None
        if self._wrapper is None:
            return
        trainer = self.trainer
        if vars(trainer).get("training_step") is self._wrapper:
            if self._instance_step is not None:
                trainer.training_step = self._instance_step
            else:
                del trainer.training_step
        self._wrapper = self._instance_step = None
        if self in trainer.callback_handler.callbacks:
            trainer.callback_handler.callbacks.remove(self)
        self._put_flag_back()

    def _filtered(self, loss):
        """The loss the Trainer's filter would add to its running loss, computed without a sync, or `loss` as it
        came (the Trainer then filters it) where this trainer's state is not the one the filter reads."""
        trainer = self.trainer
        running = getattr(trainer, "_tr_loss", None)
        last_logged = getattr(trainer, "_globalstep_last_logged", None)
        if (
            not isinstance(running, torch.Tensor)
            or not isinstance(last_logged, int)
            or not isinstance(loss, torch.Tensor)
            or loss.dim() != 0
            or loss.device != running.device
            or loss.device.type == "xla"  # the Trainer does not filter there
        ):
            self._put_flag_back()
            return loss
        trainer.args.logging_nan_inf_filter = False
        replacement = running / (1 + trainer.state.global_step - last_logged)
        return torch.where(torch.isfinite(loss), loss, replacement)

    def _put_flag_back(self) -> None:
        self.trainer.args.logging_nan_inf_filter = self.requested

    # The loop's next callbacks after it read the flag: one of them runs before anything else of the step.
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._put_flag_back()

    def on_substep_end(self, args, state, control, **kwargs):
        self._put_flag_back()


class _CollateReadingRows:
    """The trainer's collator, whose padded batches read their padding facts where they are collated (a
    DataLoader worker or the main process) and leave them on their device mask when moved there (`_RowFactsBatch`).
    Every other attribute is the collator's."""

    def __init__(self, collate):
        vars(self)["collate"] = collate

    def __call__(self, features):
        batch = self.collate(features)
        # a dict, or the tokenizer's padded BatchEncoding (no encodings to carry): rebuilt alike after the copy
        if type(batch) is not dict and not (isinstance(batch, BatchEncoding) and batch.encodings is None):
            return batch
        facts = host_padding_facts(batch)
        return batch if facts is None else _RowFactsBatch(batch, facts)

    def __getattr__(self, name):
        try:
            collate = vars(self)["collate"]
        except KeyError:  # while unpickled in a DataLoader worker, before its state is back
            raise AttributeError(name) from None
        return getattr(collate, name)

    def __setattr__(self, name, value):
        setattr(self.collate, name, value)


class _RowFactsBatch(dict):
    """A collated batch and its padding facts (`host_padding_facts`). Moved with `.to(device)`
    (accelerate's `send_to_device`), it comes back as the collator made it, and its device mask carries the facts."""

    def __init__(self, batch, facts: tuple | None = None):  # None: rebuilt by a mapping walk (accelerate's slicing)
        super().__init__(batch)
        self.kind = type(batch)
        self.facts = facts

    def to(self, device, non_blocking: bool = False):
        from accelerate.utils import send_to_device  # what would have moved the batch: every value moves alike

        moved = send_to_device(dict(self), device, non_blocking=non_blocking)
        if self.facts is not None:
            note_batch_read_on_host(moved, self.facts)
        return self.kind(moved)
