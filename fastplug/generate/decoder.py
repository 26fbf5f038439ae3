"""The decoder of one model: the static per-batch state (`Session`: KV cache, positions, stop flags, output
buffer, all on the device), the per-op forward (prompt and decode step), one decode step on device state
only, and the decode loop that captures that step in a CUDA graph and replays it.

The KV cache is allocated once per (batch bucket, length bucket); a sliding-window layer keeps only its last
`window` columns, as a ring. The host syncs only to check for EOS, every `_EOS_CHECK_EVERY` tokens."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ..kernels import decode as decode_kernels
from ..kernels._utils import interpreter_enabled
from ..kernels.rope import rope, rope_reference
from .fast_decode import FastDecode, fast_decode_reason
from .plan import LayerPlan, Plan, apply_norm
from .sampling import Sampling, choose, penalize, see, see_prompt

_EOS_CHECK_EVERY = 16  # decode steps between host checks of "has every row finished"
_EAGER_WARMUP_STEPS = 2  # real decode steps run eagerly before capture (compiles Triton kernels, cuBLAS init)
MAX_EOS = 8  # EOS ids one call may stop on
# the decode step through fastplug.kernels.decode (~5 launches per layer) where the model allows it; False: the
# per-op path (projections through cuBLAS, ~21 launches per layer), kept for comparisons and the other cases
FAST_DECODE = True
_FAST_DECODE_ON_CPU = False  # tests: run the decode kernels under the Triton interpreter on CPU tensors


class Session:
    """Static buffers for one (batch bucket, cache length): the KV cache and the decode state, all on the
    device, so a captured decode step reads and advances them by itself."""

    def __init__(self, plan: Plan, batch: int, length: int, vocab: int):
        w = plan.weight
        device, dtype = w.device, w.dtype
        self.batch, self.length = batch, length
        # windowed layers keep a ring of their last `window` columns (column c at c % window)
        self.k = [
            torch.zeros(batch, lp.kv_heads, _cache_length(lp.window, length), lp.head_dim, device=device, dtype=dtype)
            for lp in plan.layers
        ]
        self.v = [torch.zeros_like(k) for k in self.k]
        # which absolute cache columns hold tokens (not pads); a ring reads it at the columns its slots hold
        self.valid = torch.zeros(batch, length, device=device, dtype=torch.bool)
        self.columns = torch.arange(length, device=device)
        longs = dict(device=device, dtype=torch.long)
        self.tok = torch.zeros(batch, 1, **longs)
        self.pos = torch.zeros(batch, 1, **longs)
        # one tensor, so that a step advances both in one launch
        self.counters = torch.zeros(2, **longs)
        self.slot = self.counters[0:1]  # the cache column the next token is written to
        self.count = self.counters[1:2]  # tokens generated so far
        self.out = torch.zeros(batch, length, **longs)
        self.finished = torch.zeros(batch, device=device, dtype=torch.bool)
        self.done_at = torch.zeros(batch, **longs)  # the step at which each row emitted its EOS
        self.eos = torch.full((MAX_EOS,), -1, **longs)  # fixed size: a graph keeps reading the same buffer
        self.pad = torch.zeros((), **longs)
        self.seed = torch.zeros((), **longs)
        self.temperature = torch.ones((), device=device, dtype=torch.float32)
        self.top_p = torch.ones((), device=device, dtype=torch.float32)
        self.min_p = torch.zeros((), device=device, dtype=torch.float32)
        self.penalty = torch.ones((), device=device, dtype=torch.float32)  # the repetition penalty
        self.seen = torch.zeros(batch, vocab, device=device, dtype=torch.bool)  # tokens each row has seen
        self.noise_index = torch.arange(batch * vocab, **longs).view(batch, vocab)
        self.graphs: dict = {}  # (do_sample, top_k, uses top_p, uses min_p, penalized, decode kernels) -> CUDAGraph
        self.rope: dict | None = None  # the decode kernels' RoPE tables, made at the first prefill


def _cache_length(window: int | None, length: int) -> int:
    """Cache columns of a layer: a window shorter than the session's length is all it ever reads."""
    return window if window is not None and window < length else length


def _attend(q, k, v, bias, scaling: float, softcap: float | None):
    """q [B, H, T, D] over k, v [B, Hkv, S, D] (grouped heads); bias [B, 1, T, S]: 0 attends, -inf not."""
    if softcap is None and q.shape[2] > 1:  # prefill: SDPA keeps memory linear in the prompt
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling, enable_gqa=True)
    b, h, t, d = q.shape
    kv_heads = k.shape[1]
    group = h // kv_heads
    qg = q.reshape(b, kv_heads, group * t, d)  # heads of one group share a key/value head
    scores = (qg @ k.transpose(-1, -2)).view(b, kv_heads, group, t, -1)
    if softcap is None:
        scores = torch.add(bias[:, :, None], scores, alpha=scaling)  # scale and mask in one kernel
    else:
        scores = torch.tanh(scores * scaling / softcap) * softcap + bias[:, :, None]  # transformers' order
    # accumulates in fp32 and rounds once, as softmax(float32).to(dtype) does, in one kernel
    probs = torch.softmax(scores, dim=-1)
    return (probs.view(b, kv_heads, group * t, -1) @ v).view(b, h, t, d)


