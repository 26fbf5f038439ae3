"""Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) and their gated RMSNorm.

The patched layer runs what transformers' `*GatedDeltaNet.forward` runs, on fastplug's kernels:
- the input projections (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next: in_proj_qkvz and
  in_proj_ba, reordered by the module's own `fix_query_key_value_ordering`) as one fused LoRA node, and
  out_proj as another, when they carry adapters (`fastplug.kernels.lora`);
- the short causal convolution and its SiLU on the projection's output as it lies (`kernels.causal_conv`);
- the chunked gated delta rule (`kernels.delta_rule`: flash-linear-attention's kernels when installed, else
  fastplug's Triton scan), which keeps only its inputs for the backward;
- the gated RMSNorm through the module's `norm`, which the "rms_norm_gated" rule patches.

Caches: a forward with a cache whose state for this layer is empty (a prefill, or a training step with
use_cache) runs the fast path and writes the conv and recurrent states as transformers does, so decoding goes
on from them. Forwards that continue from a cached state (the decode steps), caches that record past states
for rollback, and packed rows (cu_seq_lens_q: the sequences' states must not mix) run transformers' forward.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.causal_conv import causal_conv1d
from ..kernels.delta_rule import fla_available, fla_refusal, gated_delta_rule
from ..kernels.lora import lora_linear, lora_projections
from ..kernels.norms import rms_norm_gated
from . import stacking
from .projections import fused_projections, step_projections, unfused_notes
from .rules import MatchContext, Patch, Skip, off_the_gpu

# input projections by layout: Qwen3.5's four, Qwen3-Next's two fused (reordered by the module)
LAYOUTS = {"split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "fused": ("in_proj_qkvz", "in_proj_ba")}
_ATTRIBUTES = (
    "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_kernel_size",
    "layer_idx", "activation", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
)  # fmt: skip
# what a linear-attention layer's forward calls its cache: 5.7-5.17 `cache_params`, 5.24 `cache` (the old name
# a deprecated alias); decoder layers and callers may pass either
CACHE_KEYWORDS = ("cache", "cache_params", "past_key_values")


@functools.lru_cache(maxsize=None)
def cache_keyword(cls: type) -> str | None:
    parameters = inspect.signature(cls.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), None)


def _layout(module: nn.Module) -> str | None:
    for name, projections in LAYOUTS.items():
        if all(isinstance(getattr(module, p, None), nn.Module) for p in projections):
            return name
    return None


# ------------------------------------------------------------------------------------------ the cache
def _continues_cache(cache, layer_idx: int) -> bool:
    """Whether this forward must go on from the cache's state for the layer (or the cache records past states for
    a rollback), which transformers' own forward handles."""
    has_previous = getattr(cache, "has_previous_state", None)
    if not callable(has_previous):
        return True
    if has_previous(layer_idx):
        return True
    recording = getattr(cache, "is_recording_past", None)  # 5.24
    if callable(recording):
        return bool(recording(layer_idx))
    layers = getattr(cache, "layers", None)  # 5.17: the layer's own flag
    return bool(layers is not None and layer_idx < len(layers) and getattr(layers[layer_idx], "record_past", False))


def _fill_cache(cache, self, mixed_qkv: torch.Tensor, state: torch.Tensor) -> None:
    """The states a prefill leaves: the last conv_kernel_size inputs of the convolution (zeros before the first
    token) and the final recurrent state, through the cache's own update methods."""
    kernel = self.conv_kernel_size
    conv_state = F.pad(mixed_qkv.transpose(1, 2), (kernel - mixed_qkv.shape[1], 0))  # [B, C, kernel]
    cache.update_conv_state(conv_state, self.layer_idx, conv_kernel_size=kernel)
    cache.update_recurrent_state(state, self.layer_idx)


# ----------------------------------------------------------------------------------------- the forward
def _project_in(self, x: torch.Tensor, layout: str, use_lora: bool):
    """(mixed_qkv [B, T, conv_dim], z [B, T, H, Dv], b, a [B, T, H])."""
    modules = [getattr(self, name) for name in LAYOUTS[layout]]
    projs = step_projections(*modules) if use_lora else None
    if projs is not None:
        outs = lora_projections(x, *projs, stacked=stacking.stacked_base(self, projs))
    else:
        outs = [m(x) for m in modules]
    batch, tokens = x.shape[:2]
    if layout == "split":
        mixed_qkv, z, b, a = outs
        return mixed_qkv, z.reshape(batch, tokens, -1, self.head_v_dim), b, a
    query, key, value, z, b, a = self.fix_query_key_value_ordering(*outs)
    mixed_qkv = torch.cat([t.reshape(batch, tokens, -1) for t in (query, key, value)], dim=-1)
    return mixed_qkv, z, b, a


def _project_out(self, x: torch.Tensor, use_lora: bool) -> torch.Tensor:
    projs = step_projections(self.out_proj) if use_lora else None
    return lora_linear(x, projs[0]) if projs is not None else self.out_proj(x)


