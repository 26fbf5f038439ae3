"""The functional API: pure ops on tensors. Knows nothing about models or trainers.

Every op runs its Triton kernels on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1), and its
plain-torch `*_reference` everywhere else.
"""

from .activations import geglu, geglu_reference, swiglu, swiglu_reference
from .attention import attention, attention_reference, cu_seqlens_from_position_ids
from .causal_conv import causal_conv1d, causal_conv1d_reference
from .cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    fused_linear_log_probs,
    fused_linear_log_probs_reference,
)
from .delta_rule import gated_delta_rule, gated_delta_rule_reference
from .fp8 import (
    dequantize_blockwise,
    dequantize_blockwise_reference,
    fp8_block_matmul,
    fp8_block_matmul_reference,
    fp8_linear,
    quantize_activation,
    quantize_activation_reference,
    quantize_weight_blockwise,
    quantize_weight_blockwise_reference,
)
from .lora import LoRAProjection, lora_linear, lora_mlp, lora_qkv
from .moe import (
    ExpertLoRA,
    grouped_gemm,
    grouped_gemm_reference,
    moe_experts,
    moe_experts_reference,
    moe_router,
    moe_router_reference,
)
from .norms import (
    layer_norm,
    layer_norm_reference,
    rms_norm,
    rms_norm_gated,
    rms_norm_gated_reference,
    rms_norm_reference,
)
from .quant import dequantize_4bit, dequantize_4bit_reference, gemv_4bit, gemv_4bit_reference
from .rope import rope, rope_reference

__all__ = [
    "rms_norm",
    "rms_norm_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm_gated",
    "rms_norm_gated_reference",
    "causal_conv1d",
    "causal_conv1d_reference",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "swiglu",
    "swiglu_reference",
    "geglu",
    "geglu_reference",
    "rope",
    "rope_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "fused_linear_log_probs",
    "fused_linear_log_probs_reference",
    "LoRAProjection",
    "lora_linear",
    "lora_qkv",
    "lora_mlp",
    "grouped_gemm",
    "grouped_gemm_reference",
    "moe_router",
    "moe_router_reference",
    "ExpertLoRA",
    "moe_experts",
    "moe_experts_reference",
    "attention",
    "attention_reference",
    "cu_seqlens_from_position_ids",
    "dequantize_4bit",
    "dequantize_4bit_reference",
    "gemv_4bit",
    "gemv_4bit_reference",
    "quantize_weight_blockwise",
    "quantize_weight_blockwise_reference",
    "quantize_activation",
    "quantize_activation_reference",
    "dequantize_blockwise",
    "dequantize_blockwise_reference",
    "fp8_block_matmul",
    "fp8_block_matmul_reference",
    "fp8_linear",
]
