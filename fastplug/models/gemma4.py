"""Gemma 4's quirks: attention layers that share keys and values, and its MoE router.

Attention (`Gemma4TextAttention`), as Gemma 3's (q/k norms, then RoPE; scaling 1.0; the layer's own sliding
window) plus:
- v_norm: an RMSNorm without a weight on the values;
- k = v (`attention_k_eq_v`, full-attention layers of the larger models): no v_proj, the values are the key
  projection's output before its norm and RoPE;
- KV sharing: the last layers (`is_kv_shared_layer`) have no k/v projections and attend to the keys and values
  of the last earlier layer of their type, which stores them (`store_full_length_kv`) in the `shared_kv_states`
  the text model passes to every layer. Where they are kept is read from the module: by layer index where it
  names its source layer (`kv_shared_layer_index`, transformers 5.7), else by layer type (5.17 on);
- head_dim and kv heads per layer type (full-attention layers: `global_head_dim`, `num_global_key_value_heads`).
The patched forward projects q/k/v in one fused LoRA node (q alone on a sharing layer, q and k where v is k),
runs the norms and the RoPE kernel, and calls the attention function as the original does; generation with a
cache runs the original forward. Every decoder layer's own forward (per-layer inputs, `layer_scalar`, the MoE
block beside the MLP) stays transformers': fastplug patches its submodules only.

Router (`Gemma4TextRouter`): a weightless RMSNorm, times `scale` and hidden ** -0.5, the projection, softmax in
fp32, top k, renormalised, times `per_expert_scale` of the chosen experts; returns (probabilities, weights,
indices). The softmax/top-k/renormalisation run in one kernel (`moe_router`); weights stay fp32 (transformers
5.7 computed this softmax in the model's dtype, 5.17 on in fp32; the self-check bounds the difference).
The experts (`Gemma4TextExperts`: gate_up [E, 2I, H], down [E, H, I], GELU-tanh) take moe.py's grouped GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.lora import lora_linear, lora_projections
from ..kernels.moe import moe_router
from ..kernels.rope import rope
from . import stacking
from .attention import _attention_route, _family_module, attention_function, cache_keyword, pop_cache
from .projections import fused_projections, outputs_private, step_projections, unfused_notes
from .rules import MatchContext, Patch, Skip, combine_switches

FAMILIES = ("gemma4_text", "gemma4")
_ATTRIBUTES = (
    "head_dim",
    "layer_idx",
    "layer_type",
    "scaling",
    "sliding_window",
    "attention_dropout",
    "config",
    "q_norm",
    "o_proj",
)


# ------------------------------------------------------------------------------------------- attention
def _projection_names(attn: nn.Module) -> tuple[str, ...]:
    """The projections this layer runs on its input: q alone where it reads shared keys and values, q and k
    where the values are the keys (no v_proj), else q, k and v."""
    if attn.is_kv_shared_layer:
        return ("q_proj",)
    return ("q_proj", "k_proj") if attn.v_proj is None else ("q_proj", "k_proj", "v_proj")


def _shared_key(attn: nn.Module, reading: bool):
    """Where `shared_kv_states` keeps this layer's keys and values: its source layer's index (reading) or its own
    (storing) in transformers that name the source layer, else the layer type."""
    if hasattr(attn, "kv_shared_layer_index"):
        return attn.kv_shared_layer_index if reading else attn.layer_idx
    return attn.layer_type


def _project(self, hidden_states, names, use_lora: bool) -> tuple:
    modules = [getattr(self, name) for name in names]
    projs = step_projections(*modules) if use_lora else None
    if projs is None:
        return tuple(m(hidden_states) for m in modules)
    if len(projs) == 1:
        return (lora_linear(hidden_states, projs[0]),)
    return lora_projections(hidden_states, *projs, stacked=stacking.stacked_base(self, projs))


def _attention_forward(use_rope: bool, use_lora: bool):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, shared_kv_states=None, **kwargs):
        cache = pop_cache(kwargs)
        if cache is not None and not torch.is_grad_enabled():
            # Generation / cached inference: transformers' own forward, cache and shared states and all.
            return type(self).forward(
                self,
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                shared_kv_states=shared_kv_states,
                **{cache_keyword(type(self)): cache},
                **kwargs,
            )
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        reads = self.is_kv_shared_layer
        projected = _project(self, hidden_states, _projection_names(self), use_lora)
        query = self.q_norm(projected[0].view(hidden_shape)).transpose(1, 2)
        if reads:
            key, value = shared_kv_states[_shared_key(self, reading=True)]
            key, value = key.to(query.device), value.to(query.device)
            keys_to_rotate = query.new_empty(query.shape[0], 0, *query.shape[2:])
        else:
            key = projected[1].view(hidden_shape)
            value = projected[2].view(hidden_shape) if len(projected) == 3 else key
            keys_to_rotate = self.k_norm(key).transpose(1, 2)
            value = self.v_norm(value).transpose(1, 2)
        if use_rope:
            # In place where q and k are fresh norm outputs that only the attention reads: not where a cache or
            # the later layers sharing them keep the keys (backward would write their gradients there).
            producers = (self.q_proj, self.q_norm) if reads else (self.q_proj, self.q_norm, self.k_proj, self.k_norm)
            inplace = cache is None and not self.store_full_length_kv and outputs_private(*producers)
            query, rotated = rope(query, keys_to_rotate, cos, sin, inplace=inplace)
        else:
            rotate = _family_module(self).apply_rotary_pos_emb
            query = rotate(query, cos, sin)
            rotated = None if reads else rotate(keys_to_rotate, cos, sin)
        if not reads:
            key = rotated
            if cache is not None:  # training with use_cache: the cache still records the keys
                key, value = cache.update(key, value, self.layer_idx)
        if self.store_full_length_kv:
            shared_kv_states[_shared_key(self, reading=False)] = key, value

        attn_output, attn_weights = attention_function(self)(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        projs = step_projections(self.o_proj) if use_lora else None
        return (lora_linear(attn_output, projs[0]) if projs is not None else self.o_proj(attn_output)), attn_weights

    return forward


def _is_attention(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("Attention")
        and hasattr(module, "is_kv_shared_layer")
        and hasattr(module, "store_full_length_kv")
        and hasattr(module, "q_proj")
    )


def _match_attention(module: nn.Module, ctx: MatchContext):
    options = ctx.options
    if not (options.rope or options.lora or options.attention):
        return None
    missing = [a for a in _ATTRIBUTES if not hasattr(module, a)]
    if not module.is_kv_shared_layer:
        missing += [a for a in ("k_proj", "v_proj", "k_norm", "v_norm") if not hasattr(module, a)]
    if cache_keyword(type(module)) is None:
        missing.append("KV cache argument in its forward")
    if not hasattr(_family_module(module), "apply_rotary_pos_emb"):
        missing.append("apply_rotary_pos_emb")
    if missing:
        return Skip("attention", f"not Gemma 4's attention structure (no {', '.join(missing)})")
    names = _projection_names(module)
    lora_now = options.lora and (
        fused_projections(*(getattr(module, n) for n in names)) is not None
        or fused_projections(module.o_proj) is not None
    )
    notes = unfused_notes(module, (*names, "o_proj")) if options.lora else ()
    switch, path = _attention_route(module, ctx)
    if options.lora and options.stack_projections and len(names) > 1:
        switch = combine_switches(switch, stacking.switch(module, ctx.root, names))
    if module.is_kv_shared_layer:
        path += f"; keys and values of an earlier {module.layer_type} layer (KV sharing)"
    forward = _attention_forward(options.rope, options.lora)
    return Patch("attention", forward, lora_fused=lora_now, notes=notes, switch=switch, path_taken=path)


# ---------------------------------------------------------------------------------------------- router
def _router_forward(self, hidden_states):
    hidden_states = self.norm(hidden_states)
    hidden_states = hidden_states * self.scale * self.scalar_root_size
    logits = self.proj(hidden_states)
    weights, index = moe_router(logits, self.config.top_k_experts, normalize=True, weights_dtype=torch.float32)
    probabilities = nn.functional.softmax(logits, dim=-1, dtype=torch.float32)
    return probabilities, weights * self.per_expert_scale[index], index


def _is_router(module: nn.Module) -> bool:
    scale, per_expert = getattr(module, "scale", None), getattr(module, "per_expert_scale", None)
    return (
        type(module).__name__.endswith("Router")
        and isinstance(scale, torch.Tensor)
        and isinstance(per_expert, torch.Tensor)
        and per_expert.dim() == 1
        and isinstance(getattr(module, "proj", None), nn.Module)
        and isinstance(getattr(module, "norm", None), nn.Module)
        and hasattr(module, "scalar_root_size")
        and isinstance(getattr(getattr(module, "config", None), "top_k_experts", None), int)
    )


# ------------------------------------------------------------------------------------- what stays as is
def _is_text_model_with_per_layer_inputs(module: nn.Module) -> bool:
    return bool(getattr(module, "hidden_size_per_layer_input", 0)) and hasattr(module, "embed_tokens_per_layer")


_PER_LAYER_INPUTS = (
    "transformers' code: per-layer inputs (embed_tokens_per_layer, per_layer_model_projection, each layer's "
    "per_layer_input_gate, GELU and per_layer_projection; its norms are patched) and layer_scalar run in the "
    "model's and the decoder layers' own forwards, which fastplug does not replace"
)


def _is_multimodal_head(module: nn.Module, ctx: MatchContext) -> bool:
    return module is ctx.root and hasattr(module, "lm_head") and not type(module).__name__.endswith("ForCausalLM")


# --------------------------------------------------------------------------------------------- the rule
def match_gemma4(module: nn.Module, ctx: MatchContext):
    if ctx.family is None or ctx.family.name not in FAMILIES:
        return None
    if _is_attention(module):
        return _match_attention(module, ctx)
    if _is_router(module):
        return Patch("router", _router_forward) if ctx.options.moe else None
    if _is_text_model_with_per_layer_inputs(module):
        return Skip("per_layer_inputs", _PER_LAYER_INPUTS)
    if ctx.options.cross_entropy and _is_multimodal_head(module, ctx):
        return Skip(
            "lm_head_loss",
            f"{type(module).__name__}'s forward (image and audio features merged into the embeddings) is not "
            "reproduced: transformers' loss on full logits",
        )
    return None
