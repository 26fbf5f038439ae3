"""fastplug's attention inside transformers: `"fastplug"` in AttentionInterface and AttentionMaskInterface.

A patched model (or one loaded with `attn_implementation="fastplug"`) builds no 4-D mask: the mask function
returns None unless the batch has real padding, and the attention function applies causality, the layer's
sliding window and softcap, and the document bounds of packed rows itself:
- no mask: `fastplug.kernels.attention.flash_attention`; TRL's cu_seq_lens_q, or position_ids that restart
  (padding-free / packed rows), give per-token document bounds, computed on the device once per forward
  (cached on that tensor), so the layer stack does not sync with the host. A caller that passes neither
  (a plain batch: transformers makes position_ids = arange) has rows that are not packed; a pre-hook on the
  patched model's decoder stack says so to the attention function (`UNPACKED`), which then needs no bounds:
  SDPA where it suits, eager or traced, with no host sync. Only with position_ids passed by the caller and
  where SDPA is a candidate (CUDA, no softcap, no window) does one cached check per forward ask the host
  whether rows are packed.
- a right-padded batch (each row's real tokens first, followed by fewer pads than the model's sliding window)
  on a model whose own path is eager (Gemma2's softcap, or loaded as eager): the mask function returns
  per-token bounds instead of a 4-D mask
  (`kernels.attention.right_padding_bounds`, a (2, B, T) int32 tensor) and the kernel runs with them: every
  token, pads included, sees the real keys up to itself, exactly what transformers' mask lets it see.
- any other padding mask (left padding or a window's length of right padding, whose pad queries see no key,
  holes, or a model whose own path is sdpa): the mask function builds the 4-D mask of the implementation
  the model had before (sdpa or eager; "sdpa" for a model loaded as "fastplug"), and the attention function
  runs that implementation: transformers' own path, bit for bit. Knowing whether a batch pads costs one
  host sync per mask, before the layer stack; under torch.compile (no syncs while traced) any
  attention_mask takes this path.
- dropout > 0 while training, or output_attentions: the family's eager attention with a 4-D mask built here.
- heads wider than the flash kernel's (Gemma 4's 512 on its full-attention layers): the implementation the model
  had (sdpa or eager), with no mask where it masks plain causality itself (sdpa), else a 4-D mask built here.
- a mask the caller composed beyond causality (Gemma 4's image tokens that see each other both ways, under
  `use_bidirectional_attention`; Gemma 3's, whose model composes them from token_type_ids: `composing`): the mask
  function builds the fallback's mask and that implementation runs.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from ..kernels import state
from .rules import off_the_gpu

NAME = "fastplug"
# id(config) -> (weakref to it, the implementation a patched model had): padded batches run it (set by
# `route`). The weakref tells this config from a dead one whose id was reused (configs are unhashable).
_FALLBACK: dict[int, tuple] = {}


def register() -> None:
    """Make "fastplug" a known attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fastplug_attention_forward)
    AttentionMaskInterface.register(NAME, fastplug_mask)


def routed(config) -> bool:
    """Whether a patch switched `config` to fastplug's attention (`route`) already."""
    hit = _FALLBACK.get(id(config))
    return hit is not None and hit[0]() is config


def fallback_name(config) -> str:
    if routed(config):
        return _FALLBACK[id(config)][1]
    return "eager" if getattr(config, "attn_logit_softcapping", None) is not None else "sdpa"


def route(config, decoder: nn.Module) -> callable:
    """Switch this model's config to "fastplug" (a model loaded as "fastplug" has it already) and let `decoder`
    (the stack of layers whose attention reads it) tell unpacked rows; returns the function that undoes both."""
    register()
    previous = config._attn_implementation
    fallback = fallback_name(config) if previous == NAME else previous or "eager"
    _FALLBACK[id(config)] = (weakref.ref(config), fallback)
    config._attn_implementation = NAME
    hook = decoder.register_forward_pre_hook(_note_unpacked_rows, with_kwargs=True)

    def undo():
        config._attn_implementation = previous
        _FALLBACK.pop(id(config), None)
        hook.remove()

    return undo


