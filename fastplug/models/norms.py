"""RMSNorm (Llama-style and Gemma's 1 + w) and nn.LayerNorm."""

from __future__ import annotations

from torch import nn

from ..kernels.norms import layer_norm, rms_norm
from .rules import MatchContext, Patch, Skip


def _rms_norm_forward(offset: float):
    def forward(self, hidden_states):
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        return rms_norm(hidden_states, self.weight, eps=eps, offset=offset)

    return forward


def _looks_like_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and getattr(module, "bias", None) is None
        and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
    )


def match_rms_norm(module: nn.Module, ctx: MatchContext):
    if not ctx.options.rms_norm or not _looks_like_rms_norm(module) or isinstance(module, nn.RMSNorm):
        return None
    if ctx.family is not None:
        return Patch("rms_norm", _rms_norm_forward(ctx.family.rms_norm_offset))
    # Unknown family: Llama's norm stores `variance_epsilon`; an `eps` norm may be Llama- or Gemma-style.
    if hasattr(module, "variance_epsilon"):
        return Patch("rms_norm", _rms_norm_forward(0.0))
    return Skip("rms_norm", "RMSNorm variant of an unknown family (weight or 1 + weight?)")


def _layer_norm_forward(self, x):
    return layer_norm(x, self.weight, self.bias, eps=self.eps)


def match_layer_norm(module: nn.Module, ctx: MatchContext):
    # Exact nn.LayerNorm only: subclasses may compute something else.
    if not ctx.options.layer_norm or type(module) is not nn.LayerNorm:
        return None
    if len(module.normalized_shape) != 1:
        return Skip("layer_norm", f"normalizes over {len(module.normalized_shape)} dims")
    return Patch("layer_norm", _layer_norm_forward)
