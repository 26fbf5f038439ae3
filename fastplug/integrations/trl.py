"""TRL adapter: SFT and DPO trainers that run the model through fastplug's kernels while they train, and
(from grpo.py, imported on first use) FastGRPOTrainer / FastRLOOTrainer with fast rollouts and fused log-probs.

    from fastplug.integrations.trl import FastSFTTrainer
    trainer = FastSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)   # options=KernelOptions(...)
    trainer.train()

The model (and DPO's reference model) is patched once TRL has finished its own set-up, and restored when
`train()` returns or raises; a patch a model carried before (from patch_model or FastModel) is kept and stays
after training, and options set here that differ from it raise ValueError. TRL computes its training loss through
a fused LM head that it installs as the model's instance `forward`; fastplug leaves that forward alone and
patches the layers underneath it.
"""

from __future__ import annotations

import sys
import warnings

import torch

from ..options import CHECKPOINTING_OPTIONS, KernelOptions

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as err:
    raise ImportError(f'fastplug.integrations.trl needs TRL: pip install "fastplug[trl]" ({err})') from err
from ..models.fast_attention import DOCUMENT_BOUNDS
from ..models.padding import packed_batch
from ..models.structure import unwrap
from ..patch.engine import kernel_path_of, patch_for_run
from .fsdp import accelerate_fsdp2_plugin, peft_units_for_accelerate
from .hf_trainer import LIGER_CONFLICT
from .trainer_checkpointing import RunCheckpointing
from .trainer_syncs import SyncFreeSteps

__all__ = [
    "FastDPOTrainer",
    "FastGRPOTrainer",  # noqa: F822 (built from grpo.py on first use by __getattr__)
    "FastKernelsMixin",  # the former name of TRLFastKernelsMixin
    "FastRLOOTrainer",  # noqa: F822 (built from grpo.py on first use by __getattr__)
    "FastSFTTrainer",
    "TRLFastKernelsMixin",
]


class TRLFastKernelsMixin:
    """Patches a TRL trainer's models with fastplug for the length of `train()`.

    Put it before the TRL trainer in the bases; it takes one extra keyword, `options` (a KernelOptions or a dict,
    default: everything suitable on), as every fastplug entry point does; `fast_kernels`, its former name, still
    works with a DeprecationWarning.
    """

    def __init__(self, *args, options: KernelOptions | dict | None = None, fast_kernels=None, **kwargs):
        options = _options_or_deprecated(options, fast_kernels)
        self.fast_kernels = KernelOptions.build(options)
        # What the user set, checked against a patch a model already carries (checkpointing goes through the
        # trainer's arguments whatever the patch did).
        self._set_by_user = KernelOptions.set_by_caller(options) - CHECKPOINTING_OPTIONS
        self.fast_kernel_handles = []
        self._own_handles = []  # those this trainer made: a patch the model carried before outlives the run
        self.fast_kernels_summary = ""
        # a callback too: at each step's begin the mode goes on the layers again (TRL's DPO turns plain
        # checkpointing on again after every reference pass)
        options = self.fast_kernels
        self._checkpointing = RunCheckpointing(options.gradient_checkpointing, options.memory_budget)
        self._undo_fsdp = None  # accelerate's FSDP2 plugin as it was (peft_units_for_accelerate)
        super().__init__(*args, **kwargs)
        # After TRL's set-up (PEFT wrapping, fused LM head, reference model), before the optimizer exists.
        self._patch_fast_kernels()
        self.add_callback(self._checkpointing)

    # Whether this trainer's loss reads only the real tokens' outputs of TRL's fused LM head (SFT): its padded
    # batches may then run packed (`_packed_fused_head`)
    packs_fused_head = False

    def train(self, *args, **kwargs):
        self._patch_fast_kernels()  # again when an earlier train() has restored the model
        self._unpack_head = self._pack_fused_head() if self.packs_fused_head else None
        if self.is_world_process_zero():
            print(self.fast_kernels_summary)
        try:
            with SyncFreeSteps(self):  # the Trainer's steps without their waits for the device
                return super().train(*args, **kwargs)
        finally:
            self.restore_fast_kernels()

    def _pack_fused_head(self):
        """Wrap TRL's fused-LM-head forward of the trained model so that its padded batches run packed; returns
        the undo (None where there is no such head or no active patch)."""
        model = unwrap(self.accelerator.unwrap_model(self.model))
        trl_forward = vars(model).get("forward")
        handle = self.fast_kernel_handles[0] if self.fast_kernel_handles else None
        if trl_forward is None or handle is None or not handle.is_active:
            return None
        packed = model.forward = _packed_fused_head(
            model, trl_forward, handle.family, handle.row_lengths, handle.batch_paths
        )

        def undo():
            if vars(model).get("forward") is packed:
                model.forward = trl_forward

        return undo

    def restore_fast_kernels(self) -> None:
        """Restore the patches this trainer made (a patch made before stays) and the checkpointing settings
        (harmless when already restored)."""
        if getattr(self, "_unpack_head", None) is not None:
            self._unpack_head()
            self._unpack_head = None
        for handle in self._own_handles:
            handle.restore()
        self.fast_kernel_handles, self._own_handles = [], []
        self._checkpointing.restore(self.args, self.model)
        if self._undo_fsdp is not None:
            self._undo_fsdp()
            self._undo_fsdp = None

    def _patch_fast_kernels(self) -> None:
        if self.fast_kernel_handles:
            return
        models = {"model": self.model}
        if getattr(self, "ref_model", None) is not None:  # DPO with a separate reference model
            models["ref_model"] = self.ref_model
        sections = []
        if getattr(self.args, "use_liger_kernel", False):
            # Both replace the same modules, and Liger is applied later, in train(): it wins, like with FastKernels.
            warnings.warn(LIGER_CONFLICT, stacklevel=3)
            models, sections = {}, [LIGER_CONFLICT]
        for role, model in models.items():
            model = self.accelerator.unwrap_model(model)
            # Checkpointing goes through the trainer's arguments (TRL toggles it around DPO's reference pass).
            handle, made = patch_for_run(
                model, self.fast_kernels.scoped_to_run(), self._set_by_user, gradient_checkpointing=False
            )
            self.fast_kernel_handles.append(handle)
            if made:
                self._own_handles.append(handle)
            sections.append(
                f"[{role}] {handle.summary()}\n  loss path: {_loss_path(model)}\n  kernel path: {kernel_path_of(model)}"
            )
        self._checkpointing.ask(self.args, self.model)
        self._undo_fsdp = peft_units_for_accelerate(self.model, accelerate_fsdp2_plugin(self.accelerator))
        sections.append(f"  gradient checkpointing: {self._checkpointing.describe(self.args)}")
        self.fast_kernels_summary = "\n".join(sections)


