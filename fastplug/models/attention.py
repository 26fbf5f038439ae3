"""Attention blocks with q/k/v/o projections: fused LoRA QKV, q_norm/k_norm, the RoPE kernel, then the
attention function, called exactly as the family's forward calls it: fastplug's (the patch switches the
model's config to "fastplug", see fast_attention.py) or, with attention=False, the model's own.

What differs between families is only which extra arguments reach the attention function (sliding window,
softcap): `Family.attention_extra_kwargs`. Everything else is the shared structure of transformers'
Llama-derived attention forwards (transformers 5.17 to 5.24).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from ..kernels.lora import lora_linear, lora_qkv
from ..kernels.rope import rope
from . import fast_attention, stacking
from .projections import fused_projections, outputs_private, step_projections, unfused_notes
from .rules import MatchContext, Patch, Skip, combine_switches

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_PROJECTIONS = ("qkv_proj", "o_proj")
_ATTRIBUTES = ("head_dim", "layer_idx", "scaling", "attention_dropout", "config")


def _family_module(attn: nn.Module):
    return sys.modules[type(attn).__module__]


def attention_function(attn: nn.Module):
    """The attention function the original forward would pick (config._attn_implementation, else eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = _family_module(attn).eager_attention_forward
    implementation = attn.config._attn_implementation
    if implementation in (None, "eager"):
        return eager
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
    return ALL_ATTENTION_FUNCTIONS[implementation]


# What a decoder layer calls its KV cache: transformers 5.24 renamed `past_key_values` to `cache` (the old name
# kept as a deprecated alias). Both are accepted from callers; the original forward is called with its own.
CACHE_KEYWORDS = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def cache_keyword(cls: type) -> str | None:
    """The name under which `cls.forward` takes the KV cache, read from its signature (decorators that rename
    keywords wrap with functools.wraps, which inspect.signature follows); None when it takes neither."""
    parameters = inspect.signature(cls.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), None)


def pop_cache(kwargs: dict):
    """The KV cache a caller passed under either name (removed from kwargs), or None."""
    found = [kwargs.pop(name) for name in CACHE_KEYWORDS if name in kwargs]
    return next((cache for cache in found if cache is not None), None)


def _project_qkv(self, hidden_states, use_lora: bool, rotary):
    """(q, k, v, rotated): the fused QKV node applies RoPE itself (rotary = (cos, sin, head_dim)) when given."""
    if hasattr(self, "qkv_proj"):  # Phi-3: one projection gives q, k and v side by side (LoRA on it: one node)
        projs = step_projections(self.qkv_proj) if use_lora else None
        qkv = lora_linear(hidden_states, projs[0]) if projs is not None else self.qkv_proj(hidden_states)
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = (qkv.shape[-1] - q_size) // 2
        return (*qkv.split((q_size, kv_size, kv_size), dim=-1), False)
    projs = step_projections(self.q_proj, self.k_proj, self.v_proj) if use_lora else None
    if projs is not None:
        stacked = stacking.stacked_base(self, projs)
        return (*lora_qkv(hidden_states, *projs, rotary=rotary, stacked=stacked), rotary is not None)
    return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states), False


def _whole_projection_norm(attn: nn.Module) -> bool:
    """OLMo 2/3 normalise q and k over the whole projection (every head at once) before the heads are split;
    Qwen3 and Gemma 3 over each head."""
    weight = getattr(getattr(attn, "q_norm", None), "weight", None)
    return weight is not None and weight.shape[-1] != attn.head_dim


def _project_out(self, attn_output, use_lora: bool):
    projs = step_projections(self.o_proj) if use_lora else None
    return lora_linear(attn_output, projs[0]) if projs is not None else self.o_proj(attn_output)


def merge_multimodal_sections(table: torch.Tensor, sections) -> torch.Tensor:
    """Qwen2-VL's (3, B, T, D) RoPE table (temporal, height, width positions) as the one (B, T, D) table its
    attention rotates with in older transformers: each of the 2 x 3 `sections` of channels from its axis (the
    indexing of transformers' apply_multimodal_rotary_pos_emb, so the values are the same bits)."""
    return torch.cat([part[i % 3] for i, part in enumerate(table.split(list(sections) * 2, dim=-1))], dim=-1)


