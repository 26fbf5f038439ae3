"""KernelOptions: the one set of switches every adapter (callback, TRL, Lightning, patch_model) takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Union

CheckpointingMode = Union[bool, Literal["offload", "auto"]]
# The options the HF and TRL adapters apply through the trainer's arguments rather than through the patch.
CHECKPOINTING_OPTIONS = frozenset({"gradient_checkpointing", "memory_budget"})


def check_checkpointing_mode(value, name: str = "gradient_checkpointing") -> None:
    """Raise unless `value` is True, False, "offload" or "auto" (1 and 0 are not taken for booleans)."""
    if value is not True and value is not False and not (isinstance(value, str) and value in ("offload", "auto")):
        raise ValueError(f"{name} must be True, False, 'offload' or 'auto'; got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # True is an int, not a fraction


@dataclass(frozen=True)
class KernelOptions:
    """Which parts of a model fastplug replaces. Everything suitable is on by default."""

    rms_norm: bool = True
    layer_norm: bool = True
    rope: bool = True
    mlp: bool = True
    cross_entropy: bool = True  # fused LM-head loss: out.logits is None in training with labels (models/lm_head.py)
    lora: bool = True
    attention: bool = True  # fastplug's attention (Triton flash kernel / SDPA dispatcher; varlen on packed rows)
    moe: bool = True  # MoE experts on the grouped GEMM kernels (LoRA on experts too), the fused router
    # Frozen q/k/v and gate/up base weights moved into one matrix per layer while patched (no extra memory; each
    # parameter's data a block of it, own storage again after restore()): one GEMM per group (models/stacking.py).
    # None: on when a trainer adapter patches for one run; off for patch_model and FastModel, whose patch may
    # outlive training (a model merged and saved with safetensors while patched would have shared storage).
    stack_projections: bool | None = None
    # True: the model's own non-reentrant checkpointing; "offload": layer inputs kept in pinned CPU memory;
    # "auto": checkpoint only as many layers as the GPU's memory needs (measured at the first step);
    # False: leave the model's setting alone.
    gradient_checkpointing: CheckpointingMode = True
    memory_budget: float = 0.9  # "auto": the fraction of the device's memory a step's peak may reach
    # Replay each decoder layer's forward and backward as CUDA graphs from the second batch shape (training,
    # unpacked rows, no dropout): the host then issues a few calls per layer instead of dozens of kernels.
    # Memory: one arena of hidden-state buffers for the largest shape, and each shape's graphs' own buffers
    # (fastplug/patch/layer_graphs.py). None (the default): on for a model on a CUDA device, and a later shape is
    # captured only while what the graphs keep stays within graphs_memory; True: up to four shapes; False: off.
    cuda_graphs: bool | None = None
    # cuda_graphs=None: the most memory the captured graphs may keep beyond the first shape's, as a fraction of the
    # peak an eager step of the shape to capture would reach (weights, optimizer state, activations): the peak
    # allocated before the first capture, its activations scaled up for a larger shape.
    graphs_memory: float = 0.5
    # Training batches padded on the right (the collator's dynamic padding) run without a mask, and their rows
    # are padded on to one of a few lengths (four per doubling), or on to a longer length the graphs replay, so
    # that captured graphs serve every batch; the pads' labels are ignored, so losses and gradients are unchanged
    # (models/padding.py). None: with the graphs (on where they are installed).
    bucket_lengths: bool | None = None
    # FP8 block-scaled bases: the frozen linears of the decoder layers quantized once at patch time (128x128
    # blocks, the bf16 copies freed from the GPU) and run on the FP8 GEMM; layers already in FP8 (transformers'
    # fine-grained FP8 checkpoints) take fastplug's kernel. restore() gives back the originals, kept in CPU
    # memory meanwhile (exact, as every other patch); False saves that host memory, and restore() then gives
    # back weights dequantized from FP8 (~2.6% off per element) with a warning.
    fp8: bool = False
    fp8_keep_original: bool = True

    # gc.freeze() while patched: Python's full collections skip the half-million objects alive at patch time
    # (0.3 s each on an H100 host); the last restore() unfreezes (fastplug/patch/host_gc.py). None: on when a
    # trainer adapter (FastKernels, the TRL trainers, the Lightning strategies) patches for one run and
    # restores at its end; off for patch_model and FastModel, whose patch may outlive the user's interest in
    # the model (a model dropped without restore() would stay frozen, GPU memory and all).
    freeze_gc: bool | None = None
    # At patch time, check each kind of patch against the original modules on this model (a few random tokens
    # through the first decoder layers, the LM-head loss and one cached decode step, in the model's dtype);
    # a kind that disagrees is not installed, with a warning (fastplug/patch/self_check.py).
    self_check: bool = True

    def __post_init__(self):
        # Switches must be real bools: a truthy string (rope="no") or a number would turn a kernel on silently.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(
                    f"fastplug option {f.name} must be True or False; got {value!r} ({type(value).__name__})"
                )
            if f.type in ("bool | None", bool | None) and value is not None and not isinstance(value, bool):
                raise TypeError(
                    f"fastplug option {f.name} must be True, False or None; got {value!r} ({type(value).__name__})"
                )
        if not (_is_number(self.memory_budget) and 0 < self.memory_budget <= 1):
            raise ValueError(f"memory_budget must be a fraction in (0, 1]; got {self.memory_budget!r}")
        if not (_is_number(self.graphs_memory) and self.graphs_memory > 0):
            raise ValueError(
                f"graphs_memory must be a positive fraction of the peak memory; got {self.graphs_memory!r}"
            )
        check_checkpointing_mode(self.gradient_checkpointing)

    def buckets_on(self) -> bool:
        """Whether training rows are padded on to bucket lengths; cuda_graphs=None must be resolved first (the
        patch decides it: PatchHandle.options)."""
        if self.bucket_lengths is not None:
            return self.bucket_lengths
        if self.cuda_graphs is None:
            raise ValueError("buckets_on() needs cuda_graphs resolved to True or False")
        return self.cuda_graphs

    def scoped_to_run(self) -> "KernelOptions":
        """These options as a trainer adapter applies them: its patch lasts one run, so freeze_gc and
        stack_projections None are on."""
        scoped = {name: True for name in ("freeze_gc", "stack_projections") if getattr(self, name) is None}
        return dataclasses.replace(self, **scoped) if scoped else self

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def set_by_caller(
        cls, options: "KernelOptions | Mapping[str, Any] | None" = None, overrides: Iterable[str] = ()
    ) -> frozenset[str]:
        """The names a caller set: the keywords it passed, the keys of a dict `options`, and the fields of a
        KernelOptions `options` that differ from the defaults (a KernelOptions cannot tell a default passed on
        purpose from one left alone)."""
        if isinstance(options, Mapping):
            return frozenset(overrides) | frozenset(options)
        defaults = cls()
        changed = {n for n in cls.field_names() if options is not None and getattr(options, n) != getattr(defaults, n)}
        return frozenset(overrides) | changed

    @classmethod
    def build(cls, options: "KernelOptions | Mapping[str, Any] | None" = None, **overrides: Any) -> "KernelOptions":
        """`options` (a KernelOptions, a dict of option names to values, or None for the defaults) with `overrides`
        applied; unknown names raise TypeError listing valid ones."""
        if isinstance(options, Mapping):
            options, overrides = None, {**options, **overrides}
        unknown = sorted(set(overrides) - set(cls.field_names()))
        if unknown:
            raise TypeError(
                f"unknown fastplug option(s) {', '.join(unknown)}; valid options are: {', '.join(cls.field_names())}"
            )
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a KernelOptions or a dict, got {type(options).__name__}")
        return dataclasses.replace(options or cls(), **overrides)
