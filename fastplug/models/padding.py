"""Padded training batches at the GPU's pace: right padding needs no mask, and lengths fall into a few buckets.

A training forward whose loss is all the caller gets (fastplug's fused LM-head loss, no hidden states or
attentions returned) reads nothing at a pad position but its label, which is ignored. In a right-padded row
every real token comes before every pad, so under causal attention no real token sees a pad, whatever the
mask says: dropping the mask changes the pads' own outputs only, and their gradients are zero. The layers
then run the plain causal path (flash attention, no 4-D mask) instead of the masked one, and a batch without
padding takes the same path.

Packing: where the batch pads and every layer attends through fastplug's attention (`packs_rows`), the real
tokens of all rows go into one row, each row a document of its own: the pads, often most of a batch of
varied lengths, cost nothing. Each token keeps its position in its row, a row's first token is no one's label
(the last token of the row before it predicts nothing), and the attention gets every token's document bounds
as an argument (`fast_attention.DOCUMENT_BOUNDS`), computed once on the device, so no token sees another row.

Bucketing: the HF Trainer's collator pads each batch to its longest row, so every batch has its own length
and a CUDA graph captured for one length rarely serves the next. Rounded up to a bucket (four per doubling, at
most a fifth of the row wasted), a handful of lengths serve a whole dataset; the extra pads are right pads
with ignored labels (in a packed row, documents of their own), so the loss and its gradients are those of the
batch as given. Where the layer graphs already replay a longer length, a batch is padded on to that one instead
of having its bucket captured (`RowLengths`): a capture costs the host about three to four repeated steps, padding
a few thousand tokens on a 1B model costs the device a fraction of one (fewer tokens on wider layers, `pad_slack`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .fast_attention import UNREAD_MASK

_SMALLEST_BUCKET = 64
# A packed row's pads form documents of this many tokens: attention then costs them a few tiles each, where
# one long pad document would cost what a real document of its length does
_PAD_DOCUMENT = 64
# RowLengths: a batch goes to a longer captured length that at most doubles its bucket or adds `slack` tokens,
# and its own bucket is captured once it has been served that way this many times (rent or buy)
_SERVED_BEFORE_CAPTURE = 8
# The slack where the stack's size is not known
_PAD_SLACK = 2048
# The slack times a decoder layer's parameters (those a token goes through: a MoE layer's experts count at
# top_k / experts). Rent or buy: a capture costs the host about 19 ms a layer, a padded token the device about
# 13 ns a layer per million of its parameters (Llama-1B's shape on an H200, `bench varlen` and `bench multi`,
# 2026-11-30), so _SERVED_BEFORE_CAPTURE padded batches of this many tokens more cost about one capture. 2,950
# tokens on Llama-1B's 61M-parameter layers, 2,300 on Gemma2-2B's, 825 on Llama-8B's.
_PAD_SLACK_PARAMETERS = 1.8e11
_PAD_SLACK_RANGE = (256, 16384)


class BatchPaths(Counter):
    """One patch's training forwards by the path their batch took (the patch's handle owns it and its summary()
    prints it); str: most frequent first, "" before the first."""

    def __str__(self) -> str:
        return "; ".join(f"{path}: {n}" for path, n in self.most_common())


def bucket_length(tokens: int) -> int:
    """`tokens` rounded up to the next bucket: 64, then four steps per doubling (..., 512, 640, 768, 896, 1024,
    1280, ...), so a bucket wastes less than a fifth of its length on padding."""
    if tokens <= _SMALLEST_BUCKET:
        return _SMALLEST_BUCKET
    step = max(1 << ((tokens - 1).bit_length() - 3), 1)  # a quarter of the power of two below
    return -(-tokens // step) * step


class RowLengths:
    """The length a training batch's rows are padded on to: their bucket (`bucket_length`), or a longer length the
    layer graphs replay already (`graphs`, the patch's LayerGraphs once installed) when that is at most twice the
    bucket or `slack` tokens more (`pad_slack`: fewer on wider layers). A bucket served that way
    _SERVED_BEFORE_CAPTURE times gets its own length (captured then) while the graphs may capture more shapes;
    after that the graphs' cap holds it, and it goes on being padded on rather than running eagerly."""

    def __init__(self, slack: int = _PAD_SLACK):
        self.graphs = None  # set by the patch once its layer graphs are installed; None: buckets only
        self.slack = slack
        self._served: Counter = Counter()  # (rows, bucket) -> batches padded on to a longer captured length

    def fit(self, rows: int, tokens: int) -> int:
        """The length for `rows` rows of `tokens` tokens (the longest row's, or a packed row's)."""
        length = bucket_length(tokens)
        if self.graphs is None:
            return length
        captured = self.graphs.replayed_lengths(rows)
        if length in captured:
            return length
        longer = [n for n in captured if length < n <= length + max(length, self.slack)]
        if not longer:
            return length
        if self._served[rows, length] >= _SERVED_BEFORE_CAPTURE and self.graphs.may_capture():
            return length
        self._served[rows, length] += 1
        return min(longer)


def pad_slack(layers: list[nn.Module], config) -> int:
    """RowLengths' slack for a stack of `layers` (_PAD_SLACK where there are none): _PAD_SLACK_PARAMETERS over the
    parameters a token goes through in the first (a MoE layer's experts, any parameter under a module named
    `experts`, at `config`'s top_k / experts; a 4-bit weight's packed bytes at two weights each), within
    _PAD_SLACK_RANGE."""
    if not layers:
        return _PAD_SLACK
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = next(
        (n for n in (getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")) if n),
        None,
    )
    routed = top_k / experts if isinstance(top_k, int) and isinstance(experts, int) and experts >= top_k > 0 else 1.0
    active = sum(
        p.numel()
        * (2 if getattr(p, "quant_state", None) is not None else 1)
        * (routed if "experts" in name.split(".") else 1.0)
        for name, p in layers[0].named_parameters()
    )
    low, high = _PAD_SLACK_RANGE
    return int(min(max(_PAD_SLACK_PARAMETERS / max(active, 1.0), low), high))


def unmaskable(attention_mask: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> tuple[str | None, list]:
    """(why this padded batch needs its mask (None: it does not), each row's real tokens): every row's real tokens
    come first, and no pad predicts a label (a pad's prediction depends on the mask; a real token's does not).
    Read on the host before the batch's copy where `note_rows_read_on_host` left them on this mask, else with one
    host sync."""
    known = getattr(attention_mask, _ROWS_READ_ON_HOST, None)
    if known is not None and ignore_index == _HOST_IGNORE_INDEX and known.still_holds(attention_mask, labels):
        return known.facts
    return padding_facts(attention_mask, labels, ignore_index)


def padding_facts(attention_mask: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> tuple[str | None, list]:
    """`unmaskable`'s answer computed from the tensors where they are (one host sync on a device)."""
    if attention_mask.dim() != 2 or labels is None or labels.shape != attention_mask.shape:
        return "a mask or labels of another shape", []
    mask = attention_mask.bool()
    right = (mask[:, 1:] <= mask[:, :-1]).all()
    predicted = nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index) != ignore_index  # label of t + 1
    no_pad_predicts = ~(predicted & ~mask).any()
    right, no_pad_predicts, *lengths = torch.cat((torch.stack((right, no_pad_predicts)), mask.sum(1))).tolist()
    if not right:
        return "padding not on the right", lengths
    return (None if no_pad_predicts else "a pad predicts a label (labels not ignored at the padding)"), lengths


# The padding facts of a batch read on the host, before its copy, ride on its device mask under this attribute, so
# that the forward need not wait for the device to learn them. They hold for the labels' ignore index -100 (the
# collators' and the loss's default).
_ROWS_READ_ON_HOST = "_fastplug_rows_read_on_host"
_HOST_IGNORE_INDEX = -100


class _RowsReadOnHost(NamedTuple):
    labels: weakref.ref  # the device labels the facts were read with
    versions: tuple[int, int]  # the mask's and the labels' versions then: a write in place since voids the facts
    facts: tuple  # padding_facts of their host copies

    def still_holds(self, attention_mask: torch.Tensor, labels) -> bool:
        return self.labels() is labels and self.versions == (attention_mask._version, labels._version)


def _mask_and_labels(batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch mapping's `attention_mask` and `labels` where both are tensors, else None."""
    if not isinstance(batch, Mapping):
        return None
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    return (mask, labels) if isinstance(mask, torch.Tensor) and isinstance(labels, torch.Tensor) else None


def host_padding_facts(batch) -> tuple | None:
    """`padding_facts` of a collated batch (a mapping with a 2-D `attention_mask` and `labels` on the host, ignore
    index -100), read there without a sync; None for anything else."""
    found = _mask_and_labels(batch)
    if found is None or found[0].device.type != "cpu":
        return None
    return padding_facts(*found, _HOST_IGNORE_INDEX)


def note_batch_read_on_host(moved, facts: tuple) -> None:
    """Leave `host_padding_facts` of a batch on its copy `moved` (`note_rows_read_on_host`)."""
    found = _mask_and_labels(moved)
    if found is not None:
        note_rows_read_on_host(*found, facts)


def note_rows_read_on_host(attention_mask: torch.Tensor, labels: torch.Tensor, facts: tuple) -> None:
    """Leave `facts` (`padding_facts` of the host copies of `attention_mask` and `labels`, ignore index -100) on
    the copied `attention_mask`, for `unmaskable` to read while the two are as copied."""
    known = _RowsReadOnHost(weakref.ref(labels), (attention_mask._version, labels._version), facts)
    setattr(attention_mask, _ROWS_READ_ON_HOST, known)


class LossOnlyBatch(NamedTuple):
    """A loss-only training batch as the decoder stack runs it (`loss_only_inputs`)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    decoder_mask: torch.Tensor | None  # the mask the decoder gets (None: none; `UNREAD_MASK`: one nothing reads)
    attention_mask: torch.Tensor | None  # which of input_ids are real tokens (the router's balance loss reads it)
    position_ids: torch.Tensor | None  # each token's position in its row (packed rows), else None
    bounds: tuple | None  # packed rows: each token's document (start, end), for the attention
    index: torch.Tensor | None = None  # packed rows: each real token's place in the flattened batch

    def unpacked(self, value: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
        """A per-token output of the packed row (1, n, ...) as the batch's (rows, tokens, ...), zeros at its pads:
        position i of the packed row is real token i (the pads after them dropped; missing ones zeros)."""
        real = self.index.numel()
        flat = value[0, :real]
        if flat.shape[0] < real:  # a shifted output is a position shorter
            flat = torch.cat((flat, flat.new_zeros((real - flat.shape[0], *flat.shape[1:]))))
        out = value.new_zeros((rows * tokens, *value.shape[2:])).index_copy(0, self.index, flat)
        return out.view(rows, tokens, *value.shape[2:])


def packs_rows(model: nn.Module, family) -> bool:
    """Whether `model`'s padded batches may be packed: every layer attends through fastplug's attention (which
    takes document bounds) and mixes tokens nowhere else (no linear-attention or convolution layers), with 1-D
    positions (not multimodal RoPE) and heads the flash kernel takes (a wider head's fallback would build a dense
    mask over the whole packed row)."""
    from ..kernels.attention import MAX_HEAD_DIM
    from .fast_attention import NAME

    config = model.config
    if family is None or family.attention_left is not None or family.rope == "multimodal":
        return False
    if getattr(config, "_attn_implementation", None) != NAME:
        return False
    if any(kind not in ("full_attention", "sliding_attention") for kind in getattr(config, "layer_types", None) or ()):
        return False
    for name in ("head_dim", "global_head_dim"):
        try:
            width = getattr(config, name, None)
        except Exception:  # transformers 5.2x: an attribute that varies by layer raises when read globally
            return False
        if isinstance(width, int) and width > MAX_HEAD_DIM:
            return False
    return True


def loss_only_inputs(
    model: nn.Module,
    input_ids,
    attention_mask,
    labels,
    position_ids,
    kwargs: dict,
    lengths: RowLengths | None,
    packs: bool,
    paths: BatchPaths,
) -> LossOnlyBatch | None:
    """A loss-only training forward's batch as the decoder should run it: right padding whose pads predict nothing
    needs no mask; where `packs` (`packs_rows`) a padded batch's rows are packed into one; the rows are padded on
    to the length `lengths` fits (None: as they are). None when the batch must run as given (left padding, packed
    rows, anything returned beyond the loss). The path taken is tallied in `paths`."""
    if torch.compiler.is_compiling():  # no host sync while traced, and no tally
        return None
    reason, real = _reason_to_keep(model.config, input_ids, attention_mask, labels, position_ids, kwargs)
    if reason is not None:
        paths[f"as given: {reason}"] += 1
        return None
    rows, tokens = input_ids.shape
    ignore_index = kwargs.get("ignore_index", -100)
    if packs and real and min(real) < tokens:
        return _packed(model, input_ids, labels, attention_mask, sum(real), lengths, ignore_index, paths)
    length = lengths.fit(rows, tokens) if lengths is not None else tokens
    paths[f"no mask, rows padded on to {_described(length, tokens)}" if length > tokens else "no mask"] += 1
    if length > tokens:
        extra = length - tokens
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids = nn.functional.pad(input_ids, (0, extra), value=_pad_id(model.config))
        labels = nn.functional.pad(labels, (0, extra), value=ignore_index)
        attention_mask = nn.functional.pad(attention_mask, (0, extra), value=0)
    decoder_mask = None
    if packs:
        # Every layer attends through fastplug's attention, which needs no mask for these rows; a mask it does not
        # read keeps transformers from looking for packed rows in the positions it numbers (a host sync).
        # (a new tensor: the caller's mask is not marked)
        decoder_mask = _unread(
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
        )
    return LossOnlyBatch(input_ids, labels, decoder_mask, attention_mask, None, None)


def packed_batch(
    model: nn.Module, input_ids, attention_mask, labels, kwargs: dict, lengths: RowLengths | None, family, paths
):
    """The batch packed into one row (`LossOnlyBatch`, its `index` set) where `loss_only_inputs` would pack it, for a
    loss path that is not fastplug's own but reads the real tokens' predictions only (TRL's fused LM head); None:
    run it as given (nothing is tallied then)."""
    if torch.compiler.is_compiling() or not isinstance(attention_mask, torch.Tensor) or labels is None:
        return None
    if not packs_rows(model, family):
        return None
    reason, real = _reason_to_keep(model.config, input_ids, attention_mask, labels, None, kwargs)
    if reason is not None or not real or min(real) == input_ids.shape[1]:
        return None
    ignore_index = kwargs.get("ignore_index", -100)
    return _packed(model, input_ids, labels, attention_mask, sum(real), lengths, ignore_index, paths)


def _described(length: int, tokens: int) -> str:
    """Which length `tokens` tokens were padded on to, for the tally."""
    if length == bucket_length(tokens):
        return f"a bucket length ({length})"
    return f"its own length ({length})" if length == tokens else f"a longer length the graphs replay ({length})"


def _unread(mask: torch.Tensor) -> torch.Tensor:
    """`mask` (a bool tensor of fastplug's own) marked `UNREAD_MASK`: fastplug's mask function returns None for it."""
    setattr(mask, UNREAD_MASK, True)
    return mask


def _pad_id(config) -> int:
    pad_id = getattr(config, "pad_token_id", None)
    return pad_id if isinstance(pad_id, int) and 0 <= pad_id < getattr(config, "vocab_size", 0) else 0


def _packed(
    model, input_ids, labels, attention_mask, real: int, lengths: RowLengths | None, ignore_index: int, paths
) -> LossOnlyBatch:
    """The real tokens of a right-padded batch in one row (`real` of them, known from the check of its padding),
    then pads up to the length `lengths` fits it to, as short documents of their own. Device ops only."""
    from ..kernels.attention import packed_bounds

    tokens = input_ids.shape[1]
    length = lengths.fit(1, real) if lengths is not None else real
    paths[f"padding dropped, rows packed into one of {_described(length, real)}"] += 1
    # right padding: the real tokens in row order, and a token's column is its position in its row
    index = torch.nonzero_static(attention_mask.reshape(-1).bool(), size=real).squeeze(1)
    positions = index % tokens
    ids = nn.functional.pad(input_ids.reshape(-1)[index], (0, length - real), value=_pad_id(model.config))
    # a row's first token is the label the row before's last token would predict: ignored, as its pads were
    target = labels.reshape(-1)[index].masked_fill(positions == 0, ignore_index)
    target = nn.functional.pad(target, (0, length - real), value=ignore_index)
    pads = torch.arange(length - real, device=positions.device) % _PAD_DOCUMENT
    positions = torch.cat((positions, pads))[None]
    decoder_mask = _unread((torch.arange(length, device=ids.device) < real)[None])  # bool: transformers passes it on
    mask = decoder_mask.to(attention_mask.dtype)
    return LossOnlyBatch(ids[None], target[None], decoder_mask, mask, positions, packed_bounds(positions), index)


def _reason_to_keep(config, input_ids, attention_mask, labels, position_ids, kwargs: dict) -> tuple[str | None, list]:
    """(why this batch must run as given (None: it may drop its mask and be padded on or packed), each row's real
    tokens where it has a mask)."""
    if input_ids is None or input_ids.dim() != 2 or kwargs.get("inputs_embeds") is not None:
        return "embeddings, not token ids", []
    if position_ids is not None or any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "shift_labels")):
        return "packed rows or shifted labels", []
    for asked in ("output_hidden_states", "output_attentions"):
        if kwargs.get(asked, getattr(config, asked, False)):
            return "hidden states or attentions asked for", []
    if getattr(config, "use_bidirectional_attention", False):  # real tokens would see the pads after them
        return "bidirectional attention", []
    rows, tokens = input_ids.shape
    for name, value in kwargs.items():  # token_type_ids and the like: per-token inputs fastplug would not pad
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, tokens):
            return f"a per-token argument ({name})", []
    if attention_mask is not None:
        return unmaskable(attention_mask, labels, kwargs.get("ignore_index", -100))
    return None, []


def bucketed_decoder(decoder: nn.Module, forward, lengths: RowLengths, paths: BatchPaths):
    """`forward` of the decoder stack with a training batch's rows padded on to the length `lengths` fits and the
    output trimmed back, for the loss paths that are not fastplug's own (TRL's LM head, a user's loss on the hidden
    states), where `loss_only_inputs` never sees the batch. The pads go after every token of a row and attention
    is causal, so no token of the batch sees them: the hidden states returned are those of the batch as given,
    and the pads' gradients are zero. Each row's mask is continued with its last value, so a row without padding
    stays without and a right-padded one stays right-padded (the attention path is the batch's own). Rows are not
    packed here: the caller may read the pads' hidden states (a loss whose labels count the pads), which packing
    would change. The path taken is tallied in `paths`."""

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
        length = lengths.fit(*input_ids.shape) if reason is None else None
        if reason is None and length > input_ids.shape[1]:
            tokens = input_ids.shape[1]
            paths[f"decoder inputs padded on to {_described(length, tokens)}"] += 1
            named["input_ids"] = nn.functional.pad(input_ids, (0, length - tokens), value=_pad_id(config))
            mask = named.get("attention_mask")
            if mask is not None:
                named["attention_mask"] = torch.cat((mask, mask[:, -1:].expand(-1, length - tokens)), dim=1)
            named["use_cache"] = False  # a cache would hold the pads' keys; a training step reads none
            return _trimmed(forward(**named), tokens)
        if reason is not None and input_ids is not None and bucket_length(input_ids.shape[1]) != input_ids.shape[1]:
            paths[f"decoder inputs as given: {reason}"] += 1
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