def _rotate_as_family(attn: nn.Module, query, key, cos, sin):
    """The family's own rotation (RoPE patch off, GLM-4's interleaved pairs); Qwen2-VL's (3, B, T, D) tables go to
    the multimodal function older transformers call with them."""
    module = _family_module(attn)
    if cos.dim() == 4:
        sections = attn.config.rope_parameters["mrope_section"]
        return module.apply_multimodal_rotary_pos_emb(query, key, cos, sin, sections)
    return module.apply_rotary_pos_emb(query, key, cos, sin)


def _attention_forward(extra_kwargs, use_rope: bool, use_lora: bool, output_gate: bool = False, style="rotate_half"):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        if cache is not None and not torch.is_grad_enabled():
            # Generation / cached inference: transformers' own forward, cache handling and all.
            return type(self).forward(
                self,
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                **{cache_keyword(type(self)): cache},
                **kwargs,
            )
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        cos, sin = position_embeddings
        layer_rope = bool(getattr(self, "use_rope", True))  # SmolLM3: layers without RoPE
        kernel_rope = use_rope and layer_rope and style != "family"
        if kernel_rope and style == "multimodal" and cos.dim() == 4:  # Qwen2-VL's per-axis tables (transformers 5.7)
            sections = self.config.rope_parameters["mrope_section"]
            cos, sin = merge_multimodal_sections(cos, sections), merge_multimodal_sections(sin, sections)
        if kernel_rope and style == "halves":  # gpt-oss: an angle per pair of halves, the rotate-half tables twice
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        has_qk_norm = hasattr(self, "q_norm")  # Qwen3, Gemma3: per-head RMSNorm between projection and RoPE
        whole_norm = _whole_projection_norm(self)
        rotary = (cos, sin, self.head_dim) if kernel_rope and not has_qk_norm and not output_gate else None
        query, key, value, rotated = _project_qkv(self, hidden_states, use_lora, rotary)
        if whole_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        gate = None
        if output_gate:  # Qwen3.5, Qwen3-Next: q_proj gives each head's query and its output gate side by side
            query, gate = query.view(*input_shape, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
        query, key = query.view(hidden_shape), key.view(hidden_shape)
        value = value.view(hidden_shape).transpose(1, 2)
        if has_qk_norm and not whole_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)

        if not rotated and kernel_rope:
            # In place: q and k are fresh projection (or q/k-norm) outputs, and q_rot/k_rot feed the attention
            # alone, unless a cache keeps the keys (backward would write their gradients there); never views of one
            # fused qkv output, whose v the attention saves too.
            norms = (self.q_norm, self.k_norm) if has_qk_norm else ()
            producers = () if hasattr(self, "qkv_proj") else (self.q_proj, self.k_proj, *norms)
            # len(), not bool(): torch 2.11's Dynamo cannot trace bool() of a tuple (a break under fullgraph)
            inplace = cache is None and len(producers) > 0 and outputs_private(*producers)
            query, key = rope(query, key, cos, sin, inplace=inplace)
        elif not rotated and layer_rope:
            query, key = _rotate_as_family(self, query, key, *position_embeddings)

        if cache is not None:  # training with use_cache: the cache still records the keys
            key, value = cache.update(key, value, self.layer_idx)

        attn_output, attn_weights = attention_function(self)(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **extra_kwargs(self),
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        if gate is not None:
            attn_output = attn_output * torch.sigmoid(gate)
        return _project_out(self, attn_output, use_lora), attn_weights

    return forward


def _projections(module: nn.Module) -> tuple[str, ...] | None:
    """The attention's projection names: q/k/v/o, or Phi-3's fused qkv_proj and o_proj; None: not attention."""
    for names in (PROJECTIONS, FUSED_PROJECTIONS):
        if all(hasattr(module, p) for p in names):
            return names
    return None


def match_attention(module: nn.Module, ctx: MatchContext):
    names = _projections(module)
    if names is None or not type(module).__name__.endswith("Attention"):
        return None
    options = ctx.options
    if not (options.rope or options.lora or options.attention):
        return None
    if ctx.family is None:
        return Skip("attention", "attention forward of an unknown family is not reproduced")
    if ctx.family.attention_left:
        return Skip("attention", f"{ctx.family.attention_left}: transformers' attention runs")
    missing = [a for a in _ATTRIBUTES if not hasattr(module, a)]
    family_module = _family_module(module)
    multimodal = ctx.family.rope == "multimodal"
    # Qwen2-VL's module has apply_multimodal_rotary_pos_emb instead in transformers 5.7
    rotations = ("apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb") if multimodal else ("apply_rotary_pos_emb",)
    if not hasattr(family_module, "eager_attention_forward"):
        missing.append("eager_attention_forward")
    if not any(hasattr(family_module, f) for f in rotations):
        missing.append(" or ".join(rotations))
    if multimodal and "mrope_section" not in (getattr(module.config, "rope_parameters", None) or {}):
        missing.append("mrope_section in config.rope_parameters")
    if cache_keyword(type(module)) is None:
        missing.append(f"KV cache argument ({' or '.join(CACHE_KEYWORDS)}) in its forward")
    if missing:
        return Skip("attention", f"not the expected attention structure (no {', '.join(missing)})")
    if hasattr(module, "q_norm") != hasattr(module, "k_norm"):
        return Skip("attention", "q_norm without k_norm (or the reverse)")
    output_gate = ctx.family.attention_output_gate
    if output_gate and getattr(module.q_proj, "out_features", None) != 2 * getattr(module.o_proj, "in_features", -1):
        return Skip("attention", "output-gated family whose q_proj is not twice o_proj's input (query and gate)")
    width = getattr(getattr(module, "q_norm", None), "weight", torch.empty(module.head_dim)).shape[-1]
    if width not in (module.head_dim, module.o_proj.in_features):
        return Skip("attention", f"q_norm over {width} features: neither one head nor the whole projection")
    lora_now = options.lora and (
        fused_projections(*(getattr(module, n) for n in names[:-1])) is not None
        or fused_projections(module.o_proj) is not None
    )
    notes = unfused_notes(module, names) if options.lora else ()
    style = ctx.family.rope
    forward = _attention_forward(ctx.family.attention_extra_kwargs, options.rope, options.lora, output_gate, style)
    switch, path = _attention_route(module, ctx)
    if options.attention and ctx.family.composes_masks:  # Gemma 3's image tokens: its masks are built, not skipped
        switch = combine_switches(switch, fast_attention.composing(module.config))
        path += "; a mask the model composes (image tokens attending both ways): transformers' attention with it"
    if not getattr(module, "use_rope", True):  # its own variant: the self-check then runs such a layer too
        path += "; no RoPE on this layer"
    if options.lora and options.stack_projections and names == PROJECTIONS:
        switch = combine_switches(switch, stacking.switch(module, ctx.root, PROJECTIONS[:3]))
    return Patch("attention", forward, lora_fused=lora_now, notes=notes, switch=switch, path_taken=path)


def _attention_route(module: nn.Module, ctx: MatchContext):
    """(switch, path): the first attention module of a model carries the switch of its config to fastplug's
    attention (undone by restore); every module reports the path it takes."""
    config = module.config
    current = config._attn_implementation
    if not ctx.options.attention:
        return None, f"transformers' {current or 'eager'} attention (attention=False)"
    if fast_attention.routed(config):  # by an earlier module
        return None, fast_attention.describe(module, ctx.family, fast_attention.fallback_name(config))
    if current not in (None, "eager", "sdpa", fast_attention.NAME):
        return None, f"transformers' {current} attention, as loaded (fastplug replaces eager and sdpa)"
    # a model loaded as "fastplug" is routed too: its decoder stack then tells unpacked rows to the attention
    fallback = fast_attention.fallback_name(config) if current == fast_attention.NAME else current or "eager"
    decoder = ctx.decoder
    return (lambda: fast_attention.route(config, decoder)), fast_attention.describe(module, ctx.family, fallback)
