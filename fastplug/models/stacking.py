"""Frozen base weights of projections that read one input (q/k/v, gate/up), stacked into one matrix.

The fused LoRA blocks then run one GEMM for all the bases of a group and one for all its adapters' B
(`fastplug.kernels.lora.StackedBase`): about twenty fewer launches per decoder layer, which is what a model of
many thin layers is short of when the host sets the pace.

No memory is added: the parameters stay the same objects, and each one's data becomes a row block of the
stacked matrix (the old storage is freed). Only frozen, dense, plain, contiguous 2-D weights that own their
storage, of one dtype and device, are stacked, with their biases when every projection has one. So
trainable bases (full fine-tuning: checkpoints save each weight), FP8 bases, and sharded or flattened
parameters (DeepSpeed; FSDP2 units from the patched model down to the owner) keep their own storage.
bitsandbytes 4-bit bases stay where they are: their group is dequantized into one matrix (the buffer
dequantized weights share) right before each GEMM.

A group is stacked when patched if its weights are on an accelerator already (the trainer adapters patch a
model placed on its device), else at its first call outside torch.compile. Never later, under a compiled
model: a compiled graph that took the weights as inputs would go on reading them where they were (Inductor
addresses its inputs' storage), so stacking from an eager stretch of a compiled model's run (a graph break)
gave wrong numbers. Compiled, the fused LoRA operators find the stacked bases where they lie. Anything that
re-points a weight afterwards (`model.to()`, sharding) is seen at the next call by the weights' data
pointers: the group then runs unstacked for good. restore() gives each parameter its own storage back (a
copy of its block: safetensors refuses tensors that share storage).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..kernels.fp8 import is_fp8
from ..kernels.lora import QUANTIZED_STACK, LoRAProjection, StackedBase, is_stacked
from ..kernels.quant import is_4bit, shape_4bit
from .projections import fused_projections
from .rules import is_fsdp


class _Group:
    __slots__ = ("stacked", "params", "off", "path")

    def __init__(self, path: list):
        self.stacked: StackedBase | None = None
        self.params: list = []  # weakrefs to the stacked weights and biases, for restore
        self.off = False  # not eligible, or re-pointed since stacking: run unstacked
        self.path = path  # weakrefs to the patched model and the modules down to the owner (FSDP2 units)


# owner module (an attention or MLP block) -> its group; one group per owner
_GROUPS: "weakref.WeakKeyDictionary[nn.Module, _Group]" = weakref.WeakKeyDictionary()


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _ineligible(weights: list, biases: list) -> str | None:
    """Why these weights cannot be stacked (None: they can)."""
    first = weights[0]
    for t in [*weights, *(b for b in biases if b is not None)]:
        if is_4bit(t) or is_fp8(t):
            return "quantized"
        if t.requires_grad:
            return "trainable"
        if type(t.data) is not torch.Tensor or t.device.type == "meta":
            return f"a {type(t.data).__name__} on {t.device.type}"
        if t.dtype != first.dtype or t.device != first.device:
            return "mixed dtypes or devices"
        if not t.is_contiguous() or not _owns_storage(t):
            return "shares its storage"
    if any(w.dim() != 2 or w.shape[1] != first.shape[1] for w in weights):
        return "different input widths"
    if len({b is None for b in biases}) > 1:
        return "biases on some projections only"
    return None


def _stack(tensors: list) -> torch.Tensor:
    """One buffer holding `tensors` along dim 0; each tensor's data becomes its block (the old storage is freed)."""
    stacked = torch.cat([t.detach() for t in tensors])
    for t, block in zip(tensors, stacked.split([t.shape[0] for t in tensors])):
        t.data = block
    return stacked


def _path(root: nn.Module, owner: nn.Module) -> list:
    """Weakrefs to `root` and every module from it down to `owner`, both included."""
    name = next((n for n, m in root.named_modules() if m is owner), "")
    parts = name.split(".") if name else []
    return [weakref.ref(root.get_submodule(".".join(parts[:i]))) for i in range(len(parts) + 1)]


def _sharded(group: _Group) -> bool:
    """Whether FSDP2 manages the owner's parameters: inside its forward they are plain tensors that own their
    storage, but FSDP frees and refills that storage around each use, and a stacked copy would stay behind
    (the whole model's q/k/v and gate/up unsharded on every rank)."""
    return any(is_fsdp(m) for m in (ref() for ref in group.path) if m is not None)


def switch(owner: nn.Module, root: nn.Module, names: tuple[str, ...]):
    """A Patch switch: stacks the group of `owner`'s projections `names` (in the model `root`) now if they are on
    an accelerator, else lets `stacked_base` do it at their next call; returns the undo."""

    def apply():
        _GROUPS[owner] = _Group(_path(root, owner))
        projs = fused_projections(*(getattr(owner, name) for name in names))
        if projs is not None and projs[0].weight.device.type not in ("cpu", "meta"):
            stacked_base(owner, projs)

        def undo():
            group = _GROUPS.pop(owner, None)
            if group is None or group.stacked is None:
                return
            params = [ref() for ref in group.params]
            half = len(params) // 2 if group.stacked.bias is not None else len(params)
            weights, biases = params[:half], params[half:] or [None] * half
            if all(p is not None for p in params) and is_stacked(group.stacked, weights, biases):
                for p in params:  # each its own storage again (one group's worth of memory at a time)
                    p.data = p.data.clone()

        return undo

    return apply


def _quantized_group(weights: list, biases: list) -> bool:
    """4-bit bases of one input width without biases: dequantized together at each use (nothing is moved)."""
    return (
        all(is_4bit(w) for w in weights)
        and all(b is None for b in biases)
        and len({shape_4bit(w)[1] for w in weights}) == 1
    )


def _in_compiled_run() -> bool:
    """Whether this runs inside a torch.compile'd call, in an eager stretch between its graphs (Dynamo's frame
    callback is set for the whole call)."""
    get_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return get_callback is not None and get_callback() is not None


def stacked_base(owner: nn.Module, projs: list[LoRAProjection]) -> StackedBase | None:
    """The StackedBase of `owner`'s projections as they stand now (stacking them at the first call outside a
    compiled run), or None: not enabled for this owner, not eligible, re-pointed since, not stacked yet, or
    traced by torch.compile. bitsandbytes 4-bit bases (QLoRA) are not moved: their group is dequantized into
    one matrix right before each GEMM."""
    if torch.compiler.is_compiling():  # first: Dynamo traced the weak-keyed lookup into wrong numbers
        return None
    group = _GROUPS.get(owner)
    if group is None or group.off:
        return None
    weights, biases = [p.weight for p in projs], [p.bias for p in projs]
    if group.stacked is None and is_4bit(weights[0]):
        return QUANTIZED_STACK if _quantized_group(weights, biases) else None
    if group.stacked is not None:
        if is_stacked(group.stacked, weights, biases):
            return group.stacked
        group.off, group.stacked, group.params = True, None, []
        return None
    if _in_compiled_run():
        return None
    if _ineligible(weights, biases) is not None or _sharded(group):
        group.off = True
        return None
    with torch.no_grad():
        bias = _stack(biases) if biases[0] is not None else None
        group.stacked = StackedBase(_stack(weights), bias)
    group.params = [weakref.ref(t) for t in [*weights, *(b for b in biases if b is not None)]]
    return group.stacked