# Keyword the decoder stack's pre-hook adds to a forward whose caller passed no position_ids and no cu_seq_lens:
# transformers passes it on to every layer's attention function (its **kwargs), checkpoint recomputes included.
UNPACKED = "fastplug_rows_unpacked"
# Keyword of a forward whose rows fastplug packed (`padding.loss_only_inputs`): each token's document (start, end),
# computed once before the layers, which take them as they take their other inputs (the layer graphs too).
DOCUMENT_BOUNDS = "fastplug_document_bounds"


# Attribute of a mask fastplug gives the decoder where its attention needs none (`padding.loss_only_inputs`: the rows
# it packed, whose documents' bounds come as DOCUMENT_BOUNDS, and rows whose pads, if any, are on the right and
# predict nothing): `fastplug_mask` returns None for it unread. Without a mask, transformers would look for packed
# rows in position_ids before the layers (`find_packed_sequence_indices`, a host sync) only to have the mask dropped.
UNREAD_MASK = "_fastplug_unread_mask"


def rows_unpacked(args: tuple, kwargs: dict) -> bool:
    """Whether a decoder stack called with `args`, `kwargs` takes rows that are not packed: its caller passed no
    position_ids (the stack's third positional argument: input_ids, attention_mask, position_ids, ...) and no
    cu_seq_lens, so transformers numbers every row from 0."""
    return len(args) < 3 and kwargs.get("position_ids") is None and kwargs.get("cu_seq_lens_q") is None


def _note_unpacked_rows(module, args, kwargs):
    return (args, {**kwargs, UNPACKED: True}) if rows_unpacked(args, kwargs) else None


# id(config) -> weakref to it: configs whose model composes masks beyond causality that the config does not show
# (`Family.composes_masks`, Gemma 3's image tokens): a mask the caller does not let be skipped is built
_COMPOSING: dict[int, weakref.ref] = {}


def composing(config):
    """A patch switch: masks of `config`'s model that may not be skipped are built (see `_COMPOSING`); None where
    an earlier attention module of the model already switched it on."""
    if _composes(config):
        return None

    def switch():
        _COMPOSING[id(config)] = weakref.ref(config)
        return lambda: _COMPOSING.pop(id(config), None)

    return switch


def _composes(config) -> bool:
    hit = _COMPOSING.get(id(config))
    return hit is not None and hit() is config


# ----------------------------------------------------------------------------------------- the mask
def fastplug_mask(*args, **kwargs):
    """None (the kernel masks by itself) unless the 2-D attention_mask pads; then padding bounds for the kernel
    or the fallback's 4-D mask (see the module's docstring). Arguments pass through untouched: transformers
    5.17 and 5.23 name them differently."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from ..kernels.attention import right_padding_bounds

    attention_mask = kwargs.get("attention_mask")
    fallback = fallback_name(kwargs.get("config"))
    if _composed_beyond_causal(kwargs):
        return ALL_MASK_ATTENTION_FUNCTIONS[fallback](*args, **kwargs)
    if attention_mask is None or getattr(attention_mask, UNREAD_MASK, False):
        return None
    if torch.compiler.is_compiling():  # traced: no host sync to learn whether it pads; this mask is exact
        return ALL_MASK_ATTENTION_FUNCTIONS[fallback](*args, **kwargs)
    if attention_mask.dim() == 2 and attention_mask.shape[-1] == kwargs.get("kv_length"):
        # one host sync per mask, before the layer stack (flash-attention's mask does the same)
        if fallback == "eager" and _queries_are_the_keys(kwargs):
            bounds, right_padded = right_padding_bounds(attention_mask)
            window = getattr(kwargs.get("config"), "sliding_window", None)
            if window:  # a pad further than the window from the last real key would see no key at all
                pads = attention_mask.shape[-1] - bounds[1, :, -1]  # a right-padded row's last end: its count
                right_padded = right_padded & (pads < window)
            no_padding, all_right = torch.stack((attention_mask.bool().all(), right_padded.all())).tolist()
            if no_padding:
                return None
            if all_right:
                return bounds
        elif bool(attention_mask.all()):
            return None
    return ALL_MASK_ATTENTION_FUNCTIONS[fallback](*args, **kwargs)


def _composed_beyond_causal(kwargs) -> bool:
    """Whether the caller's mask function may let a token see keys after it: a config that makes some tokens attend
    both ways (Gemma 4's `use_bidirectional_attention`, "vision" or "all"; a model that composes such masks itself,
    Gemma 3's) with a mask the caller may not skip."""
    config = kwargs.get("config")
    both_ways = isinstance(getattr(config, "use_bidirectional_attention", None), str) or _composes(config)
    return both_ways and False in (kwargs.get("allow_is_causal_skip"), kwargs.get("allow_is_bidirectional_skip"))


def _queries_are_the_keys(kwargs) -> bool:
    """The mask's queries are its keys, positions 0..kv_length-1 (no cache: training, a prefill from empty)."""
    q_length = kwargs.get("q_length")
    if q_length is None:  # transformers 5.17 passes cache_position instead of q_length / q_offset
        position = kwargs.get("cache_position")
        q_length = None if position is None else position.shape[0]
    offsets = (kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))
    return q_length == kwargs.get("kv_length") and all(isinstance(o, int) and o == 0 for o in offsets)


