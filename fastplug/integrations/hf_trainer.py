"""`FastKernels`: the Hugging Face `TrainerCallback`.

    Trainer(model=model, args=args, train_dataset=ds, callbacks=[FastKernels()])

- on_init_end (end of Trainer.__init__: model on its device, no optimizer yet): patch the model; turn on
  gradient checkpointing through the Trainer's own arguments when asked (the Trainer enables it in train()).
- on_train_begin: `model_init` may have re-created the model: patch the new one; put the options' checkpointing
  mode on the layers the Trainer turned checkpointing on for (`trainer_checkpointing.RunCheckpointing`, also at
  each step's begin); print the patch summary once.
- on_log: tokens/s (non-padding tokens of the training forwards since the previous log) and peak GPU memory.
- on_train_end: restore the model (and the checkpointing setting we changed). A patch the model carried before
  (from patch_model or FastModel) is kept, and stays after training; an option set here that differs from it
  raises ValueError in on_init_end.

The Trainer has no event for a `train()` that raises, so `FastKernels` wraps the `train` of the Trainer that
constructed it (found on the call stack of `on_init_end`): an exception restores the model as `on_train_end`
does, and a later `train()` patches it again. The same wrapper removes the Trainer's per-step waits for the
device for the run (`trainer_syncs.SyncFreeSteps`: the loss filter runs on the device, pinned batches are copied
non-blocking): each would idle the GPU while the host does the rest of the step.

Under accelerate's FSDP2 a peft model is sharded per decoder layer (`peft_units_for_accelerate`), as the
model without peft is.

With `use_liger_kernel=True` as well, Liger wins: both replace the same modules, so fastplug leaves the
model's modules alone (a warning says so) and only does gradient checkpointing and the logging.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import warnings

import torch
from transformers import TrainerCallback

from ..models.structure import unwrap
from ..options import CHECKPOINTING_OPTIONS, KernelOptions
from ..patch.engine import kernel_path_of, patch_for_run
from .fsdp import accelerate_fsdp2_plugin, peft_units_for_accelerate
from .trainer_checkpointing import RunCheckpointing, checkpointing_in
from .trainer_syncs import SyncFreeSteps

LIGER_CONFLICT = (
    "fastplug: FastKernels and use_liger_kernel=True both replace the model's modules and conflict. "
    "Liger wins: fastplug leaves the modules alone and only handles gradient checkpointing and logging. "
    "Set use_liger_kernel=False to use fastplug's kernels."
)


class _TokenCounter:
    """Counts the tokens of training forwards with a removable forward pre-hook on the model."""

    def __init__(self):
        self.tokens = 0
        self._pending: list[torch.Tensor] = []
        self._hook = None

    def attach(self, model: torch.nn.Module) -> None:
        self.detach()
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @torch.compiler.disable  # a compiled model (torch_compile=True) runs it eagerly: no guards on the list
    def _count(self, module, args, kwargs):
        if not module.training:
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(mask, torch.Tensor):
            self._pending.append(mask.detach().sum())  # summed lazily: no GPU sync per step
        elif isinstance(ids, torch.Tensor):
            self.tokens += ids.numel()

    def take_lazy(self) -> torch.Tensor | int:
        """The count since the last take, as a device tensor while masks were counted (no sync)."""
        pending, self._pending = self._pending, []
        total, self.tokens = self.tokens + sum(pending), 0
        return total

    def take(self) -> int:
        return int(self.take_lazy())


class FastKernels(TrainerCallback):
    """Patch the Trainer's model with fastplug's kernels for the duration of training.

    `options` is a `fastplug.KernelOptions` or a dict of its fields; the fields may also be given as keywords,
    which override `options` (unknown names raise TypeError).
    """

    def __init__(self, options: KernelOptions | dict | None = None, **overrides):
        self.options = KernelOptions.build(options, **overrides)
        # What the user set, checked against a patch the model already carries; checkpointing goes through the
        # Trainer's arguments whatever the patch did.
        self._set_by_user = KernelOptions.set_by_caller(options, overrides) - CHECKPOINTING_OPTIONS
        self.handle = None
        self._owns_handle = False  # False for a patch the model carried before: it outlives the run
        self.summary: str | None = None
        self._liger = False
        self.checkpointing = RunCheckpointing(self.options.gradient_checkpointing, self.options.memory_budget)
        self._tokens = _TokenCounter()
        self._window_start: float | None = None
        self._undo_fsdp = None  # accelerate's FSDP2 plugin as it was (peft_units_for_accelerate)

    # ------------------------------------------------------------------------------------------ patching
    def _patch(self, model) -> None:
        if self._liger or model is None:
            return
        if self.handle is not None and self.handle.is_active and self.handle.model is unwrap(model):
            return
        if self.handle is not None and self._owns_handle:  # model_init replaced the model: the old one goes back
            self.handle.restore()
        # Checkpointing goes through the Trainer's arguments (below), not through patch_model.
        self.handle, self._owns_handle = patch_for_run(
            model, self.options.scoped_to_run(), self._set_by_user, gradient_checkpointing=False
        )

    def _wrap_train(self) -> None:
        """The constructing Trainer's `train` runs its steps without waiting for the device (SyncFreeSteps) and
        restores the model on an exception."""
        trainer = self._calling_trainer()
        if trainer is None or getattr(trainer.train, "_fastplug_restores", False):
            return
        train = trainer.train

        @functools.wraps(train)
        def train_then_restore_on_error(*args, **kwargs):
            try:
                with SyncFreeSteps(trainer):
                    return train(*args, **kwargs)
            except BaseException:
                self.on_train_end(trainer.args, trainer.state, trainer.control, model=trainer.model)
                # a retry starts as the first run
                self.checkpointing.ask(trainer.args, trainer.model)
                raise

        train_then_restore_on_error._fastplug_restores = True
        trainer.train = train_then_restore_on_error

    def _calling_trainer(self):
        """The Trainer whose __init__ is running this callback's on_init_end (the frame whose `self` lists us)."""
        frame = inspect.currentframe()
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and any(cb is self for cb in getattr(handler, "callbacks", ())):
                return candidate
            frame = frame.f_back
        return None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._wrap_train()
        if getattr(args, "use_liger_kernel", False):
            self._liger = True
            warnings.warn(LIGER_CONFLICT, stacklevel=2)
        self._patch(model)
        self.checkpointing.ask(args, model)
        if model is not None and self._undo_fsdp is None:  # the Trainer made its accelerator in __init__
            self._undo_fsdp = peft_units_for_accelerate(model, accelerate_fsdp2_plugin())

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._patch(model)
        self.checkpointing.follow(model)  # the Trainer turned it on, on every layer
        if model is not None:
            self._tokens.attach(model)
        self._tokens.take()
        self._window_start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if self.summary is None:
            self.summary = self._describe(args, model)
            if state.is_local_process_zero:
                print(self.summary)

    def _describe(self, args, model) -> str:
        lines = [LIGER_CONFLICT] if self._liger else [self.handle.summary()] if self.handle else []
        if model is not None:
            lines.append(f"  kernel path: {kernel_path_of(model)}")
        if checkpointing_in(args):
            lines.append(f"  gradient checkpointing: {self.checkpointing.describe(args)}")
        return "\n".join(lines)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.checkpointing.follow(model)

    # ------------------------------------------------------------------------------------------- logging
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self._window_start is None or not any(k in logs for k in ("loss", "train_loss")):
            return
        now = time.perf_counter()
        tokens = self._tokens.take()
        elapsed, self._window_start = now - self._window_start, now
        extra = {}
        if tokens and elapsed > 0:
            extra["tokens_per_second"] = round(tokens / elapsed, 1)
        if torch.cuda.is_available():
            extra["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        checkpointed = self.checkpointing.checkpointed_layers()  # how many layers "auto" checkpoints now
        if checkpointed is not None:
            extra["checkpointed_layers"] = checkpointed
        logs.update(extra)
        if state.log_history:  # the Trainer stored a copy of `logs` before calling us
            state.log_history[-1].update(extra)

    # ----------------------------------------------------------------------------------------- restoring
    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._tokens.detach()
        if self._undo_fsdp is not None:
            self._undo_fsdp()
            self._undo_fsdp = None
        if self.handle is not None:
            if self.handle.graphs is not None:  # how far the graphs served, before restore() drops them
                logging.getLogger("fastplug").info("fastplug %s", self.handle.graphs)
            if self._owns_handle:
                self.handle.restore()
        self.checkpointing.restore(args, model)
