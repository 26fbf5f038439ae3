"""Padded training batches at the GPU's pace: right padding needs no mask, and lengths fall into a few buckets.

A training forward whose loss is all the caller gets (fastplug's fused LM-head loss, no hidden states or
attentions returned) reads nothing at a pad position but its label, which is ignored. In a right-padded row
every real token comes before every pad, so under causal attention no real token sees a pad, whatever the
mask says: dropping the mask changes the pads' own outputs only, and their gradients are zero. The layers
then run the plain causal path (flash attention, no 4-D mask) instead of the masked one, and a batch without
padding takes the same path.

Bucketing: the HF Trainer's collator pads each batch to its longest row, so every batch has its own length
and a CUDA graph captured for one length rarely serves the next. Rounded up to a bucket (four per doubling, at
most a fifth of the row wasted), a handful of lengths serve a whole dataset; the extra pads are right pads
with ignored labels, so the loss and its gradients are those of the batch as given.
"""

from __future__ import annotations

import torch
from torch import nn

_SMALLEST_BUCKET = 64


def bucket_length(tokens: int) -> int:
    """`tokens` rounded up to the next bucket: 64, then four steps per doubling (..., 512, 640, 768, 896, 1024,
    1280, ...), so a bucket wastes less than a fifth of its length on padding."""
    if tokens <= _SMALLEST_BUCKET:
        return _SMALLEST_BUCKET
    step = max(1 << ((tokens - 1).bit_length() - 3), 1)  # a quarter of the power of two below
    return -(-tokens // step) * step


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Every row's real tokens first, then only pads (or no pads): one host sync."""
    if attention_mask.dim() != 2:
        return False
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all()) if mask.shape[1] > 1 else True


def loss_only_inputs(model: nn.Module, input_ids, attention_mask, labels, position_ids, kwargs: dict, buckets: bool):
    """(input_ids, labels, the mask the decoder gets, the mask of the padded batch) for a loss-only training
    forward: the mask dropped for right padding and the rows right-padded to a bucket when asked; None when this
    batch must run as given (left padding, packed rows, inputs_embeds, anything returned beyond the loss)."""
    config = model.config
    if (
        input_ids is None
        or input_ids.dim() != 2
        or position_ids is not None
        or any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "shift_labels", "inputs_embeds"))
        or kwargs.get("output_hidden_states", getattr(config, "output_hidden_states", False))
        or kwargs.get("output_attentions", getattr(config, "output_attentions", False))
        or torch.compiler.is_compiling()  # no host sync while traced
        or (attention_mask is not None and not right_padded(attention_mask))
    ):
        return None
    tokens = input_ids.shape[1]
    length = bucket_length(tokens) if buckets else tokens
    if length > tokens:
        extra = length - tokens
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pad_id = getattr(config, "pad_token_id", None)
        pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < config.vocab_size else 0
        input_ids = nn.functional.pad(input_ids, (0, extra), value=pad_id)
        labels = nn.functional.pad(labels, (0, extra), value=kwargs.get("ignore_index", -100))
        attention_mask = nn.functional.pad(attention_mask, (0, extra), value=0)
    return input_ids, labels, None, attention_mask
