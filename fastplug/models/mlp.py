"""Gated MLPs: down(act(gate(x)) * up(x)) with SwiGLU or GeGLU (dense layers and MoE shared experts).

With LoRA on all three projections the whole block is one fused autograd node (`lora_mlp`); otherwise the
projections run as modules and only the activation is fused. A Qwen2-MoE shared expert is such an MLP;
its sigmoid gate lives in the MoE block, which stays as it is. Phi-3 and GLM-4 fuse gate and up into one
`gate_up_proj` ([gate | up] halves of its output): LoRA on it and on down_proj runs as one node per projection
(`lora_linear`), the activation reads the two halves in place. The activation module is `act_fn`, or
`activation_fn` (Phi-3, GLM-4, Llama 4).
"""

from __future__ import annotations

from torch import nn

from ..kernels.activations import geglu, swiglu
from ..kernels.lora import lora_linear, lora_mlp
from . import stacking
from .projections import fused_projections, outputs_private, step_projections, unfused_notes
from .rules import MatchContext, Patch, Skip

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = ("gate_up_proj", "down_proj")

# activation class name (transformers.activations, torch.nn) -> the kernels' activation name
_ACTIVATION_BY_CLASS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu",
}


def activation_name(act_fn: nn.Module) -> str | None:
    if isinstance(act_fn, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act_fn.approximate)
    return _ACTIVATION_BY_CLASS.get(type(act_fn).__name__)


def _gated(gate, up, activation: str, reuse_inputs: bool):
    if activation == "silu":
        return swiglu(gate, up, reuse_inputs=reuse_inputs)
    return geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none", reuse_inputs=reuse_inputs)


def _mlp_forward(activation: str, use_lora: bool):
    def forward(self, x):
        projs = step_projections(self.gate_proj, self.up_proj, self.down_proj) if use_lora else None
        if projs is not None:
            return lora_mlp(x, *projs, activation=activation, stacked=stacking.stacked_base(self, projs[:2]))
        # the projections' outputs feed the activation alone: its backward writes their gradients into them
        reuse = outputs_private(self.gate_proj, self.up_proj)
        return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), activation, reuse))

    return forward


def _fused_mlp_forward(activation: str, use_lora: bool):
    def forward(self, x):
        projs = step_projections(self.gate_up_proj) if use_lora else None
        gate_up = lora_linear(x, projs[0]) if projs is not None else self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)  # views of one output: never reused for the gradients
        h = _gated(gate, up, activation, False)
        projs = step_projections(self.down_proj) if use_lora else None
        return lora_linear(h, projs[0]) if projs is not None else self.down_proj(h)

    return forward


def _is_linear_like(module) -> bool:
    """An nn.Linear or a layer wrapping one (peft's LoRA, bitsandbytes'): what the fused forward can call or fuse."""
    return isinstance(module, nn.Module) and hasattr(module, "in_features") and hasattr(module, "out_features")


def match_mlp(module: nn.Module, ctx: MatchContext):
    fused = not hasattr(module, "gate_proj") and all(
        _is_linear_like(getattr(module, p, None)) for p in FUSED_PROJECTIONS
    )
    if not ctx.options.mlp or not (fused or all(hasattr(module, p) for p in PROJECTIONS)):
        return None
    act_fn = getattr(module, "act_fn", getattr(module, "activation_fn", None))
    if not isinstance(act_fn, nn.Module):
        return Skip("mlp", "no act_fn module")
    activation = activation_name(act_fn)
    if activation is None:
        return Skip("mlp", f"activation {type(act_fn).__name__} has no fused kernel")
    use_lora = ctx.options.lora
    if fused:
        if module.gate_up_proj.out_features != 2 * module.down_proj.in_features:
            return Skip("mlp", "gate_up_proj's output is not twice down_proj's input ([gate | up] halves)")
        lora_now = use_lora and any(fused_projections(getattr(module, p)) for p in FUSED_PROJECTIONS)
        notes = unfused_notes(module, FUSED_PROJECTIONS) if use_lora else ()
        return Patch("mlp", _fused_mlp_forward(activation, use_lora), lora_fused=lora_now, notes=notes)
    lora_now = use_lora and fused_projections(*(getattr(module, p) for p in PROJECTIONS)) is not None
    notes = unfused_notes(module, PROJECTIONS) if use_lora else ()
    switch = stacking.switch(module, ctx.root, PROJECTIONS[:2]) if use_lora and ctx.options.stack_projections else None
    return Patch("mlp", _mlp_forward(activation, use_lora), lora_fused=lora_now, notes=notes, switch=switch)
