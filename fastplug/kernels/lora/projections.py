"""The projections a fused LoRA block runs: `LoRAProjection` (one linear layer with an optional adapter),
`StackedBase` (frozen bases that lie as row blocks of one matrix), the input checks, the flat parameter order
(`_flatten`), and the adapters of projections sharing one input side by side along the rank (`_Adapters`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._utils import check_same_device
from ..fp8 import is_fp8
from ..quant import is_4bit, shape_4bit


class LoRAProjection(NamedTuple):
    """One linear layer with an optional LoRA adapter: y = x W^T + b + scaling * (x A^T) B^T."""

    weight: torch.Tensor  # [out, in]; frozen (LoRA) or trainable (full fine-tuning); or a bnb 4-bit / FP8 weight
    bias: torch.Tensor | None  # [out]
    lora_A: torch.Tensor | None  # [r, in]; None: plain linear
    lora_B: torch.Tensor | None  # [out, r]
    scaling: float


class StackedBase(NamedTuple):
    """The frozen base weights (and biases) of projections that read one input, as row blocks of one matrix:
    projection i's weight IS rows [o_i, o_i + out_i) of `weight`, in the same storage (`fastplug.models.stacking`
    arranges that). The blocks then run one GEMM for every base and one for every adapter's B.
    weight None: the bases are bitsandbytes 4-bit weights (no biases), dequantized together into the shared
    buffer right before each GEMM that reads them (`quant.dequantize_4bit_stacked`)."""

    weight: torch.Tensor | None  # [sum out_i, in]
    bias: torch.Tensor | None  # [sum out_i], each projection's bias a block of it; None: no projection has one


QUANTIZED_STACK = StackedBase(None, None)


# --------------------------------------------------------------------------------------------- checks


def _weight_shape(w: torch.Tensor) -> tuple:
    return shape_4bit(w) if is_4bit(w) else tuple(w.shape)


def _check_projection(name: str, proj, x: torch.Tensor, in_features=None, out_features=None) -> None:
    """proj must fit an input x [..., in_features] (default: x's last dim); raises ValueError naming it."""
    if not isinstance(proj, LoRAProjection):
        raise ValueError(f"{name} must be a LoRAProjection; got {type(proj).__name__}")
    in_features = x.shape[-1] if in_features is None else in_features
    w = proj.weight
    shape = _weight_shape(w)
    if len(shape) != 2 or shape[1] != in_features:
        raise ValueError(f"{name}.weight must have shape [out, {in_features}]; got {shape}")
    out = shape[0]
    if out_features is not None and out != out_features:
        raise ValueError(f"{name}.weight must have {out_features} output features; got {shape}")
    if w.requires_grad and (is_4bit(w) or is_fp8(w)):
        raise ValueError(f"{name}.weight is a quantized weight that requires grad; quantized bases must be frozen")
    if proj.bias is not None and tuple(proj.bias.shape) != (out,):
        raise ValueError(f"{name}.bias must have shape ({out},); got {tuple(proj.bias.shape)}")
    a, b = proj.lora_A, proj.lora_B
    if (a is None) != (b is None):
        raise ValueError(f"{name}.lora_A and {name}.lora_B must be both given or both None")
    if a is not None:
        if a.dim() != 2 or a.shape[1] != in_features:
            raise ValueError(f"{name}.lora_A must have shape [r, {in_features}]; got {tuple(a.shape)}")
        if tuple(b.shape) != (out, a.shape[0]):
            raise ValueError(f"{name}.lora_B must have shape ({out}, {a.shape[0]}); got {tuple(b.shape)}")
        if not isinstance(proj.scaling, (int, float)):
            raise ValueError(f"{name}.scaling must be a Python number; got {type(proj.scaling).__name__}")
    device = x.device
    for t in proj[:4]:  # a loop, not any(genexpr): this runs for every projection of every layer
        if t is not None and t.device != device:  # the message is built only on failure
            check_same_device(x=x, **{f"{name}.{k}": getattr(proj, k) for k in ("weight", "bias", "lora_A", "lora_B")})


def _block_ptr(t: torch.Tensor, row: int) -> int:
    return t.data_ptr() + row * t.stride(0) * t.element_size()


def is_stacked(stacked: StackedBase, weights, biases) -> bool:
    """Whether `weights` (and `biases`) are, in order, the row blocks of `stacked` (same storage)."""
    w, b, row = stacked.weight, stacked.bias, 0
    for weight, bias in zip(weights, biases):
        if (
            weight.dim() != 2
            or weight.stride() != w.stride()
            or weight.shape[1] != w.shape[1]
            or weight.data_ptr() != _block_ptr(w, row)
            or (bias is None) != (b is None)
            or (b is not None and bias.data_ptr() != _block_ptr(b, row))
        ):
            return False
        row += weight.shape[0]
    return row == w.shape[0]


def _check_stacked(stacked, projs, x: torch.Tensor) -> None:
    if not isinstance(stacked, StackedBase):
        raise ValueError(f"stacked must be a StackedBase or None; got {type(stacked).__name__}")
    if stacked.weight is None:
        if stacked.bias is not None or not all(is_4bit(p.weight) and p.bias is None for p in projs):
            raise ValueError("a StackedBase without weight stands for 4-bit bases without biases")
        return
    if any(is_4bit(p.weight) or is_fp8(p.weight) or p.weight.requires_grad for p in projs):
        raise ValueError("stacked bases must be frozen dense weights (not quantized, no grad)")
    if not is_stacked(stacked, [p.weight for p in projs], [p.bias for p in projs]):
        raise ValueError(
            "stacked.weight (and .bias) must hold the projections' weights (biases) as consecutive "
            "row blocks, in the same storage"
        )
    check_same_device(x=x, **{"stacked.weight": stacked.weight})


def _flatten(projs) -> list:
    return [t for p in projs for t in (p.weight, p.bias, p.lora_A, p.lora_B)]


def _unflatten(params, scalings) -> list[LoRAProjection]:
    return [LoRAProjection(*params[4 * i : 4 * i + 4], s) for i, s in enumerate(scalings)]


# ------------------------------------------------------------------------------- adapters side by side


class _Adapters(NamedTuple):
    """The adapters of projections sharing one input, side by side along the rank dimension."""

    a_cat: torch.Tensor  # [R, in] = cat of the present lora_A (the tensor itself when there is one)
    slices: list  # per projection: its (start, stop) in R, or None without adapter


def _adapters(projs) -> _Adapters | None:
    present = [p.lora_A for p in projs if p.lora_A is not None]
    if not present:
        return None
    slices, start = [], 0
    for p in projs:
        if p.lora_A is None:
            slices.append(None)
        else:
            slices.append((start, start + p.lora_A.shape[0]))
            start += p.lora_A.shape[0]
    a_cat = present[0] if len(present) == 1 else torch.cat(present)
    return _Adapters(a_cat, slices)


class _StackedAdapters(NamedTuple):
    """The adapters of stacked projections as two matrices (compute dtype), rebuilt once per generation."""

    a_cat: torch.Tensor  # [R, in]: the present lora_A side by side along the rank
    b_blk: torch.Tensor  # [sum out_i, R]: scaling_i * B_i on the diagonal blocks, zeros elsewhere
    slices: list  # per projection: its (start, stop) in R, or None without adapter
