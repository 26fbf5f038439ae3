"""RMSNorm (Llama-style, Gemma's 1 + w, Gemma 4's w in fp32 and its norms without a weight) and nn.LayerNorm."""

from __future__ import annotations

from torch import nn

from ..kernels.norms import layer_norm, rms_norm
from .rules import MatchContext, Patch, Skip


def _eps_attribute(module: nn.Module) -> str:
    """Where the norm keeps its epsilon: Llama's `variance_epsilon`, else `eps`."""
    return "variance_epsilon" if hasattr(module, "variance_epsilon") else "eps"


def _rms_norm_forward(offset: float, scale_in_fp32: bool, eps_attribute: str):
    # eps_attribute is looked up once, at patch time (`_eps_attribute`): a hasattr that misses goes through
    # nn.Module.__getattr__ and an AttributeError on every call, and the norms are called many times per step.
    if eps_attribute == "variance_epsilon":

        def forward(self, hidden_states):
            return rms_norm(
                hidden_states, self.weight, eps=self.variance_epsilon, offset=offset, scale_in_fp32=scale_in_fp32
            )

    else:

        def forward(self, hidden_states):
            return rms_norm(hidden_states, self.weight, eps=self.eps, offset=offset, scale_in_fp32=scale_in_fp32)

    return forward


def _weightless_rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, None, eps=self.eps)


def _looks_like_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and getattr(module, "bias", None) is None
        and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
    )


def _weightless(module: nn.Module) -> bool:
    # Gemma 4's v_norm and router norm: the normalised row alone, in x's dtype (with_scale=False, no weight)
    return (
        type(module).__name__.endswith("RMSNorm")
        and getattr(module, "with_scale", None) is False
        and getattr(module, "weight", None) is None
        and isinstance(getattr(module, "eps", None), float)
    )


def match_rms_norm(module: nn.Module, ctx: MatchContext):
    if not ctx.options.rms_norm or isinstance(module, nn.RMSNorm):
        return None
    if _weightless(module):
        return Patch("rms_norm", _weightless_rms_norm_forward)
    if not _looks_like_rms_norm(module):
        return None
    if ctx.family is not None:
        family = ctx.family
        forward = _rms_norm_forward(family.rms_norm_offset, family.rms_norm_scale_in_fp32, _eps_attribute(module))
        return Patch("rms_norm", forward)
    # Unknown family: Llama's norm stores `variance_epsilon`; an `eps` norm may be Llama- or Gemma-style.
    if hasattr(module, "variance_epsilon"):
        return Patch("rms_norm", _rms_norm_forward(0.0, False, "variance_epsilon"))
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
