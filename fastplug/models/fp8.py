"""KernelOptions.fp8: the frozen linear layers of the decoder layers on FP8 block-scaled weights.

At patch time every nn.Linear inside a decoder layer whose weight is frozen (peft LoRA's base layers among
them) is quantized once into 128x128 FP8 blocks (`fastplug.kernels.fp8`). On the instance, its weight
Parameter is swapped for an FP8 one (`fp8_parameter`: integer-typed, so that a later model.to(dtype) leaves
it alone) with its scales registered beside it as `weight_scale_inv` (so that model.to(device) moves them
along), its forward becomes `fp8_linear`, and the original Parameter's storage is released (the Parameter
object itself is kept for restore). The fused LoRA blocks read the FP8 weight directly (`peft_lora` accepts
these layers as bases).

restore() puts the original Parameter objects back, on the device and in the dtype the model has by then, with
their values bit-exact from a copy kept in CPU memory (fp8_keep_original=True, the default: a restored model is
the model that was patched), or with fp8_keep_original=False dequantized from FP8 (lossy: rounded to the FP8
grid), which restore() then says in a warning.

Layers that transformers loaded in FP8 (fine-grained FP8 checkpoints: its `FP8Linear`, weight plus
`weight_scale_inv`) take fastplug's kernel the same way: their forward is replaced on the instance and their
weight handed out with its scales; restore() puts both back.

Left alone, each with its reason in the summary: trainable weights (FP8 bases are frozen), the LoRA adapters
themselves, the linear gates of MoE blocks (routing is sensitive to rounding, and they are small), layers
with hooks or a forward replaced by someone else, weights shared with layers outside the decoder layers,
and FP8 layers in formats the kernel does not read (per-tensor, UE8M0 or non-square block scales, static
activation scales).
"""

from __future__ import annotations

import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels.fp8 import (
    FP8_DTYPE,
    dequantize_blockwise,
    fp8_linear,
    fp8_parameter,
    fp8_path,
    fp8_weight,
    is_fp8,
    quantize_weight_blockwise,
)

BLOCK = 128
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp8_linear_forward(self, x):
    """The forward of a linear layer on fastplug's FP8 kernel (installed on the instance)."""
    return fp8_linear(x, *fp8_weight(self.weight), self.bias, block=self.weight.fp8_block)


def is_fp8_linear(module: nn.Module) -> bool:
    """True for a linear layer that `convert_to_fp8` put on fastplug's FP8 kernel."""
    forward = vars(module).get("forward")
    return getattr(forward, "__func__", None) is fp8_linear_forward and is_fp8(module.weight)


