"""Mixture-of-experts kernels: grouped GEMMs with the token permutation fused into their loads and stores,
the top-k router and routing metadata, and the expert MLP (with LoRA on the expert weights) built on them.
Launch configs are autotuned and cached on disk (`tuning`)."""

from .experts import ExpertLoRA, moe_experts, moe_experts_reference
from .grouped_gemm import grouped_gemm, grouped_gemm_reference
from .routing import moe_router, moe_router_reference, routing_metadata, routing_metadata_reference

__all__ = [
    "grouped_gemm",
    "grouped_gemm_reference",
    "moe_router",
    "moe_router_reference",
    "routing_metadata",
    "routing_metadata_reference",
    "ExpertLoRA",
    "moe_experts",
    "moe_experts_reference",
]
