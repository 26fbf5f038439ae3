"""The patching engine: apply the matching rules of `fastplug.models` to ONE model instance, remember what
was there, and put it back.

A patch is an instance attribute: `module.forward = MethodType(new_forward, module)`. The class, the
transformers/peft module globals and every other model in the process are never touched; restoring deletes
the attribute, so the class's forward is what runs again (bit-identical outputs). Modules whose forward was
already replaced on the instance by someone else (TRL's fused LM head, accelerate hooks) are left alone.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections import Counter
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from ..kernels import state
from ..models import RULES, SUPPORTED_FAMILIES, MatchContext, Patch, Skip, family_of
from ..models.fp8 import convert_to_fp8
from ..models.padding import BatchPaths, RowLengths, bucketed_decoder, pad_slack
from ..models.peft_lora import watch_adapter_writes
from ..models.projections import forget_step_views
from ..models.structure import decoder_layers, decoder_stack, other_towers, unwrap
from ..options import KernelOptions
from ..versions import warn_untested_versions
from . import checkpointing, host_gc, layer_graphs, self_check
from .module_walks import ModuleWalks
from .self_check import verify

_HANDLE_ATTRIBUTE = "_fastplug_handle"
_warned_model_types: set[str] = set()


def active_handle(model: nn.Module) -> "PatchHandle | None":
    handle = vars(unwrap(model)).get(_HANDLE_ATTRIBUTE)
    return handle if handle is not None and handle.is_active else None


class _Installed:
    """One patch on one module: installed and taken off again (by restore(), or by the self-check)."""

    def __init__(self, path: str, module: nn.Module, patch: Patch):
        self.path, self.module, self.patch = path, module, patch
        self.bound = None  # the bound forward we installed
        self.undo = None  # what the patch's switch returned
        self.active = False

    def install(self) -> None:
        if self.active:
            return
        if self.patch.forward is not None:
            self.bound = types.MethodType(self.patch.forward, self.module)
            self.module.forward = self.bound  # nn.Module.__setattr__ stores a plain attribute in the instance __dict__
        if self.patch.switch is not None:
            self.undo = self.patch.switch()
        self.active = True

    def uninstall(self) -> None:
        if not self.active:
            return
        if self.bound is not None and vars(self.module).get("forward") is self.bound:
            del self.module.forward
        if self.undo is not None:
            self.undo()
            self.undo = None
        self.active = False


class PatchHandle:
    """What `patch_model` did to one model; `restore()` undoes all of it (a second call does nothing)."""

    def __init__(self, model: nn.Module, options: KernelOptions):
        self.model = model
        self.family = family_of(model)
        # derived once: the rules, the self-check, checkpointing and the graphs all take these
        self.decoder = decoder_stack(model)
        self.layers = decoder_layers(model)
        # cuda_graphs=None resolved here, before the rules run (bucketed lengths go with the graphs), so that these
        # options say what runs; the memory cap is the default's only
        wanted = options.cuda_graphs
        self.graphs_off = (
            None if wanted is False else layer_graphs.why_not(self.decoder, self.layers, placed=wanted is None)
        )
        self.graphs_memory = options.graphs_memory if wanted is None else None
        if wanted is None:
            options = dataclasses.replace(options, cuda_graphs=self.graphs_off is None)
        self.options = options
        self.counts: dict[str, int] = {}
        self.skipped: list[tuple[str, str]] = []
        self.checkpointing: str | None = None
        self._records: list[_Installed] = []  # every patch applied, in order
        self._checkpointing_snapshot = None
        self._undo: list = []  # run in reverse by restore(): fp8's undo, the patches' removal, graphs, gc
        self.paths: list[tuple[str, str]] = []  # (module path, the implementation it takes)
        self._adapter_watch = None  # the forward pre-hook that keeps fused LoRA's adapter copies current
        self.fp8: str | None = None  # what the fp8 option did, for the summary
        self.graphs: layer_graphs.LayerGraphs | None = None
        self.batch_paths = BatchPaths()  # training forwards by the path their batch took (models/padding.py)
        # what training rows are padded on to (models/padding.py): buckets, and lengths the layer graphs replay
        self.row_lengths = (
            RowLengths(pad_slack(self.layers, getattr(model, "config", None))) if options.buckets_on() else None
        )
        self._fp8_layers = 0
        self.check: self_check.Report | None = None
        self.is_active = False

    # -- applying
    def _apply(self, path: str, module: nn.Module, patch: Patch) -> None:
        record = _Installed(path, module, patch)
        record.install()
        self._records.append(record)
        for child, reason in patch.notes:
            self.skipped.append((f"{path}.{child}" if path else child, reason))

    def _uninstall_all(self) -> None:
        for record in reversed(self._records):
            record.uninstall()
        forget_step_views(self.model)  # the patched forwards' views of the projections hold their tensors

    def _tally(self) -> None:
        """counts, paths and the fused-LoRA count from the patches in place now."""
        active = [r for r in self._records if r.active]
        counts = Counter(r.patch.kind for r in active)
        lora_fused = sum(r.patch.lora_fused for r in active)
        if lora_fused:
            counts["lora_fused"] = lora_fused
        if self._fp8_layers:
            counts["fp8_linear"] = self._fp8_layers
        self.counts = dict(counts)
        self.paths = [(r.path, r.patch.path_taken) for r in active if r.patch.path_taken]

    def _convert_fp8(self) -> None:
        """fp8=True: the decoder linears on FP8 weights, before the rules run (their fused LoRA views then see
        the FP8 bases); undone last by restore()."""
        if not self.options.fp8:
            return
        conversion = convert_to_fp8(self.model, keep_original=self.options.fp8_keep_original)
        self._undo.append(conversion.undo)
        self.fp8, self._fp8_layers = conversion.describe(), conversion.layers
        self.skipped += conversion.skipped

    def _patch_modules(self, outer: nn.Module) -> None:
        ctx = MatchContext(
            root=self.model,
            decoder=self.decoder,
            family=self.family,
            options=self.options,
            batch_paths=self.batch_paths,
            row_lengths=self.row_lengths,
        )
        # a multimodal model's vision tower and projector stay as they are
        outside = other_towers(self.model, self.decoder)
        self.skipped += [(path, "not the language model: left as it is") for path in outside]
        for path, module in self.model.named_modules():
            if any(path == o or path.startswith(o + ".") for o in outside):
                continue
            for rule in RULES:
                result = rule(module, ctx)
                if result is None:
                    continue
                replaced_by_someone = "forward" in vars(module) or (module is self.model and "forward" in vars(outer))
                if isinstance(result, Patch) and replaced_by_someone:
                    result = Skip(
                        result.kind, "forward already replaced on this instance by another library; left alone"
                    )
                if isinstance(result, Skip):
                    self.skipped.append((path or type(module).__name__, f"{result.kind}: {result.reason}"))
                else:
                    self._apply(path, module, result)
                break
        self._undo.append(self._uninstall_all)
        if self.options.lora:  # adapters may be added or enabled after patching: watch whenever LoRA is on
            self._adapter_watch = watch_adapter_writes(self.decoder)
        self._tally()

    def _self_check(self) -> None:
        """Keep only the kinds of patch that agree with the original modules on this model (self_check.py)."""
        self.check = verify(self.model, self.layers, self._records, self.options, self.family is not None)
        for kind, why in self.check.declined:
            self.skipped.append((kind, f"declined by the self-check: {why}"))
        self.batch_paths.clear()  # the check's own forwards are not the user's batches
        self._tally()

    def _enable_checkpointing(self) -> None:
        mode = self.options.gradient_checkpointing
        if not mode:
            return
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            self.skipped.append((type(self.model).__name__, "gradient checkpointing: not supported by this model"))
            return
        self.enable_checkpointing(mode)

    def enable_checkpointing(self, mode) -> None:
        """Checkpointing in `mode` (True, "offload", "auto") on the patched model, owned by this handle: restore()
        undoes it. FastModel turns it on through here after patching, so its "auto" plan's hooks go with the patch."""
        if self._checkpointing_snapshot is None:
            self._checkpointing_snapshot = checkpointing.snapshot(self.model)
        if isinstance(self.checkpointing, checkpointing.AutoCheckpointing) and mode != "auto":
            self.checkpointing.remove()  # its hooks would go on setting the layers' flags under the new mode
        self.checkpointing = checkpointing.enable(self.model, mode, self.options.memory_budget)

    def _install_buckets(self) -> None:
        """Rows padded on to bucket lengths at the decoder stack too, for loss paths that are not fastplug's (TRL's
        LM head, a user's loss on the hidden states): models/padding.py."""
        if self.row_lengths is None or self.decoder is None:
            return
        if "forward" in vars(self.decoder):
            self.skipped.append(("bucket_lengths", "the decoder stack's forward is replaced on this instance already"))
            return
        padded = self.decoder.forward = bucketed_decoder(
            self.decoder, self.decoder.forward, self.row_lengths, self.batch_paths
        )

        def undo(decoder=self.decoder):
            if vars(decoder).get("forward") is padded:  # as `_Installed.uninstall`: only what this patch put there
                del decoder.forward

        self._undo.append(undo)

    def _install_graphs(self) -> None:
        if self.graphs_off is not None:
            if self.graphs_memory is None:  # asked for (cuda_graphs=True), and cannot be: the user hears why
                self.skipped.append(("cuda_graphs", self.graphs_off))
            return
        if not self.options.cuda_graphs:
            return
        self.graphs = layer_graphs.LayerGraphs(self.decoder, self.layers, memory_cap=self.graphs_memory)
        self._undo.append(self.graphs.remove)
        if self.row_lengths is not None:  # batches may be padded on to a longer length the graphs replay
            self.row_lengths.graphs = self.graphs
            self._undo.append(partial(setattr, self.row_lengths, "graphs", None))

    # -- undoing
    def restore(self) -> None:
        if not self.is_active:
            return
        while self._undo:
            self._undo.pop()()
        state.release()  # the kernels' state (the optimizer hook, the caches): the last restore empties it
        if self._adapter_watch is not None:
            self._adapter_watch.remove()
            self._adapter_watch = None
        if isinstance(self.checkpointing, checkpointing.AutoCheckpointing):
            self.checkpointing.remove()
        if self._checkpointing_snapshot is not None:
            checkpointing.restore(self._checkpointing_snapshot)
            self._checkpointing_snapshot = None
        vars(self.model).pop(_HANDLE_ATTRIBUTE, None)
        self.is_active = False

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    # -- reporting
    def summary(self) -> str:
        family = self.family.name if self.family else "unknown family: structural rules only"
        state = "active" if self.is_active else "restored"
        lines = [f"fastplug patch of {type(self.model).__name__} ({family}), {state}"]
        counted = ", ".join(f"{kind}: {n}" for kind, n in self.counts.items()) or "nothing"
        lines.append(f"  patched: {counted}")
        if self.checkpointing:
            lines.append(f"  gradient checkpointing: {self.checkpointing}")
        if self.fp8:
            lines.append(f"  fp8: {self.fp8}")
        if self.graphs is not None:
            lines.append(f"  {self.graphs}")
        elif self.graphs_off is not None:
            lines.append(f"  CUDA graphs of the decoder layers: off ({self.graphs_off})")
        paths = str(self.batch_paths)
        if paths:
            lines.append(f"  padded training batches (models/padding.py): {paths}")
        if self.check is not None:
            lines += self.check.lines()
        if self.paths:
            lines.append("  paths:")
            lines += [f"    {path}: {taken}" for path, taken in self.paths]
        if self.skipped:
            lines.append(f"  skipped ({len(self.skipped)}):")
            lines += [f"    {path}: {reason}" for path, reason in self.skipped]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<PatchHandle {type(self.model).__name__} {'active' if self.is_active else 'restored'} {self.counts}>"