def _padding_bounds_of(attention_mask):
    """The (start, end) that `fastplug_mask` returned for a padded batch, or None for a 4-D mask / no mask."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 3 and attention_mask.dtype == torch.int32:
        return attention_mask[0], attention_mask[1]
    return None


# ---------------------------------------------------------------------------------- packed rows
def _document_bounds(source: torch.Tensor, batch: int, tokens: int, device: torch.device):
    """Per-token document (start, end) from TRL's cu_seq_lens_q (int32, n + 1) or position_ids (B or 1, T)."""
    from ..kernels.attention import bounds_from_cu_seqlens, packed_bounds

    if source.dim() == 1:
        return bounds_from_cu_seqlens(source.to(device, torch.int32), tokens)
    return packed_bounds(source.expand(batch, -1))


class _BoundsCache:
    """The document bounds of the last packed batch: every layer of a forward (and the recompute under
    checkpointing) passes the same position_ids / cu_seq_lens tensor, so they are computed once. Registered with
    `kernels.state`: the last restore() empties it (it holds device tensors)."""

    def __init__(self):
        self.key = None
        self.value = None

    def clear(self) -> None:
        self.key = self.value = None

    def get(self, source: torch.Tensor, batch: int, tokens: int, device: torch.device, need_packed: bool):
        """(start, end, packed) from TRL's cu_seq_lens_q (int32, n + 1) or position_ids (B or 1, T); `packed`
        is None unless asked for (from position_ids that costs the one host sync, cached with the bounds)."""
        key = (source._version, batch)
        if self.key is not None and self.key[0]() is source and self.key[1] == key:
            start, end, packed = self.value
        else:
            start, end = _document_bounds(source, batch, tokens, device)
            # cu_seq_lens: its length says whether the row is packed, no sync
            packed = source.numel() > 2 if source.dim() == 1 else None
            self.key, self.value = (weakref.ref(source), key), (start, end, packed)
        if need_packed and packed is None:
            packed = bool((start != 0).any())
            self.value = (start, end, packed)
        return start, end, packed


_BOUNDS = state.register_cache("attention.document_bounds", _BoundsCache())


def _dense_mask(query, key, causal, window, start, end) -> torch.Tensor:
    """Additive (B, 1, T, S) mask for transformers' eager attention: the keys the kernel would let through."""
    from ..kernels.attention import visible_keys

    seen = visible_keys(query.shape[2], key.shape[2], causal, window, start, end, query.device)
    return torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~seen, torch.finfo(query.dtype).min
    )