def _is_transformers_fp8(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and hasattr(module, "weight_scale_inv") and "fp8" in type(module).__module__


def _transformers_fp8_reason(module: nn.Module) -> str | None:
    """Why transformers' FP8Linear `module` cannot run on fastplug's kernel (None: it can)."""
    if module.weight.dtype != FP8_DTYPE:
        return f"FP8Linear holding {str(module.weight.dtype).replace('torch.', '')} weights"
    block = getattr(module, "block_size", None)
    if block is None:
        return "FP8Linear with a per-tensor scale (fastplug reads block scales)"
    if len(block) != 2 or block[0] != block[1] or block[0] not in (32, 64, 128, 256):
        return f"FP8Linear with {tuple(block)} blocks (fastplug reads square power-of-two blocks)"
    if module.weight_scale_inv.dtype != torch.float32:
        return f"FP8Linear with {str(module.weight_scale_inv.dtype).replace('torch.', '')} scales"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return "FP8Linear with static activation scales"
    return None


def _candidates(model: nn.Module):
    """(path, module, decoder layer) of the linear layers inside the decoder layers, minus adapters and MoE
    gates."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    excluded: set[int] = set()
    for module in model.modules():
        for name in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            adapters = getattr(module, name, None)
            if isinstance(adapters, nn.Module):
                excluded.update(id(m) for m in adapters.modules())
        if hasattr(module, "experts"):  # an MoE block: its linear gates (router, shared-expert gate)
            for child in module.children():
                if isinstance(child, nn.Linear) or isinstance(getattr(child, "base_layer", None), nn.Linear):
                    excluded.update(id(m) for m in child.modules())
    for layer_path, layer in model.named_modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        for path, module in layer.named_modules(prefix=layer_path):
            if isinstance(module, nn.Linear) and id(module) not in excluded:
                yield path, module, layer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


@dataclass
class FP8Conversion:
    """What `convert_to_fp8` did: counts and bytes for the summary, the skipped layers, and its undo."""

    quantized: int = 0
    taken_over: int = 0
    original_bytes: int = 0  # the bf16 (fp16, fp32) weights released
    fp8_bytes: int = 0  # their FP8 copies with their scales
    keep_original: bool = True
    device: torch.device | None = None
    skipped: list = field(default_factory=list)  # (path, reason)
    _undo: list = field(default_factory=list)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _warn_lossy(self) -> None:
        # Restore is exact everywhere else in fastplug: a lossy one must not pass unnoticed.
        if self.quantized and not self.keep_original:
            warnings.warn(
                f"fastplug: restore() gave back {self.quantized} frozen linear weights dequantized from FP8, not "
                "their original values (fp8_keep_original=False; each element ~2.6% off). Patch with "
                "fp8_keep_original=True (the default) for an exact restore.",
                stacklevel=4,
            )

    @property
    def layers(self) -> int:
        return self.quantized + self.taken_over

    def describe(self) -> str:
        parts = []
        if self.quantized:
            back = (
                "restore() puts back the originals kept in CPU memory"
                if self.keep_original
                else "restore() puts back weights dequantized from FP8 (lossy: fp8_keep_original=False)"
            )
            parts.append(
                f"{self.quantized} linear layers quantized to FP8 in {BLOCK}x{BLOCK} blocks: weights "
                f"{_size(self.original_bytes)} -> {_size(self.fp8_bytes)} with scales, "
                f"{_size(self.original_bytes - self.fp8_bytes)} saved; {back}"
            )
        if self.taken_over:
            parts.append(f"{self.taken_over} FP8Linear layers of the checkpoint on fastplug's kernel")
        if not parts:
            return "no linear layer converted"
        return "; ".join(parts) + f" (kernel: {fp8_path(self.device or 'cpu')})"


def _owners(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many modules hold it (tied weights are held by several)."""
    count: dict[int, int] = defaultdict(int)
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                count[id(p)] += 1
    return count


def _skip_reason(module: nn.Module, owners: dict[int, int], converting: dict[int, int]) -> str | None:
    if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
        return "forward hooks or a forward replaced on the instance"
    if _is_transformers_fp8(module):
        return _transformers_fp8_reason(module)
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} is not a plain nn.Linear"
    w = module.weight
    if w.requires_grad:
        return "trainable weight (FP8 bases are frozen)"
    if w.dtype not in _FLOAT_DTYPES or w.device.type == "meta":
        return f"weight is {str(w.dtype).replace('torch.', '')} on {w.device.type}"
    if owners[id(w)] > converting[id(w)]:
        return "weight shared with a layer that stays as it is"
    return None


def _quantize(module: nn.Module, layer: nn.Module, conversion: FP8Conversion, done: dict) -> None:
    """Swap module's weight for its FP8 form and its forward for fastplug's; register the undo. `done` maps
    id(original weight) -> FP8 Parameter, so a weight held by several layers is quantized once."""
    weight = module.weight
    fp8 = done.get(id(weight))
    if fp8 is None:
        q, scale = quantize_weight_blockwise(weight.detach(), BLOCK)
        fp8 = done[id(weight)] = fp8_parameter(q, scale, BLOCK)
        kept = weight.data.to("cpu") if conversion.keep_original else None
        conversion.original_bytes += _nbytes(weight)
        conversion.fp8_bytes += _nbytes(q) + _nbytes(scale)
        # a parameter of the layer that had the weight's dtype: it shows a later model.to(dtype)
        witness = next((p for p in layer.parameters() if p.dtype == weight.dtype and p is not weight), None)
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)  # releases the storage

        def put_values_back(weight=weight, fp8=fp8, kept=kept, witness=witness, dtype=weight.dtype):
            # on the device and in the dtype of the model now: it may have been moved or converted since
            dtype = witness.dtype if witness is not None else dtype
            if kept is not None:
                weight.data = kept.to(fp8.device, dtype)
            else:
                weight.data = dequantize_blockwise(*fp8_weight(fp8), BLOCK, dtype)

        conversion._undo.append(put_values_back)  # runs after the modules below have their weight back
    _install(module, fp8, conversion)
    conversion.quantized += 1


