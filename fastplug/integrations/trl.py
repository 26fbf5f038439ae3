"""TRL adapter: SFT and DPO trainers that run the model through fastplug's kernels while they train.

    from fastplug.integrations.trl import FastSFTTrainer
    trainer = FastSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)   # fast_kernels=KernelOptions(...)
    trainer.train()

The model (and DPO's reference model) is patched once TRL has finished its own set-up, and restored when
`train()` returns or raises. TRL computes its training loss through a fused LM head that it installs as the
model's instance `forward`; fastplug leaves that forward alone and patches the layers underneath it.
"""

from __future__ import annotations

import logging

from ..options import KernelOptions

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as err:
    raise ImportError(f'fastplug.integrations.trl needs TRL: pip install "fastplug[trl]" ({err})') from err

__all__ = ["FastDPOTrainer", "FastKernelsMixin", "FastSFTTrainer"]

logger = logging.getLogger(__name__)


class FastKernelsMixin:
    """Patches a TRL trainer's models with fastplug for the length of `train()`.

    Put it before the TRL trainer in the bases; it takes one extra keyword, `fast_kernels` (a KernelOptions,
    default: everything suitable on).
    """

    def __init__(self, *args, fast_kernels: KernelOptions | None = None, **kwargs):
        self.fast_kernels = KernelOptions.build(fast_kernels)
        self.fast_kernel_handles = []
        self.fast_kernels_summary = ""
        super().__init__(*args, **kwargs)
        _configure_checkpointing(self.args, self.fast_kernels.gradient_checkpointing)
        # After TRL's set-up (PEFT wrapping, fused LM head, reference model), before the optimizer exists.
        self._patch_fast_kernels()

    def train(self, *args, **kwargs):
        self._patch_fast_kernels()  # again when an earlier train() has restored the model
        try:
            return super().train(*args, **kwargs)
        finally:
            self.restore_fast_kernels()

    def restore_fast_kernels(self) -> None:
        """Put every original module back (harmless when already restored)."""
        for handle in self.fast_kernel_handles:
            handle.restore()
        self.fast_kernel_handles = []

    def _models_to_patch(self) -> dict:
        models = {"model": self.model}
        if getattr(self, "ref_model", None) is not None:  # DPO with a separate reference model
            models["ref_model"] = self.ref_model
        return {role: self.accelerator.unwrap_model(model) for role, model in models.items()}

    def _patch_fast_kernels(self) -> None:
        if self.fast_kernel_handles:
            return
        from ..patching import patch_model

        sections = []
        for role, model in self._models_to_patch().items():
            handle = patch_model(model, self.fast_kernels)
            self.fast_kernel_handles.append(handle)
            sections.append(f"[{role}] loss path: {_loss_path(model)}\n{handle.summary()}")
        self.fast_kernels_summary = "\n".join(sections)
        logger.info("fastplug patched %s:\n%s", type(self).__name__, self.fast_kernels_summary)


def _configure_checkpointing(args, mode) -> None:
    """Turn on the trainer's own activation checkpointing when the options ask for it (False: leave it alone)."""
    if not mode:
        return
    # transformers 5.23 names it activation_checkpointing; older 5.x only gradient_checkpointing.
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, True)
    if mode == "offload":
        kwargs_name = next(
            name for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs") if hasattr(args, name)
        )
        setattr(args, kwargs_name, {**(getattr(args, kwargs_name) or {}), "offload": True})


def _loss_path(model) -> str:
    """Words for the summary: which code computes the training loss."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "forward" in vars(base):
        return (
            "TRL's fused LM head (its chunked log-prob kernel, installed as the model's instance forward); "
            "fastplug's kernels run in the layers underneath it"
        )
    return "the model's own forward (fastplug's cross-entropy when it is patched)"


class FastSFTTrainer(FastKernelsMixin, SFTTrainer):
    """TRL's SFTTrainer with fastplug's kernels; takes `fast_kernels=KernelOptions(...)`."""


class FastDPOTrainer(FastKernelsMixin, DPOTrainer):
    """TRL's DPOTrainer with fastplug's kernels (policy and reference model); takes `fast_kernels=KernelOptions(...)`."""