def patch_model(model: nn.Module, options: KernelOptions | dict | None = None, **overrides) -> PatchHandle:
    """Patch this model instance (a PreTrainedModel or a peft PeftModel, on any device); returns the handle.
    `options`: a KernelOptions or a dict of its fields; keywords (`patch_model(model, mlp=False)`) override it.

    Patching an already patched model returns its active handle when the options the caller set are those it
    was patched with, and raises ValueError naming them when they differ (restore() first). Each kind of patch
    is checked against the original modules on this model before it is kept (`self_check`, see
    fastplug/patch/self_check.py).
    """
    wanted = KernelOptions.build(options, **overrides)
    existing = active_handle(model)
    if existing is not None:
        _check_same_options(existing.options, wanted, KernelOptions.set_by_caller(options, overrides))
        return existing
    warn_untested_versions()  # once per process: a dependency newer than the newest tested
    base = unwrap(model)
    handle = PatchHandle(base, wanted)
    if handle.family is None:
        _warn_unknown(base)
    handle._convert_fp8()
    handle._patch_modules(model)
    handle._self_check()
    handle._enable_checkpointing()
    handle._install_graphs()
    handle._install_buckets()
    handle._undo.append(ModuleWalks(model, base).install())  # the trainers' per-step walks of the module tree
    if wanted.freeze_gc:  # last: the patch's own objects are frozen too
        handle._undo.append(host_gc.hold())
    state.acquire()  # only now: a patch that failed above holds nothing
    handle.is_active = True
    vars(base)[_HANDLE_ATTRIBUTE] = handle  # bypasses nn.Module.__setattr__: a plain instance attribute
    return handle


