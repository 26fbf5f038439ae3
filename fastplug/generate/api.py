"""fast_generate: batched decoding with a static KV cache, sampling on the device and the UNMERGED LoRA
adapters a model is training, for evaluation and RL rollouts.

How it is fast:
- the KV cache is allocated once per (batch bucket, length bucket) and kept on the model between calls; a
  sliding-window layer keeps only its last `window` columns, as a ring (Gemma2/3: half the cache or less);
- the decoder runs as a plan built from the model's own weights (no transformers forward, no mask
  builders, no cache objects): on CUDA one decode step is captured in a CUDA graph and replayed, with the
  position, cache slot, stop flags and output buffer living on the device;
- the host syncs only to check for EOS, every `decoder._EOS_CHECK_EVERY` tokens; rows that finished keep decoding
  pad tokens (as transformers' generate does) until every row is done;
- LoRA stays unmerged: y = x W^T + s (x A^T) B^T reads the adapter tensors themselves (or compute-dtype
  copies refreshed at each call), so what generates is what is being trained;
- QLoRA: a bitsandbytes 4-bit base (NF4/FP4) is read packed, never run as a bitsandbytes module: the decode
  kernels' GEMV decodes it in its weight tiles (the per-op step: `gemv_4bit`), the prompt dequantizes it once;
- sampling (temperature, top-k, top-p, min-p; a repetition penalty greedy or sampled) draws its noise from a
  counter-based hash of (seed, step, index): no RNG state inside the graph, and a seeded call gives the same
  tokens with or without a graph.

Supports the families fastplug patches (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Mixtral, Qwen2/3-MoE):
softcaps, sliding windows (a ring of the last `window` columns per windowed layer), q/k norms, scaled
embeddings; MoE blocks run through the model's own (or fastplug's patched) block.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..models.structure import unwrap
from .decoder import MAX_EOS, Decoder
from .plan import Plan
from .sampling import sampling_of

_BATCH_BUCKETS = (1, 2, 4, 8, 16)  # batch sizes a cache (and graph) is built for; larger: multiples of 16
_LENGTH_BUCKET = 256  # cache lengths are rounded up to a multiple of this, so graphs survive new prompt lengths
_UNSET = object()
# model -> its Decoder. Kept beside the model, not on it: deepcopy (TRL's reference model) and pickling
# must not copy caches and CUDA graphs; the decoder holds the model's submodules, never the model itself,
# so the entry goes when the model does.
_DECODERS: "weakref.WeakKeyDictionary[nn.Module, Decoder]" = weakref.WeakKeyDictionary()


def _decoder(model: nn.Module) -> Decoder:
    """The model's decoder, rebuilt when its adapters changed (added, swapped, disabled, merged)."""
    base = unwrap(model)
    plan = Plan(model)
    decoder = _DECODERS.get(base)
    if decoder is None or decoder.plan.key != plan.key:
        plan.refresh()  # the adapters' compute-dtype copies exist before the decode kernels' plan takes them
        decoder = Decoder(plan)
        _DECODERS[base] = decoder
    decoder.plan.refresh()
    return decoder


