"""The supported model families and their few quirks.

Everything else is matched by structure (see norms.py, mlp.py, attention.py, lm_head.py). A new family
should be one `Family(...)` line here: what its RMSNorm computes and which extra arguments its attention
forward passes to the attention function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


def _no_extra(attn: nn.Module) -> dict:
    return {}


def _sliding_from_module(attn: nn.Module) -> dict:
    # Qwen2/Qwen3/Gemma3: the layer's own window (None on full-attention layers).
    return {"sliding_window": getattr(attn, "sliding_window", None)}


def _sliding_from_config(attn: nn.Module) -> dict:
    # Mistral/Mixtral: one window for every layer.
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def _gemma2_extra(attn: nn.Module) -> dict:
    return {"sliding_window": attn.sliding_window, "softcap": attn.attn_logit_softcapping}


def _gpt_oss_extra(attn: nn.Module) -> dict:
    # the layer's window (None on full layers) and its attention sinks, one logit per head
    return {"sliding_window": attn.sliding_window, "s_aux": attn.sinks}


@dataclass(frozen=True)
class Family:
    name: str
    # 0.0: Llama's RMSNorm (weight * x_norm in x's dtype); 1.0: Gemma's (x_norm * (1 + weight) in fp32).
    rms_norm_offset: float = 0.0
    # Gemma 4's RMSNorm: x_norm * weight in fp32 (offset 0, scaled before the cast to x's dtype).
    rms_norm_scale_in_fp32: bool = False
    # Keyword arguments this family's attention forward passes to the attention function, beyond
    # dropout/scaling (read from transformers' modeling_<family>.py).
    attention_extra_kwargs: Callable[[nn.Module], dict] = field(default=_no_extra)
    # MoE families add the router's load-balancing loss to the LM loss when output_router_logits is set.
    moe: bool = False
    # Qwen3.5, Qwen3-Next: q_proj gives each head's query and an output gate; attention output * sigmoid(gate).
    attention_output_gate: bool = False
    # How the family's apply_rotary_pos_emb rotates: "rotate_half" (Llama's: fastplug's RoPE kernel, partial rotary
    # where cos is narrower than a head), "halves" (gpt-oss: one angle per pair (x[i], x[i + D/2]), tables of D/2:
    # the kernel's rotate-half tables are them twice), "family" (GLM-4's interleaved pairs: the family's own function),
    # "multimodal" (Qwen2-VL, Qwen2.5-VL: rotate-half tables, which older transformers hand over as (3, B, T, D), one
    # per position axis, for the attention to merge by config.rope_parameters["mrope_section"]; merged first here).
    rope: str = "rotate_half"
    # The config attribute the LM head's logits are divided by (Granite's logits_scaling); the fused loss scales by it.
    logits_divided_by: str | None = None
    # Why the family's attention forward is not reproduced (it stays transformers'; None: it is).
    attention_left: str | None = None
    # The model's forward composes attention masks beyond causality that the mask functions cannot see from the
    # config (Gemma 3's image tokens attend to each other both ways): a mask it does not let be skipped is built.
    composes_masks: bool = False


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama"),
        Family("mistral", attention_extra_kwargs=_sliding_from_config),
        Family("qwen2", attention_extra_kwargs=_sliding_from_module),
        Family("qwen3", attention_extra_kwargs=_sliding_from_module),
        Family("gemma", rms_norm_offset=1.0),
        Family("gemma2", rms_norm_offset=1.0, attention_extra_kwargs=_gemma2_extra),
        Family("gemma3_text", rms_norm_offset=1.0, attention_extra_kwargs=_sliding_from_module),
        Family("mixtral", attention_extra_kwargs=_sliding_from_config, moe=True),
        Family("qwen2_moe", moe=True),  # sets sliding_window on some layers but does not pass it
        Family("qwen3_moe", attention_extra_kwargs=_sliding_from_module, moe=True),
        # Qwen3.5 dense and MoE (text, and the language model of their ConditionalGeneration) and Qwen3-Next:
        # Gated DeltaNet layers (linear_attention.py) beside output-gated attention; RMSNorm as Gemma's 1 + w
        *(Family(name, rms_norm_offset=1.0, attention_output_gate=True) for name in ("qwen3_5_text", "qwen3_5")),
        *(
            Family(name, rms_norm_offset=1.0, attention_output_gate=True, moe=True)
            for name in ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
        ),
        # Gemma 4 (text, and the language model of Gemma4ForConditionalGeneration): its router adds no loss
        Family("gemma4_text", rms_norm_scale_in_fp32=True, attention_extra_kwargs=_sliding_from_module),
        Family("gemma4", rms_norm_scale_in_fp32=True, attention_extra_kwargs=_sliding_from_module),
        # gpt-oss: attention sinks, sliding/full layers, RoPE on halves, experts with biases and a clamped SwiGLU
        Family("gpt_oss", rms_norm_scale_in_fp32=True, attention_extra_kwargs=_gpt_oss_extra, moe=True, rope="halves"),
        # by structure, each shown equal in tests/models/test_more_families.py
        Family("phi3", attention_extra_kwargs=_sliding_from_config),  # fused qkv_proj and gate_up_proj
        Family("smollm3", attention_extra_kwargs=_sliding_from_module),  # layers without RoPE (use_rope)
        Family("olmo2", rms_norm_scale_in_fp32=True),  # post-norms; q/k norms over the whole projection
        Family("olmo3", rms_norm_scale_in_fp32=True, attention_extra_kwargs=_sliding_from_module),
        Family("granite", logits_divided_by="logits_scaling"),  # its other multipliers are in code left as it is
        Family("glm4", rope="family"),  # interleaved partial RoPE; post-norms; fused gate_up_proj
        Family("ministral", attention_extra_kwargs=_sliding_from_module),
        # the language model of vision-language models (the vision tower and projector stay as they are)
        Family("gemma3", rms_norm_offset=1.0, attention_extra_kwargs=_sliding_from_module, composes_masks=True),
        Family("qwen2_vl", attention_extra_kwargs=_sliding_from_module, rope="multimodal"),  # Qwen2's q/k/v biases
        Family("qwen2_5_vl", attention_extra_kwargs=_sliding_from_module, rope="multimodal"),
        Family("qwen3_vl"),  # Qwen3's q/k norms; the rotary module interleaves the MRoPE sections itself
        Family("qwen3_vl_moe", moe=True),  # Qwen3-VL with Qwen3-MoE's experts
        Family(
            "llama4_text",
            attention_left="Llama 4's attention (complex RoPE on interleaved pairs before the heads are transposed, "
            "L2 q/k norm after it, temperature tuning on layers without RoPE, chunked attention) is not reproduced",
        ),
    )
}

SUPPORTED_FAMILIES = (
    "llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3 (text), mixtral, qwen2_moe, qwen3_moe, gemma4, qwen3_5, "
    "qwen3_5_moe, qwen3_next, gpt_oss, phi3, smollm3, olmo2, olmo3, granite, glm4, ministral, llama4_text; "
    "the language model of gemma3, qwen2_vl, qwen2_5_vl, qwen3_vl and qwen3_vl_moe"
)


def family_of(model: nn.Module) -> Family | None:
    """The family of a transformers model (by config.model_type), or None when it is not one we know."""
    config = getattr(model, "config", None)
    return FAMILIES.get(getattr(config, "model_type", None))
