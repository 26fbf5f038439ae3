"""The decode kernels (fastplug/kernels/decode.py moved here whole; the split by stage follows)."""

from .gemv import (  # noqa: F401
    ACTIVATIONS,
    MAX_ROWS,
    MAX_SEGMENTS,
    WORDS_MAX_ROWS,
    DecodeGemvConfig,
    _gemv_config,
    add_rms_norm,
    decode_attention,
    decode_attention_reference,
    decode_gemv_config,
    gemv,
    gemv_reference,
    greedy_emit,
    packed_reason,
    ring_columns,
)
