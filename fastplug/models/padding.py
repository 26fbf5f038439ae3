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

import weakref
from collections import Counter

import torch
from torch import nn

_SMALLEST_BUCKET = 64
# model -> how many training forwards took which path (PatchHandle.summary() prints it)
_PATHS: "weakref.WeakKeyDictionary[nn.Module, Counter]" = weakref.WeakKeyDictionary()


def _record(model: nn.Module, path: str) -> None:
    _PATHS.setdefault(model, Counter())[path] += 1


def forget_batch_paths(model: nn.Module) -> None:
    _PATHS.pop(model, None)


def batch_paths(model: nn.Module) -> str:
    """The loss-only training forwards of `model` by path, most frequent first ("" before the first)."""
    paths = _PATHS.get(model)
    return "; ".join(f"{path}: {n}" for path, n in paths.most_common()) if paths else ""


def bucket_length(tokens: int) -> int:
    """`tokens` rounded up to the next bucket: 64, then four steps per doubling (..., 512, 640, 768, 896, 1024,
    1280, ...), so a bucket wastes less than a fifth of its length on padding."""
    if tokens <= _SMALLEST_BUCKET:
        return _SMALLEST_BUCKET
    step = max(1 << ((tokens - 1).bit_length() - 3), 1)  # a quarter of the power of two below
    return -(-tokens // step) * step


def unmaskable(attention_mask: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> str | None:
    """Why this padded batch needs its mask (None: it does not), with one host sync: every row's real tokens
    come first, and no pad predicts a label (a pad's prediction depends on the mask; a real token's does not)."""
    if attention_mask.dim() != 2 or labels.shape != attention_mask.shape:
        return "a mask or labels of another shape"
    mask = attention_mask.bool()
    right = (mask[:, 1:] <= mask[:, :-1]).all()
    predicted = nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index) != ignore_index  # label of t + 1
    no_pad_predicts = ~(predicted & ~mask).any()
    right, no_pad_predicts = torch.stack((right, no_pad_predicts)).tolist()
    if not right:
        return "padding not on the right"
    return None if no_pad_predicts else "a pad predicts a label (labels not ignored at the padding)"


def loss_only_inputs(model: nn.Module, input_ids, attention_mask, labels, position_ids, kwargs: dict, buckets: bool):
    """(input_ids, labels, the mask the decoder gets, the mask of the padded batch) for a loss-only training
    forward: no mask for right padding whose pads predict nothing, and the rows right-padded to a bucket when
    asked; None when the batch must run as given (left padding, packed rows, anything returned beyond the loss)."""
    if torch.compiler.is_compiling():  # no host sync while traced, and no tally
        return None
    reason = _reason_to_keep(model.config, input_ids, attention_mask, labels, position_ids, kwargs)
    if reason is not None:
        _record(model, f"as given: {reason}")
        return None
    tokens = input_ids.shape[1]
    length = bucket_length(tokens) if buckets else tokens
    _record(model, f"no mask, rows padded on to a bucket length ({length})" if length > tokens else "no mask")
    if length > tokens:
        extra = length - tokens
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pad_id = getattr(model.config, "pad_token_id", None)
        pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < model.config.vocab_size else 0
        input_ids = nn.functional.pad(input_ids, (0, extra), value=pad_id)
        labels = nn.functional.pad(labels, (0, extra), value=kwargs.get("ignore_index", -100))
        attention_mask = nn.functional.pad(attention_mask, (0, extra), value=0)
    return input_ids, labels, None, attention_mask


def _reason_to_keep(config, input_ids, attention_mask, labels, position_ids, kwargs: dict) -> str | None:
    """Why this batch must run as given (None: it may drop its mask and be padded on)."""
    if input_ids is None or input_ids.dim() != 2 or kwargs.get("inputs_embeds") is not None:
        return "embeddings, not token ids"
    if position_ids is not None or any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "shift_labels")):
        return "packed rows or shifted labels"
    for asked in ("output_hidden_states", "output_attentions"):
        if kwargs.get(asked, getattr(config, asked, False)):
            return "hidden states or attentions asked for"
    if getattr(config, "use_bidirectional_attention", False):  # real tokens would see the pads after them
        return "bidirectional attention"
    if attention_mask is not None:
        return unmaskable(attention_mask, labels, kwargs.get("ignore_index", -100))
    return None