def _install(module: nn.Module, fp8: nn.Parameter, conversion: FP8Conversion) -> None:
    """The FP8 weight and its scales registered on the module (so that they move with it), fastplug's forward
    on the instance; the undo puts back what was there (transformers' FP8Linear has its own scales)."""
    originals = {name: module._parameters.get(name) for name in ("weight", "weight_scale_inv")}
    bound = types.MethodType(fp8_linear_forward, module)
    module._parameters["weight"], module._parameters["weight_scale_inv"] = fp8, fp8.fp8_scale
    module.forward = bound

    def undo(module=module, originals=originals, bound=bound):
        for name, original in originals.items():
            if original is None:
                del module._parameters[name]
            else:
                module._parameters[name] = original
        if vars(module).get("forward") is bound:
            del module.forward

    conversion._undo.append(undo)


def _take_over(module: nn.Module, conversion: FP8Conversion) -> None:
    """transformers' FP8Linear on fastplug's kernel: the same storage, handed out with its scales."""
    weight, scale = module.weight, module.weight_scale_inv
    fp8 = fp8_parameter(weight, scale, int(module.block_size[0]))

    def follow(weight=weight, scale=scale, fp8=fp8):  # transformers' tensors take the bytes as they are now
        weight.data, scale.data = fp8_weight(fp8)

    conversion._undo.append(follow)
    _install(module, fp8, conversion)
    conversion.taken_over += 1


def meta_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters on the meta device that nothing will load: those under an accelerate hook (its
    offload brings them in at forward time) do not count."""
    found: list[str] = []

    def walk(module: nn.Module, prefix: str, hooked: bool) -> None:
        hooked = hooked or hasattr(module, "_hf_hook")
        for name, p in module._parameters.items():
            if p is not None and p.is_meta and not hooked:
                found.append(prefix + name)
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", hooked)

    walk(model, "", False)
    return found


def _check_materialised(model: nn.Module) -> None:
    # Other patches read the weights at call time and so survive loading after patching (FSDP2's meta-device
    # init); FP8 quantizes the values now, and a meta weight skipped would stay bf16 once loaded, unnoticed.
    names = meta_parameters(model)
    if names:
        total = sum(1 for _ in model.parameters())
        raise ValueError(
            f"fastplug: fp8=True quantizes the weights' values at patch time, but {len(names)} of {total} parameters "
            f"of this {type(model).__name__} are on the meta device (e.g. {names[0]}): it was built without its "
            "weights (torch.device('meta'), init_empty_weights). Load them first (from_pretrained, or to_empty() "
            "and load_state_dict()), then patch; or patch with fp8=False."
        )


def convert_to_fp8(model: nn.Module, keep_original: bool = True) -> FP8Conversion:
    """Put the decoder layers' frozen linears of this model instance on FP8 (see the module docstring)."""
    _check_materialised(model)  # before converting anything: raising later would strand FP8 layers unrestorable
    conversion = FP8Conversion(keep_original=keep_original)
    conversion._undo.append(conversion._warn_lossy)  # runs last: after every weight is back
    candidates = list(_candidates(model))
    owners = _owners(model)
    converting: dict[int, int] = defaultdict(int)
    for _, module, _ in candidates:
        converting[id(module.weight)] += 1
    left: dict[str, list[str]] = defaultdict(list)
    done: dict = {}
    for path, module, layer in candidates:
        reason = _skip_reason(module, owners, converting)
        if reason is not None:
            left[reason].append(path)
        elif _is_transformers_fp8(module):
            _take_over(module, conversion)
        else:
            _quantize(module, layer, conversion, done)
        if reason is None and conversion.device is None:
            conversion.device = module.weight.device
    for reason, paths in left.items():
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        conversion.skipped.append((paths[0] + more, f"fp8: left as it is: {reason}"))
    return conversion