def _linear_attention_forward(layout: str, use_lora: bool):
    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        aliases = [kwargs.pop(name) for name in CACHE_KEYWORDS[1:] if name in kwargs]
        cache = next((c for c in (cache, *aliases) if c is not None), None)
        if (cache is not None and _continues_cache(cache, self.layer_idx)) or kwargs.get("cu_seq_lens_q") is not None:
            keyword = cache_keyword(type(self))
            extra = {keyword: cache} if keyword is not None else {}
            return type(self).forward(self, hidden_states, attention_mask=attention_mask, **extra, **kwargs)
        hidden_states = sys.modules[type(self).__module__].apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, tokens, _ = hidden_states.shape
        mixed_qkv, z, b, a = _project_in(self, hidden_states, layout, use_lora)
        conv = self.conv1d
        mixed = causal_conv1d(mixed_qkv, conv.weight.squeeze(1), conv.bias, self.activation)
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, tokens, -1, self.head_k_dim)
        key = key.reshape(batch, tokens, -1, self.head_k_dim)
        value = value.reshape(batch, tokens, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core, state = gated_delta_rule(query, key, value, g, beta, output_final_state=cache is not None)
        if cache is not None:
            _fill_cache(cache, self, mixed_qkv, state)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return _project_out(self, core.reshape(batch, tokens, -1), use_lora)

    return forward


def _describe(module: nn.Module) -> str:
    elsewhere = off_the_gpu(module)
    if elsewhere is not None:  # fla's and the Triton kernels are CUDA's: the interpreter or the torch references
        return (
            f"Gated DeltaNet: causal conv1d and chunked scan {elsewhere}; "
            "cached continuation (decode steps) and packed rows: transformers' forward"
        )
    rule = "fastplug's chunked Triton scan"
    if fla_available():
        refused = fla_refusal(module.A_log.device)
        rule = "flash-linear-attention's chunk_gated_delta_rule" if refused is None else f"{rule} ({refused})"
    return (
        f"Gated DeltaNet: causal conv1d kernel, {rule} on CUDA; "
        "cached continuation (decode steps) and packed rows: transformers' forward"
    )


def match_linear_attention(module: nn.Module, ctx: MatchContext):
    layout = _layout(module)
    if layout is None or not ctx.options.attention:
        return None
    if ctx.family is None:
        return Skip("linear_attention", "linear-attention forward of an unknown family is not reproduced")
    missing = [a for a in _ATTRIBUTES if not hasattr(module, a)]
    family_module = sys.modules[type(module).__module__]
    if not hasattr(family_module, "apply_mask_to_padding_states"):
        missing.append("apply_mask_to_padding_states")
    if layout == "fused" and not callable(getattr(module, "fix_query_key_value_ordering", None)):
        missing.append("fix_query_key_value_ordering")
    if cache_keyword(type(module)) is None:
        missing.append(f"cache argument ({' or '.join(CACHE_KEYWORDS)}) in its forward")
    if missing:
        return Skip("linear_attention", f"not the expected Gated DeltaNet structure (no {', '.join(missing)})")
    conv = module.conv1d
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels or conv.weight.shape[1] != 1:
        return Skip("linear_attention", "conv1d is not a depthwise nn.Conv1d")
    if module.activation != "silu":
        return Skip("linear_attention", f"convolution activation {module.activation!r} has no kernel (silu only)")
    names = (*LAYOUTS[layout], "out_proj")
    use_lora = ctx.options.lora
    lora_now = use_lora and (
        fused_projections(*(getattr(module, p) for p in LAYOUTS[layout])) is not None
        or fused_projections(module.out_proj) is not None
    )
    notes = unfused_notes(module, names) if use_lora else ()
    switch = stacking.switch(module, ctx.root, LAYOUTS[layout]) if use_lora and ctx.options.stack_projections else None
    return Patch(
        "linear_attention",
        _linear_attention_forward(layout, use_lora),
        lora_fused=lora_now,
        notes=notes,
        switch=switch,
        path_taken=_describe(module),
    )


# ---------------------------------------------------------------------------------------- gated norm
def _gated_norm_forward(self, hidden_states, gate):
    return rms_norm_gated(hidden_states, gate, self.weight, eps=self.variance_epsilon)


def match_gated_norm(module: nn.Module, ctx: MatchContext):
    if not type(module).__name__.endswith("RMSNormGated") or not ctx.options.rms_norm:
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not hasattr(module, "variance_epsilon"):
        return Skip("rms_norm_gated", "not a gated RMSNorm with a weight and variance_epsilon")
    if getattr(module, "activation", "silu") != "silu":
        return Skip("rms_norm_gated", f"gate activation {module.activation!r} has no kernel (silu only)")
    if ctx.family is None:
        return Skip("rms_norm_gated", "gated RMSNorm of an unknown family (its rounding is not known)")
    return Patch("rms_norm_gated", _gated_norm_forward)