def _family_eager(module: nn.Module):
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def _fallback_function(module: nn.Module, name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return _family_eager(module)
    return ALL_ATTENTION_FUNCTIONS[name]


# ------------------------------------------------------------------------- the attention function
def fastplug_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
):
    """transformers' attention-function contract: q (B, Hq, T, D), k/v (B, Hkv, S, D) -> ((B, T, Hq, D), None).
    s_aux: gpt-oss's attention sinks (Hq,), one logit per head in each row's softmax."""
    named = (("sliding_window", sliding_window), ("softcap", softcap), ("s_aux", s_aux))
    extra = {k: v for k, v in named if v is not None}
    unpacked = kwargs.pop(UNPACKED, False)
    padding = _padding_bounds_of(attention_mask)
    documents = kwargs.pop(DOCUMENT_BOUNDS, None)
    if documents is not None:  # rows packed by fastplug: the bounds come with them, and no mask
        padding = documents
    if attention_mask is not None and padding is None:  # the batch pads: transformers' path, its 4-D mask
        fn = _fallback_function(module, fallback_name(module.config))
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs)

    causal = kwargs.pop("is_causal", None)
    causal = getattr(module, "is_causal", True) if causal is None else causal
    T, S = query.shape[2], key.shape[2]
    # TRL's padding-free collator also passes cu_seq_lens_q (one packed row): bounds without any host sync
    source = kwargs.get("cu_seq_lens_q") if query.shape[0] == 1 else None
    if source is None or source.dim() != 1:
        source = kwargs.get("position_ids")
        if source is not None and source.shape[-1] != T:
            source = None
    start = end = None
    packable = causal and not unpacked and source is not None and T == S and T > 1 and padding is None
    from ..kernels.attention import MAX_HEAD_DIM, _normalise_window, _sdpa_suits, flash_attention

    if padding is not None:  # transformers detects no packing in a padded batch either
        start, end = padding
    eager_needed = dropout > 0.0 or kwargs.get("output_attentions", False)
    if eager_needed or query.shape[-1] > MAX_HEAD_DIM:
        if packable:
            start, end, _ = _BOUNDS.get(source, query.shape[0], T, query.device, need_packed=False)
        window = _normalise_window(sliding_window, causal, T, S)
        name = "eager" if eager_needed else fallback_name(module.config)
        if name == "sdpa" and window is None and start is None and T in (1, S):  # SDPA's own is_causal
            mask = None
        else:
            mask = _dense_mask(query, key, causal, window, start, end)
        fn = _fallback_function(module, name)
        kwargs["is_causal"] = causal
        return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **extra, **kwargs)

    if packable and torch.compiler.is_compiling():
        # Traced: no cache (Python-side state) and no host sync to learn whether the rows are packed, so
        # the kernel always gets the document bounds (unpacked rows give one document: the same result).
        start, end = _document_bounds(source, query.shape[0], T, query.device)
    elif packable:
        window = _normalise_window(sliding_window, causal, T, S)
        sdpa_candidate = _sdpa_suits(query, key, causal, window, softcap, varlen=False, sinks=s_aux)
        start, end, packed = _BOUNDS.get(source, query.shape[0], T, query.device, need_packed=sdpa_candidate)
        if sdpa_candidate and not packed:
            start = end = None
    if key.dtype != query.dtype or value.dtype != query.dtype:  # RoPE under autocast returns fp32 q/k
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = flash_attention(
        query,
        key,
        value,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        scale=scaling,
        doc_start=start,
        doc_end=end,
        sinks=s_aux,
    )
    return out, None


def describe(module: nn.Module, family, fallback: str) -> str:
    """Which path this attention module takes (for handle.summary()), and when it leaves it."""
    from ..kernels.attention import MAX_HEAD_DIM

    extra = family.attention_extra_kwargs(module)
    window, softcap, sinks = extra.get("sliding_window"), extra.get("softcap"), extra.get("s_aux")
    head_dim = getattr(module, "head_dim", 0)
    if isinstance(head_dim, int) and head_dim > MAX_HEAD_DIM:
        return f"transformers' {fallback} attention: head_dim {head_dim} > the flash kernel's {MAX_HEAD_DIM}"
    quirks = [f"softcap {softcap:g}"] if softcap is not None else []
    quirks += [f"sliding window {window}"] if window is not None else []
    quirks += ["attention sinks"] if sinks is not None else []
    elsewhere = off_the_gpu(module)
    if elsewhere is not None:  # SDPA is CUDA's: elsewhere the flash kernel runs interpreted, or its torch reference
        what = "flash attention" + (f" ({', '.join(quirks)})" if quirks else "") + f" {elsewhere}"
    elif quirks:
        what = f"Triton flash kernel ({', '.join(quirks)})"
    else:
        what = "torch SDPA on CUDA, Triton flash kernel for packed rows"
    if fallback == "eager":
        notes = ["right-padded batches: the same kernel; other padding: transformers' eager"]
    else:
        notes = [f"padded batches: transformers' {fallback}, but loss-only training on the right: no mask"]
    dropout = getattr(module, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        notes.append(f"training: transformers' eager (attention_dropout {dropout:g})")
    return f"fastplug attention: {what}; " + "; ".join(notes)
