"""The model shapes every benchmark builds, in one place: `MODELS`, the e2e bench's presets (also read by the
frameworks, varlen, multi, generate, grpo and qlora benches and by scripts/), and the few shapes that only one bench
uses. Each preset: the transformers config class, the default batch x seq, the LoRA targets, the attention
implementation, an optional `init` for random weights, and the `full` and `tiny` config keyword arguments.
"""

from __future__ import annotations

ATTENTION_LORA = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR_LORA = ATTENTION_LORA + ["gate_proj", "up_proj", "down_proj"]

# Shapes of shared/BASELINES.md. `tiny` keeps each family's quirks at a size that trains on CPU in seconds: these
# widths and the family's own settings.
_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=128,
)
MODELS = {
    "llama": dict(  # Llama-3.2-1B (the generate, grpo and qlora --shape llama1b benches' model too)
        config="LlamaConfig",
        batch=4,
        seq=2048,
        lora=ALL_LINEAR_LORA,
        attn="sdpa",
        full=dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128256,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=131072,
        ),
        tiny=dict(_TINY, tie_word_embeddings=True),
    ),
    "qwen3_moe": dict(
        config="Qwen3MoeConfig",
        batch=4,
        seq=2048,
        lora=ATTENTION_LORA,
        attn="sdpa",
        full=dict(
            hidden_size=2048,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=64,
            num_experts_per_tok=8,
            vocab_size=151936,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
        ),
        tiny=dict(_TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    ),
    "mixtral": dict(  # Mixtral-8x7B layer widths (8 experts top-2), 4 layers
        config="MixtralConfig",
        batch=2,
        seq=4096,
        lora=ATTENTION_LORA,
        attn="sdpa",
        full=dict(
            hidden_size=4096,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
            sliding_window=None,
        ),
        tiny=dict(  # not _TINY: Mixtral keeps head_dim unset (hidden / heads)
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=128,
        ),
    ),
    "gemma2": dict(  # Gemma2-2B (the generate bench's second model too)
        config="Gemma2Config",
        batch=2,
        seq=2048,
        lora=ALL_LINEAR_LORA,
        attn="eager",
        full=dict(
            hidden_size=2304,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            intermediate_size=9216,
            vocab_size=256000,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=8192,
        ),
        tiny=dict(_TINY, sliding_window=16, query_pre_attn_scalar=16),
    ),
}
# Qwen3-MoE with LoRA on the expert weights too (peft target_parameters: one ParamWrapper per 3-D weight)
MODELS["qwen3_moe_experts"] = dict(MODELS["qwen3_moe"], lora_parameters=["experts.gate_up_proj", "experts.down_proj"])
# Qwen3.5: 3 Gated DeltaNet layers per full-attention layer, 8 layers, random init; the dense one at 2B-class widths,
# the MoE one at 35B-A3B's (256 experts top-8 of 512 and a shared expert). LoRA on both layer kinds' projections.
# Impls ending in _fla see flash-linear-attention (transformers then runs fla's kernels, fastplug too); the others
# do not (bench/_fla.py), so `transformers` is its plain-torch delta rule.
_QWEN3_5_LORA = ATTENTION_LORA + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
_QWEN3_5_LINEAR = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16)
_QWEN3_5_TINY = dict(
    _TINY,
    num_hidden_layers=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
)
MODELS["qwen3_5"] = dict(
    config="Qwen3_5TextConfig",
    batch=4,
    seq=2048,
    lora=_QWEN3_5_LORA + ["gate_proj", "up_proj", "down_proj"],
    attn="sdpa",
    full=dict(
        hidden_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=6144,
        **_QWEN3_5_LINEAR,
        linear_num_value_heads=16,
        vocab_size=248320,
        tie_word_embeddings=True,
    ),
    tiny=_QWEN3_5_TINY,
)
MODELS["qwen3_5_moe"] = dict(
    config="Qwen3_5MoeTextConfig",
    batch=4,
    seq=2048,
    lora=_QWEN3_5_LORA,
    attn="sdpa",
    full=dict(
        hidden_size=2048,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        **_QWEN3_5_LINEAR,
        linear_num_value_heads=32,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        vocab_size=248320,
    ),
    tiny=dict(
        _QWEN3_5_TINY,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
)
# Llama-3.1-8B layer widths, 4 layers, untied 128256-token head (the multi-GPU bench's larger model)
MODELS["llama8b_4l"] = dict(
    MODELS["llama"],
    full=dict(
        hidden_size=4096,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    tiny=dict(MODELS["llama"]["tiny"], tie_word_embeddings=False),
)


def _gemma4_init(model) -> None:
    """Gemma 4 trusts trained weights where random init (transformers') leaves softmaxes at their extremes:
    attention logits are scaled by 1.0, so q/k norms at one saturate every softmax (a head_dim-wide dot of unit-RMS
    heads), and the router projects a unit-norm row, so weights of std 0.02 give all experts near-equal logits.
    Either way the gradients or the routing are rounding noise, which the bf16 self-check finds apart between two
    implementations. q/k norm weights of head_dim ** -0.25 and router weights of std 1 give logits of unit scale."""
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("q_norm", "k_norm")) and getattr(module, "weight", None) is not None:
                module.weight.fill_(module.weight.shape[0] ** -0.25)
            if name.endswith("router.proj"):
                module.weight.normal_(0.0, 1.0)


# Gemma 4 at E2B widths (hidden 1536, head_dim 256 on sliding layers and 512 on full ones, one kv head, per-layer
# inputs, KV sharing in the last 3 of 8 layers, 262144-token tied head), random init; and its MoE block at 26B-A4B
# expert widths (128 experts top-8 of 704, beside a dense MLP; k = v full layers) in 6 layers of hidden 2048
_GEMMA4_TINY = dict(
    _TINY,
    num_hidden_layers=3,
    global_head_dim=32,
    intermediate_size=96,
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    num_kv_shared_layers=1,
    final_logit_softcapping=30.0,
)
MODELS["gemma4"] = dict(
    config="Gemma4TextConfig",
    init=_gemma4_init,
    batch=2,
    seq=2048,
    lora=ALL_LINEAR_LORA,
    attn="sdpa",
    full=dict(
        hidden_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        intermediate_size=6144,
        use_double_wide_mlp=True,
        vocab_size=262144,
        vocab_size_per_layer_input=262144,
        hidden_size_per_layer_input=256,
        sliding_window=512,
        layer_types=["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        num_kv_shared_layers=3,
        final_logit_softcapping=30.0,
        max_position_embeddings=131072,
    ),
    tiny=_GEMMA4_TINY,
)
MODELS["gemma4_moe"] = dict(
    config="Gemma4TextConfig",
    init=_gemma4_init,
    batch=2,
    seq=2048,
    lora=ALL_LINEAR_LORA,
    lora_parameters=["experts.gate_up_proj", "experts.down_proj"],
    attn="sdpa",
    full=dict(
        hidden_size=2048,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        intermediate_size=2112,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        vocab_size=262144,
        hidden_size_per_layer_input=0,
        sliding_window=1024,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        final_logit_softcapping=30.0,
        max_position_embeddings=131072,
    ),
    tiny=dict(
        _GEMMA4_TINY,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
)
# gpt-oss-20b's layer widths (hidden 2880, 64 heads of 64 and 8 kv heads, attention sinks, sliding 128 / full layers,
# 32 experts top-4 of 2880 with biases and the clamped SwiGLU, 201088-token head), 4 layers, bf16, random init; LoRA on
# attention and on the experts (peft target_parameters), as OpenAI's fine-tuning recipe does; transformers runs eager
# attention (its own sinks), the only built-in one that has them
MODELS["gpt_oss"] = dict(
    config="GptOssConfig",
    batch=2,
    seq=2048,
    lora=ATTENTION_LORA,
    lora_parameters=["experts.gate_up_proj", "experts.down_proj"],
    attn="eager",
    full=dict(
        hidden_size=2880,
        num_hidden_layers=4,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=131072,
    ),
    tiny=dict(
        _TINY,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    ),
)


# Qwen3-1.7B's shape: the grpo bench's second model (not an e2e preset: e2e, varlen and multi do not train it)
QWEN3_1_7B = dict(
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)
# The grpo bench's --tiny Llama and Qwen3: e2e's tiny Llama but for a 160-token vocabulary (its character tokenizer
# takes 101 ids, filler tokens the rest), as its --tiny runs have always had
GRPO_TINY = dict(MODELS["llama"]["tiny"], vocab_size=160)
# The qlora bench's --quick Llama: e2e's tiny untied Llama (llama8b_4l's, the shape its full rows scale down) but for
# a 96-wide MLP and 64 positions, the shape its --quick rows have always had
QLORA_TINY = dict(MODELS["llama8b_4l"]["tiny"], intermediate_size=96, max_position_embeddings=64)
