"""Lightning adapter: strategies that run a LightningModule's transformers models through fastplug's kernels.

    import fastplug                                  # registers the names below in Lightning's StrategyRegistry
    L.Trainer(strategy="fastkernels")                # one device (the accelerator's)
    L.Trainer(strategy="fastkernels_ddp")            # DDP
    L.Trainer(strategy="fastkernels_fsdp")           # FSDP2 (fully_shard), on Lightning's ModelParallelStrategy
    L.Trainer(strategy=FastKernelsStrategy(options=KernelOptions(lora=False)))

Each strategy subclasses Lightning's own (so every isinstance check in Lightning holds), patches the
PreTrainedModel / PeftModel submodules of the LightningModule in `setup()` before the model is wrapped and
the optimizers are built, and restores them in `teardown()`, which Lightning also calls after an exception. A
patch a model carried before (from patch_model or FastModel) is kept and stays after the run; options set here
that differ from it raise ValueError.

`fastkernels_fsdp` is FSDP2: Lightning 2.6's FSDPStrategy wraps with FSDP1 (FullyShardedDataParallel), its
ModelParallelStrategy is the one built on `fully_shard`, and it expects the LightningModule's `configure_model`
to shard. FastKernelsFSDPStrategy runs every device data-parallel (tensor_parallel_size=1) and, right after the
module's own `configure_model`, patches the transformers models and shards each of them the way accelerate does
(`fastplug.integrations.fsdp.shard_model`: every decoder layer, an untied LM head and embedding, the model) unless
`configure_model` applied `fully_shard` itself; then fastplug patches already sharded models, which works as well
(patched modules read their parameters at call time, inside FSDP2's hooks).

lightning.pytorch and pytorch_lightning each have their own strategy classes and registry, so the classes
are built per strategies package (`strategy_classes(module)`). This module imports neither at import time:
`register_strategies` runs from an import hook while `lightning.pytorch` itself may still be importing.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

from ..options import CHECKPOINTING_OPTIONS, KernelOptions

if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    raise ImportError('fastplug.integrations.lightning needs Lightning: pip install "fastplug[lightning]"')

__all__ = [
    "FastKernelsDDPStrategy",  # noqa: F822 (made on first use by __getattr__)
    "FastKernelsFSDPStrategy",  # noqa: F822 (made on first use by __getattr__)
    "FastKernelsMixin",  # the former name of LightningFastKernelsMixin
    "FastKernelsStrategy",  # noqa: F822 (made on first use by __getattr__)
    "LightningFastKernelsMixin",
    "find_transformers_models",
    "register_strategies",
    "strategy_classes",
]

logger = logging.getLogger(__name__)

# registry name -> (class name, Lightning base class in the strategies package)
_STRATEGIES = {
    "fastkernels": ("FastKernelsStrategy", "SingleDeviceStrategy"),
    "fastkernels_ddp": ("FastKernelsDDPStrategy", "DDPStrategy"),
    "fastkernels_fsdp": ("FastKernelsFSDPStrategy", "ModelParallelStrategy"),
}
_PYTORCH_LIGHTNING_SUFFIX = "PL"  # class names of the pytorch_lightning variants, so pickle finds each one
_classes_by_package: dict[str, dict[str, type]] = {}


class LightningFastKernelsMixin:
    """Patches the LightningModule's transformers models for the length of a run.

    Put it before a Lightning strategy in the bases; it takes one extra keyword, `options` (a KernelOptions or a
    dict, default: everything suitable on).
    """

    def __init__(self, *args, options: KernelOptions | None = None, **kwargs):
        self.fast_kernels = KernelOptions.build(options)
        self._set_by_user = KernelOptions.set_by_caller(options)  # checked against a patch a model already carries
        self.fast_kernel_handles = []
        self._own_handles = []  # those this strategy made: a patch a model carried before outlives the run
        self.fast_kernels_summary = ""
        self._patched_paths = []  # where each handle's model sits in the LightningModule
        super().__init__(*args, **kwargs)

    def setup(self, trainer) -> None:
        # Before super().setup(): that converts precision, moves to the device, wraps (DDP/FSDP) and builds the
        # optimizers, and all of those must see the patched modules.
        self._patch_fast_kernels(fitting=trainer.state.fn == "fit")
        super().setup(trainer)
        if self.fast_kernel_handles:
            from ..patch.engine import kernel_path_of

            # After super().setup(), so the kernel path is that of the device the model now lives on.
            self.fast_kernels_summary = "\n".join(
                f"[{path}] {handle.summary()}\n  kernel path: {kernel_path_of(handle.model)}"
                for path, handle in zip(self._patched_paths, self.fast_kernel_handles)
            )
            if self.is_global_zero:
                print(self.fast_kernels_summary)

    def teardown(self) -> None:
        try:
            self.restore_fast_kernels()
        finally:
            super().teardown()

    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        """Lightning's move of a batch, a padded batch's padding checked on the host first and carried on its device
        mask (`models.padding.host_padding_facts`), so the patched forward need not read it from the device (a host
        sync a step). Only where Lightning's own hooks move the batch: one of the user's could change what the
        device gets."""
        from ..models.padding import host_padding_facts, note_batch_read_on_host

        facts = None
        if self.fast_kernel_handles and _moves_batches_as_lightning(self.lightning_module):
            facts = host_padding_facts(batch)
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if facts is not None:
            note_batch_read_on_host(moved, facts)
        return moved

    def restore_fast_kernels(self) -> None:
        """Restore the patches this strategy made (a patch made before stays; harmless when already restored)."""
        for handle in self._own_handles:
            handle.restore()
        self.fast_kernel_handles, self._own_handles = [], []

    def _patch_fast_kernels(self, fitting: bool) -> None:
        if self.fast_kernel_handles:
            return
        from ..patch.engine import patch_for_run

        module = self.lightning_module
        models = find_transformers_models(module)
        if not models:
            logger.warning(
                "fastplug: found no transformers PreTrainedModel or PeftModel inside %s; nothing was patched",
                type(module).__name__,
            )
            return
        # Checkpointing only pays off when training; patch_model turns it on and restore() turns it off.
        options = self.fast_kernels if fitting else KernelOptions.build(self.fast_kernels, gradient_checkpointing=False)
        set_by_user = self._set_by_user if fitting else self._set_by_user - CHECKPOINTING_OPTIONS
        patched = [patch_for_run(model, options.scoped_to_run(), set_by_user) for _, model in models]
        self.fast_kernel_handles = [handle for handle, _ in patched]
        self._own_handles = [handle for handle, made in patched if made]
        self._patched_paths = [path for path, _ in models]


def _moves_batches_as_lightning(module) -> bool:
    """Whether `module` (and its trainer's DataModule) leave the move of a batch to the device to Lightning:
    `transfer_batch_to_device` and `on_after_batch_transfer` not overridden."""
    datamodule = getattr(getattr(module, "_trainer", None), "datamodule", None)
    for owner in (module, datamodule):
        for hook in ("transfer_batch_to_device", "on_after_batch_transfer"):
            if (
                owner is not None
                and getattr(getattr(type(owner), hook, None), "__qualname__", "") != f"DataHooks.{hook}"
            ):
                return False
    return True


FastKernelsMixin = LightningFastKernelsMixin  # its former name (the TRL adapter had a class of the same name)


def find_transformers_models(module) -> list[tuple[str, object]]:
    """(path, model) for each outermost PreTrainedModel or PeftModel inside `module` (the module itself included)."""
    # A module that holds a transformers model was built after transformers was imported: no import needed here.
    model_types = tuple(
        getattr(sys.modules[package], name)
        for package, name in (("transformers", "PreTrainedModel"), ("peft", "PeftModel"))
        if package in sys.modules
    )
    if not model_types:
        return []
    found = []

    def visit(path, child):
        if isinstance(child, model_types):
            found.append((path or type(child).__name__, child))
            return  # a PeftModel's inner PreTrainedModel is patched through the PeftModel
        for name, grandchild in child.named_children():
            visit(f"{path}.{name}" if path else name, grandchild)

    visit("", module)
    return found


class _DeviceFromAccelerator:
    """FastKernelsStrategy's addition to SingleDeviceStrategy: without a device it takes the accelerator's."""

    def __init__(self, device=None, **kwargs):
        super().__init__(device="cpu" if device is None else device, **kwargs)
        # Lightning's connector fills `parallel_devices` from the accelerator on a strategy that has the attribute
        # and leaves it empty. Without it, a SingleDeviceStrategy built from the registry (no arguments) stays on
        # the CPU even when the accelerator is a GPU.
        self.parallel_devices = [] if device is None else [self._root_device]

    @property
    def root_device(self):
        return self.parallel_devices[0] if self.parallel_devices else self._root_device

    def setup_environment(self) -> None:
        if len(self.parallel_devices) > 1:
            raise ValueError(
                f"strategy {self.strategy_name!r} runs on one device, got devices={len(self.parallel_devices)}; "
                "use strategy='fastkernels_ddp' for several"
            )
        super().setup_environment()


class _ShardsWithFSDP2:
    """FastKernelsFSDPStrategy's addition to ModelParallelStrategy: data parallel over every device, and a
    `configure_model` for the run that patches and shards the transformers models (see the module docstring).

    `fsdp_kwargs` go to each `fully_shard` call (mp_policy, offload_policy, reshard_after_forward).
    """

    def __init__(self, *args, data_parallel_size="auto", tensor_parallel_size=1, fsdp_kwargs=None, **kwargs):
        super().__init__(*args, data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         **kwargs)  # fmt: skip
        self.fsdp_kwargs = dict(fsdp_kwargs or {})

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == 1:
            self._data_parallel_size = self.num_nodes * self.num_processes  # Lightning's "auto" is the node count
        super().setup_environment()
        # An instance attribute, so that Lightning calls it (it calls configure_model only where overridden) and
        # ModelParallelStrategy.setup finds it overridden; teardown removes it.
        self.lightning_module.configure_model = types.MethodType(_configure_patch_and_shard, self.lightning_module)

    def teardown(self) -> None:
        module = self.lightning_module
        ours = getattr(vars(module).get("configure_model"), "__func__", None) if module is not None else None
        if ours is _configure_patch_and_shard:
            del module.configure_model
        super().teardown()


def _configure_patch_and_shard(module) -> None:
    from torch.distributed.fsdp import FSDPModule

    from .fsdp import shard_model

    type(module).configure_model(module)  # the module's own first: it may build the models, or shard them
    strategy = module.trainer.strategy
    strategy._patch_fast_kernels(fitting=module.trainer.state.fn == "fit")
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return
    mesh = strategy.device_mesh["data_parallel"]
    for _, model in find_transformers_models(module):
        shard_model(model, mesh=mesh, **strategy.fsdp_kwargs)


def strategy_classes(strategies) -> dict[str, type]:
    """{registry name: strategy class} built on the Lightning strategies package `strategies` (cached)."""
    if strategies.__name__ not in _classes_by_package:
        _classes_by_package[strategies.__name__] = _build_classes(strategies)
    return _classes_by_package[strategies.__name__]


def _build_classes(strategies) -> dict[str, type]:
    # Only the strategies package is touched: lightning.pytorch may still be importing when this runs.
    suffix = "" if strategies.__name__ == "lightning.pytorch.strategies" else _PYTORCH_LIGHTNING_SUFFIX
    classes = {}
    for registry_name, (class_name, base_name) in _STRATEGIES.items():
        bases = (LightningFastKernelsMixin, getattr(strategies, base_name))
        if base_name == "SingleDeviceStrategy":
            bases = (_DeviceFromAccelerator, *bases)
        elif base_name == "ModelParallelStrategy":
            bases = (_ShardsWithFSDP2, *bases)
        namespace = {
            "__module__": __name__,
            "__qualname__": class_name + suffix,
            "__doc__": f"Lightning's {base_name} with fastplug's kernels (registered as {registry_name!r}).",
            "strategy_name": registry_name,
        }
        classes[registry_name] = type(class_name + suffix, bases, namespace)
    return classes


def register_strategies(strategies) -> None:
    """Register the fastplug strategies in the StrategyRegistry of `strategies` (idempotent)."""
    registry = strategies.StrategyRegistry
    for registry_name, cls in strategy_classes(strategies).items():
        if registry_name not in registry:
            registry.register(registry_name, cls, description=cls.__doc__)


def _default_strategies():
    """lightning.pytorch's strategies package, or pytorch_lightning's when only that one is installed."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(f"{package}.strategies")
        except ImportError:
            continue
    raise ImportError('fastplug.integrations.lightning needs Lightning: pip install "fastplug[lightning]"')


def __getattr__(name):
    """FastKernelsStrategy & co. subclass Lightning's classes, so they are built on first use."""
    for registry_name, (class_name, _) in _STRATEGIES.items():
        if name == class_name:
            return strategy_classes(_default_strategies())[registry_name]
        if name == class_name + _PYTORCH_LIGHTNING_SUFFIX:
            return strategy_classes(importlib.import_module("pytorch_lightning.strategies"))[registry_name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
