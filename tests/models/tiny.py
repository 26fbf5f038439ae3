"""Tiny random models of every supported family (hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16,
vocab 128; MoE: 4 experts, top-2), fp32, built from configs: nothing is downloaded."""

import torch
import transformers

VOCAB = 128
_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
)
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)

FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"hidden_activation": "gelu_pytorch_tanh"}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": 6,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"query_pre_attn_scalar": 16, "sliding_window": 6, "final_logit_softcapping": 30.0},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "sliding_window": 6, **_MOE}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, **_MOE},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32, **_MOE}),
}
FAMILIES = list(FAMILY_CONFIGS)


def tiny_config(family: str, **overrides):
    config_name, _, extra = FAMILY_CONFIGS[family]
    return getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random tiny causal LM; norm weights are randomised too (Gemma's start at zero)."""
    _, model_name, _ = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(batch_size: int = 2, tokens: int = 11, seed: int = 1):
    """input_ids, attention_mask (left padding on the first row) and labels with ignored positions."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch_size, tokens), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[:, 3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