def patch_for_run(
    model: nn.Module, options: KernelOptions, set_by_user: Iterable[str], **overrides
) -> tuple[PatchHandle, bool]:
    """What the trainer adapters patch with: (the handle, whether this call made it). A patch the user or FastModel
    made is kept, with its options, and outlives the run (the adapter restores only a patch it made); an option
    the user set (`set_by_user`) that differs from it raises ValueError rather than being dropped."""
    existing = active_handle(model)
    if existing is not None:
        _check_same_options(existing.options, options, set_by_user)
        return existing, False
    return patch_model(model, options, **overrides), True


def _check_same_options(patched: KernelOptions, wanted: KernelOptions, names: Iterable[str]) -> None:
    """ValueError naming each option in `names` (those the caller set: run-scoped defaults are not the user's)
    on which `wanted` differs from the options the model is patched with."""

    def in_place(name: str):  # None as the patch applied it: off outside a run (scoped_to_run resolves it there)
        value = getattr(patched, name)
        if value is None:
            return patched.buckets_on() if name == "bucket_lengths" else False
        return value

    changed = [
        f"{name}={getattr(wanted, name)!r} (patched with {getattr(patched, name)!r})"
        for name in KernelOptions.field_names()
        if name in names and getattr(wanted, name) not in (None, in_place(name))
    ]
    if changed:
        raise ValueError(
            "fastplug: this model is already patched with other options: "
            + ", ".join(changed)
            + ". Call restore() on its handle (fastplug.patch.engine.active_handle(model)) before patching again, "
            "or pass the options it was patched with (or none) to keep that patch."
        )


def _warn_unknown(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    if model_type in _warned_model_types:
        return
    _warned_model_types.add(model_type)
    warnings.warn(
        f"fastplug: model type {model_type!r} is not a supported family ({SUPPORTED_FAMILIES}); "
        "patching only the modules its structural rules recognise",
        stacklevel=3,
    )


def kernel_path_of(model: nn.Module) -> str:
    """Words for the logs: which path the kernels take for this model's parameters."""
    from ..kernels._utils import kernel_path

    parameter = next(model.parameters(), None)
    return kernel_path(parameter.device if parameter is not None else torch.device("cpu"))