def bucketed_decoder(owner: nn.Module, decoder: nn.Module, forward):
    """`forward` of the decoder stack with a training batch's rows padded on to a bucket length and the output
    trimmed back, for the loss paths that are not fastplug's own (TRL's LM head, a user's loss on the hidden
    states), where `loss_only_inputs` never sees the batch. The pads go after every token of a row and attention
    is causal, so no token of the batch sees them: the hidden states returned are those of the batch as given,
    and the pads' gradients are zero. Each row's mask is continued with its last value, so a row without padding
    stays without and a right-padded one stays right-padded (the attention path is the batch's own). The tally
    goes to `owner`'s batch paths."""

    def padded_forward(*args, **kwargs):
        if not (decoder.training and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        named = dict(zip(("input_ids", "attention_mask"), args), **kwargs) if len(args) <= 2 else None
        config = getattr(decoder, "config", None)
        if named is None:
            reason = "positional arguments beyond the mask"
        elif config is None:
            reason = "no model config"
        else:
            reason = _decoder_reason(config, named)
        input_ids = named.get("input_ids") if named is not None else None
        if reason is None and bucket_length(input_ids.shape[1]) > input_ids.shape[1]:
            tokens = input_ids.shape[1]
            length = bucket_length(tokens)
            _record(owner, f"decoder inputs padded on to a bucket length ({length})")
            pad_id = getattr(config, "pad_token_id", None)
            pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < getattr(config, "vocab_size", 0) else 0
            named["input_ids"] = nn.functional.pad(input_ids, (0, length - tokens), value=pad_id)
            mask = named.get("attention_mask")
            if mask is not None:
                named["attention_mask"] = torch.cat((mask, mask[:, -1:].expand(-1, length - tokens)), dim=1)
            named["use_cache"] = False  # a cache would hold the pads' keys; a training step reads none
            return _trimmed(forward(**named), tokens)
        if reason is not None and input_ids is not None and bucket_length(input_ids.shape[1]) != input_ids.shape[1]:
            _record(owner, f"decoder inputs as given: {reason}")
        return forward(*args, **kwargs)

    return padded_forward


def _decoder_reason(config, named: dict) -> str | None:
    """Why the decoder must run this batch as given (None: its rows may be padded on)."""
    input_ids = named.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or named.get("inputs_embeds") is not None:
        return "embeddings, not token ids"
    if any(named.get(k) is not None for k in ("position_ids", "cu_seq_lens_q", "past_key_values", "cache_position")):
        return "packed rows, positions or a cache passed"
    for asked in ("output_hidden_states", "output_attentions", "output_router_logits"):
        if named.get(asked, getattr(config, asked, False)):
            return "hidden states, attentions or router logits asked for"
    if getattr(config, "use_bidirectional_attention", False):  # tokens would see the pads after them
        return "bidirectional attention"
    mask = named.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
        return "a mask that is not one value per token"
    rows, tokens = input_ids.shape
    for name, value in named.items():  # token_type_ids and the like: per-token inputs fastplug would not pad
        if name not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.shape[:2] == (rows, tokens):
                return f"a per-token argument ({name})"
    return None


def _trimmed(output, tokens: int):
    """The decoder's output with its hidden states cut back to the batch's `tokens`."""
    if isinstance(output, tuple):
        return (output[0][:, :tokens], *output[1:])
    output.last_hidden_state = output.last_hidden_state[:, :tokens]
    return output
