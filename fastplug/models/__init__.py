"""What fastplug patches in which model: matching rules and the few family quirks.

`RULES` are tried in order on every module of the model; the first that answers (Patch or Skip) wins.
"""

from .attention import match_attention
from .families import FAMILIES, SUPPORTED_FAMILIES, Family, family_of
from .gemma4 import match_gemma4
from .linear_attention import match_gated_norm, match_linear_attention
from .lm_head import match_lm_head, match_multimodal_head
from .mlp import match_mlp
from .moe import match_moe
from .norms import match_layer_norm, match_rms_norm
from .rules import MatchContext, Patch, Skip

RULES = (
    match_lm_head,
    match_gemma4,
    match_attention,
    match_linear_attention,
    match_gated_norm,
    match_multimodal_head,
    match_moe,
    match_mlp,
    match_rms_norm,
    match_layer_norm,
)

__all__ = [
    "FAMILIES",
    "SUPPORTED_FAMILIES",
    "Family",
    "family_of",
    "MatchContext",
    "Patch",
    "Skip",
    "RULES",
]