def _options_or_deprecated(options, fast_kernels):
    """`options`, or `fast_kernels` (its former spelling) with a DeprecationWarning."""
    if fast_kernels is None:
        return options
    if options is not None:
        raise TypeError("fastplug: pass options=, not both options= and fast_kernels= (its deprecated name)")
    # Point the warning at the user's call, above the mixins' __init__ chain (GRPO's adds a frame), so that
    # Python's default filters show it.
    frame, stacklevel = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fastplug."):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(
        "fastplug: fast_kernels= is deprecated; pass options=KernelOptions(...) (or a dict), the keyword every "
        "fastplug entry point takes",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return fast_kernels


FastKernelsMixin = TRLFastKernelsMixin  # its former name (the Lightning adapter had a class of the same name)


def _loss_path(model) -> str:
    """Words for the summary: which code computes the training loss."""
    if "forward" in vars(unwrap(model)):
        return (
            "TRL's fused LM head (its chunked log-prob kernel, the model's instance forward, left in place); "
            "fastplug's kernels run in the layers underneath"
        )
    return "the model's own forward (fastplug's fused linear cross-entropy where the LM head is patched)"


def _packed_fused_head(model, forward, family, row_lengths, paths):
    """TRL's fused-LM-head forward (the model's instance `forward`) with a right-padded training batch whose pads
    predict nothing run packed into one row (`models.padding.packed_batch`: each row a document, the pads gone).
    SFT reads the per-token outputs (log-probs, label mask, entropy, top-1) at the real tokens' predictions only,
    and sums them; each comes back in the batch's shape, zeros at the pads, so every use of them is unchanged.
    Anything else (router logits asked, pre-shifted labels, positions passed) runs as given."""

    def packed_forward(*args, **kwargs):
        input_ids = kwargs.get("input_ids")
        if (
            not kwargs.get("fused_lm_head")  # passed on only where given: an older TRL's forward has no such keyword
            or args
            or input_ids is None
            or not (model.training and torch.is_grad_enabled())
            or any(kwargs.get(k) is not None for k in ("shift_labels", "position_ids"))
            or kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False))
        ):
            return forward(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "labels", "fused_lm_head")}
        mask, labels = kwargs.get("attention_mask"), kwargs.get("labels")
        batch = packed_batch(model, input_ids, mask, labels, rest, row_lengths, family, paths)
        if batch is None:
            return forward(**kwargs)
        rest[DOCUMENT_BOUNDS] = batch.bounds
        output = forward(
            input_ids=batch.input_ids,
            attention_mask=batch.decoder_mask,
            labels=batch.labels,
            position_ids=batch.position_ids,
            fused_lm_head=True,
            **rest,
        )
        rows, tokens = input_ids.shape
        length = batch.input_ids.shape[1]
        for name, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1:
                if value.shape[1] in (length, length - 1):  # per token (shifted: one position shorter)
                    output[name] = batch.unpacked(value, rows, tokens)[:, : tokens - (length - value.shape[1])]
        return output

    return packed_forward


class FastSFTTrainer(TRLFastKernelsMixin, SFTTrainer):
    """TRL's SFTTrainer with fastplug's kernels; takes `options=KernelOptions(...)`. A right-padded batch runs
    packed into one row through TRL's fused LM head (`_packed_fused_head`)."""

    packs_fused_head = True


class FastDPOTrainer(TRLFastKernelsMixin, DPOTrainer):
    """TRL's DPOTrainer with fastplug's kernels on the policy and the reference model.

    Takes `options=KernelOptions(...)`."""


def __getattr__(name):
    # The RL trainers (fast rollouts, fused log-probs) come from grpo.py, imported and built on first use.
    if name not in ("FastGRPOTrainer", "FastRLOOTrainer"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import grpo

    cls = globals()[name] = grpo.rl_trainer(name, TRLFastKernelsMixin)
    return cls
