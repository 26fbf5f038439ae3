"""Which LoRA projections take the fused path: asked at call time, reported at patch time.

The fused blocks (`lora_linear`, `lora_qkv`, `lora_mlp`) dequantize bitsandbytes 4-bit bases themselves, so
they ask for the quantized views too.
"""

from __future__ import annotations

from torch import nn

from ..kernels.lora import LoRAProjection
from .peft_lora import lora_projection, unfused_reason


def fused_projections(*modules: nn.Module) -> list[LoRAProjection] | None:
    """The fused views of these projections as they stand NOW, or None to run the modules.

    None also when none of them carries an active adapter: plain linears gain nothing from the fused node.
    """
    projs = [lora_projection(m, quantized=True) for m in modules]
    if any(p is None for p in projs) or all(p.lora_A is None for p in projs):
        return None
    return projs


def unfused_notes(owner: nn.Module, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(child name, reason) for the peft LoRA children of `owner` that cannot be fused right now."""
    notes = []
    for name in names:
        child = getattr(owner, name)
        reason = unfused_reason(child, quantized=True)
        if reason is not None and hasattr(child, "lora_A"):  # plain layers are not worth reporting
            notes.append((name, f"LoRA left unfused: {reason}"))
    return tuple(notes)