def _rope(q, k, cos, sin):
    return rope(q, k, cos, sin) if q.is_cuda else rope_reference(q, k, cos, sin)


class Decoder:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.sessions: dict[tuple[int, int], Session] = {}
        self.graph_failure: str | None = None  # why capture failed once (then this model decodes eagerly)
        self.fast_reason = fast_decode_reason(plan)  # why the decode kernels cannot run it (None: they can)
        self.fast = FastDecode(plan) if self.fast_reason is None else None

    def uses_fast(self, s: Session) -> bool:
        """Whether this session's decode steps run through the decode kernels."""
        if self.fast is None or not FAST_DECODE or s.batch > decode_kernels.MAX_ROWS:
            return False
        return s.tok.is_cuda or (_FAST_DECODE_ON_CPU and interpreter_enabled())

    # -- the model
    def forward(self, s: Session, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] (fp32) of the last position; writes K/V of `ids` into the cache (T > 1: columns
        0..T-1, the prompt; T == 1: column `s.slot`; a windowed layer's ring holds column c at c % window)."""
        plan = self.plan
        t = ids.shape[1]
        h = plan.embed(ids)
        if plan.embed_scale is not None:
            h = h * plan.embed_scale
        rotary = plan.rotary_embeddings(h, pos)
        views = {}
        for index, lp in enumerate(plan.layers):
            if lp.window not in views:  # one mask and write column per window size, shared by the layers
                views[lp.window] = self._cache_view(s, t, lp.window, h.dtype)
            x = self._attention(lp, apply_norm(lp.input_norm, h), rotary[lp.rope_key], s, index, *views[lp.window])
            h = h + apply_norm(lp.post_attn_norm, x)
            h = h + apply_norm(lp.post_ff_norm, lp.mlp(apply_norm(lp.ff_norm, h)))
        logits = plan.lm_head(apply_norm(plan.final_norm, h[:, -1:]))
        if plan.final_softcap is not None:
            logits = torch.tanh(logits / plan.final_softcap) * plan.final_softcap
        return logits[:, -1].float()

    @classmethod
    def _cache_view(cls, s: Session, t: int, window: int | None, dtype) -> tuple:
        """(additive mask [B, 1, T, keys], the cache column a decode step writes: a [1] device tensor)."""
        allowed = cls._mask(s, t, window)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        length = _cache_length(window, s.length)
        return bias, (s.slot % length if length < s.length else s.slot)

    @staticmethod
    def _mask(s: Session, t: int, window: int | None) -> torch.Tensor:
        # Windows count cache columns, as transformers' sliding-window masks count cache positions; its
        # convention (masking_utils.sliding_window_overlay): query i sees key j when i - window < j <= i.
        if t == 1:
            if _cache_length(window, s.length) < s.length:  # a ring: it holds exactly the window
                held = decode_kernels.ring_columns(s.slot, window)
                mask = (held >= 0) & s.valid.gather(1, held.clamp(min=0).expand(s.batch, -1))
                return mask[:, None, None, :]
            mask = s.valid
            if window is not None:
                mask = mask & (s.columns > s.slot - window)
            return mask[:, None, None, :]
        cols = s.columns[:t]
        allowed = cols[None, :] <= cols[:, None]
        if window is not None:
            allowed = allowed & (cols[None, :] > cols[:, None] - window)
        mask = s.valid[:, None, None, :t] & allowed
        # a pad query sees itself: finite outputs (never read: pad keys are masked for every real query)
        return mask | torch.eye(t, dtype=torch.bool, device=cols.device)

    @staticmethod
    def _attention(lp: LayerPlan, x, cos_sin, s: Session, index: int, bias, write: torch.Tensor):
        b, t, _ = x.shape
        q = lp.q(x).view(b, t, lp.heads, lp.head_dim)
        k = lp.k(x).view(b, t, lp.kv_heads, lp.head_dim)
        v = lp.v(x).view(b, t, lp.kv_heads, lp.head_dim).transpose(1, 2)
        q, k = apply_norm(lp.q_norm, q), apply_norm(lp.k_norm, k)
        q, k = _rope(q.transpose(1, 2), k.transpose(1, 2), *cos_sin)
        k_cache, v_cache = s.k[index], s.v[index]
        if t == 1:
            k_cache.index_copy_(2, write, k)
            v_cache.index_copy_(2, write, v)
            keys, values = k_cache, v_cache
        else:  # the prompt attends over its own keys; the cache keeps what later tokens can see of them
            length = k_cache.shape[2]
            kept = s.columns[max(0, t - length) : t]
            k_cache.index_copy_(2, kept % length, k[:, :, -len(kept) :])
            v_cache.index_copy_(2, kept % length, v[:, :, -len(kept) :])
            keys, values = k, v
        out = _attend(q, keys, values, bias, lp.scaling, lp.softcap)
        return lp.o(out.transpose(1, 2).reshape(b, t, -1))

    # -- choosing and recording tokens
    def _emit(self, logits: torch.Tensor, s: Session, sampling: Sampling) -> None:
        token = torch.where(s.finished, s.pad, choose(logits, s, sampling))
        if sampling.penalized:
            see(s, token)
        newly = ~s.finished & (token[:, None] == s.eos).any(-1)
        s.done_at.copy_(torch.where(newly, s.count, s.done_at))
        s.finished.logical_or_(newly)
        s.out.index_copy_(1, s.count, token[:, None])
        s.tok.copy_(token[:, None])
        s.count.add_(1)

    def step(self, s: Session, sampling: Sampling) -> None:
        """One decode step, on device state only (what the CUDA graph captures)."""
        s.valid.index_fill_(1, s.slot, True)
        if not self.uses_fast(s):
            self._emit(self.forward(s, s.tok, s.pos), s, sampling)
            s.pos.add_(1)
            s.slot.add_(1)
            return
        logits = self.fast.logits(s)
        if sampling.do_sample:
            self._emit(logits, s, sampling)
            s.pos.add_(1)
            s.slot.add_(1)
        else:  # argmax, EOS and the output column in one launch (it advances pos), then slot and count in one
            logits = penalize(logits, s, sampling)
            decode_kernels.greedy_emit(logits, s.finished, s.done_at, s.count, s.eos, s.pad, s.out, s.tok, s.pos)
            s.counters.add_(1)
            if sampling.penalized:
                see(s, s.tok)

    # -- a whole call
    def session(self, batch: int, length: int) -> Session:
        """The cache for this batch bucket: the one in hand when it is long enough (its graphs too)."""
        for (held_batch, held_length), held in self.sessions.items():
            if held_batch == batch and held_length >= length:
                return held
        self.sessions.clear()  # one cache at a time: free the previous one's memory first
        self.sessions[(batch, length)] = Session(self.plan, batch, length, self.plan.vocab)
        return self.sessions[(batch, length)]

    def prefill(self, s: Session, ids, mask, real_rows: int, sampling: Sampling, eos, pad: int, seed: int):
        t = ids.shape[1]
        s.valid.zero_()
        s.valid[:, :t] = mask
        s.finished.zero_()
        s.finished[real_rows:] = True  # rows that only fill the batch bucket
        s.done_at.fill_(s.length)
        s.done_at[real_rows:] = 0
        s.eos.fill_(-1)
        if eos:
            s.eos[: len(eos)] = torch.tensor(eos, dtype=torch.long)
        s.pad.fill_(pad)
        s.seed.fill_(seed)
        s.temperature.fill_(sampling.temperature)
        s.top_p.fill_(sampling.top_p)
        s.min_p.fill_(sampling.min_p)
        s.penalty.fill_(sampling.repetition_penalty)
        if sampling.penalized:
            see_prompt(s, ids, mask)
        s.count.zero_()
        if s.rope is None and self.uses_fast(s):
            s.rope = self.fast.rope_tables(s)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # left padding: positions count real tokens
        self._emit(self.forward(s, ids, pos), s, sampling)
        s.pos.copy_(mask.sum(-1, keepdim=True))
        s.slot.fill_(t)

    def _capture(self, s: Session, sampling: Sampling, key):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step(s, sampling)
        except Exception as error:  # an op that syncs or allocates on the host: decode eagerly instead
            self.graph_failure = f"{type(error).__name__}: {error}".splitlines()[0]
            warnings.warn(
                f"fast_generate: CUDA graph capture failed, decoding eagerly ({self.graph_failure})", stacklevel=4
            )
            return None
        s.graphs[key] = graph
        return graph

    def decode(self, s: Session, sampling: Sampling, steps: int, streamer, cuda_graph: bool) -> int:
        """Runs up to `steps` decode steps after the prefill; returns how many tokens each row now has."""
        # a graph holds the step it captured: decode kernels or per-op (FAST_DECODE may change between calls)
        key = (
            sampling.do_sample,
            sampling.top_k,
            sampling.top_p < 1.0,
            sampling.min_p > 0,
            sampling.penalized,
            self.uses_fast(s),
        )
        graph = s.graphs.get(key) if cuda_graph else None
        may_capture = cuda_graph and s.tok.is_cuda and self.graph_failure is None
        streamed = 0
        done = 0
        while True:
            produced = 1 + done
            if done % _EOS_CHECK_EVERY == 0 or done == steps:
                if streamer is not None:  # batch 1 (transformers' streamers say so); nothing past its EOS
                    end = min(produced, int(s.done_at[0]) + 1)
                    if end > streamed:
                        streamer.put(s.out[0, streamed:end].cpu())
                    streamed = max(streamed, end)
                if done == steps or bool(s.finished.all()):
                    return produced
            if graph is None and may_capture and done >= _EAGER_WARMUP_STEPS:
                graph = self._capture(s, sampling, key)
                may_capture = graph is not None
            if graph is not None:
                graph.replay()
            else:
                self.step(s, sampling)
            done += 1