def _bucket(n: int, buckets, step: int) -> int:
    for b in buckets:
        if n <= b:
            return b
    return -(-n // step) * step


def _as_ids(value, name: str) -> list[int]:
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else list(value.tolist() if torch.is_tensor(value) else value)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{name} must be a token id or a list of them; got {value!r}")
    return ids


def _check_inputs(input_ids, attention_mask, device) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be a 2-D integer tensor [batch, prompt]; got {_describe(input_ids)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one prompt token per row; got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}; "
            f"got {_describe(attention_mask)}"
        )
    mask = attention_mask.to(device=device, dtype=torch.long)
    if bool(((mask != 0) & (mask != 1)).any()) or bool((mask.diff(dim=1) < 0).any()) or bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "attention_mask must be 0/1 with LEFT padding (zeros before ones, every row ending in a "
            "token); use tokenizer.padding_side = 'left' for generation"
        )
    return input_ids.to(device=device, dtype=torch.long), mask


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dim()}-D {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def fast_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    generation_config=None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_token_id=_UNSET,
    pad_token_id=_UNSET,
    streamer=None,
    max_seq_length: int | None = None,
    cuda_graph: bool = True,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` tokens per row; returns [batch, prompt + generated] like
    transformers' `generate` (rows that stopped early are filled with `pad_token_id`).

    `input_ids` [batch, prompt] with LEFT padding (`attention_mask` zeros first). Sampling settings (do_sample,
    temperature, top_k, top_p, min_p, and repetition_penalty, which applies to greedy decoding too) come from
    the keyword arguments, else `generation_config`, else the model's generation config; greedy by default.
    `eos_token_id` / `pad_token_id` likewise (None: no EOS stop). Sampling draws from torch's global RNG
    once per call (a seed), so `torch.manual_seed` makes a call reproducible. `max_seq_length` (default: the
    one the model was loaded with by FastModel, if any) bounds prompt + new tokens: ValueError before
    generating when they do not fit. LoRA adapters are applied unmerged, as they stand at the call.
    `cuda_graph=False` decodes eagerly on CUDA too (for comparisons; the graph is the fast path).
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
    base = unwrap(model)
    config = generation_config if generation_config is not None else getattr(base, "generation_config", None)
    sampling = sampling_of(config, do_sample, temperature, top_k, top_p, min_p, repetition_penalty)
    eos = _as_ids(getattr(config, "eos_token_id", None) if eos_token_id is _UNSET else eos_token_id, "eos_token_id")
    if len(eos) > MAX_EOS:
        raise ValueError(f"at most {MAX_EOS} eos_token_id values; got {len(eos)}")
    pad = getattr(config, "pad_token_id", None) if pad_token_id is _UNSET else pad_token_id
    pad = _as_ids(pad, "pad_token_id")[:1] or eos[:1] or [0]  # transformers pads with the EOS id when unset

    plan_device = unwrap(model).get_input_embeddings().weight.device
    ids, mask = _check_inputs(input_ids, attention_mask, plan_device)
    rows, prompt = ids.shape
    needed = prompt + max_new_tokens
    max_seq_length = max_seq_length or vars(base).get("_fastplug_max_seq_length")
    if max_seq_length is not None and needed > max_seq_length:
        raise ValueError(
            f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) = {needed} tokens exceed max_seq_length "
            f"{max_seq_length}, the cache size"
        )
    seed = int(torch.randint(0, 2**62, (1,)).item()) if sampling.do_sample else 0

    was_training = model.training
    if was_training:  # no dropout while generating (and peft's layers stay on the fused view)
        model.eval()
    try:
        with torch.no_grad():
            decoder = _decoder(model)
            batch = _bucket(rows, _BATCH_BUCKETS, 16)
            session = decoder.session(batch, _bucket(needed, (), _LENGTH_BUCKET))
            if batch > rows:  # bucket rows: one real-looking token each, their output dropped
                ids = torch.cat([ids, ids.new_full((batch - rows, prompt), pad[0])])
                mask = torch.cat([mask, mask.new_ones(batch - rows, prompt)])
            if streamer is not None:
                streamer.put(input_ids.cpu())
            decoder.prefill(session, ids, mask, rows, sampling, eos, pad[0], seed)
            produced = decoder.decode(session, sampling, max_new_tokens - 1, streamer, cuda_graph)
            # every row done: transformers stops at the step where the last row finished
            produced = min(produced, int(session.done_at[:rows].max()) + 1)
            generated = session.out[:rows, :produced].clone()
    finally:
        if was_training:
            model.train()
        if streamer is not None:
            streamer.end()
    return torch.cat([input_ids.to(generated.device), generated], dim=1)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why fast_generate cannot run this model (None: it can), without generating."""
    try:
        Plan(model)
    except ValueError as error:
        return str(error)
    return None


def release(model: nn.Module) -> None:
    """Free the KV cache and CUDA graphs fast_generate keeps for this model; the next call allocates them again.
    An RL trainer calls it after its rollouts, so that the backward pass can use that memory."""
    decoder = _DECODERS.get(unwrap(model))
    if decoder is not None:
        decoder.sessions.clear()


def graph_status(model: nn.Module) -> str:
    """Words for the bench and logs: whether this model's decode step runs as a CUDA graph."""
    decoder = _DECODERS.get(unwrap(model))
    if decoder is None:
        return "not generated yet"
    if decoder.graph_failure:
        return f"eager (capture failed: {decoder.graph_failure})"
    captured = sum(len(s.graphs) for s in decoder.sessions.values())
    fast = any(decoder.uses_fast(s) for s in decoder.sessions.values())
    kernels = ", decode kernels" if fast else (f", per-op ({decoder.fast_reason})" if decoder.fast_reason else "")
    return (f"CUDA graph ({captured} captured)" if captured else "eager") + kernels
