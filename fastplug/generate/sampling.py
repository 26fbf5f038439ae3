"""Choosing tokens: greedy, or temperature / top-k / top-p sampling whose noise is a counter-based hash of
(seed, step, index), so no RNG state lives inside a captured graph and a seeded call gives the same tokens
with or without a graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float


def sampling_of(config, do_sample, temperature, top_k, top_p) -> Sampling:
    def pick(value, name, default):
        if value is not None:
            return value
        from_config = getattr(config, name, None) if config is not None else None
        return default if from_config is None else from_config

    sampling = Sampling(
        do_sample=bool(pick(do_sample, "do_sample", False)),
        temperature=float(pick(temperature, "temperature", 1.0)),
        top_k=pick(top_k, "top_k", 0),
        top_p=float(pick(top_p, "top_p", 1.0)),
    )
    if not sampling.do_sample:  # greedy: the other settings do not matter (nor split the captured graphs)
        return Sampling(False, 1.0, 0, 1.0)
    if not sampling.temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling; got {sampling.temperature}")
    if not isinstance(sampling.top_k, int) or sampling.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off); got {sampling.top_k!r}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1]; got {sampling.top_p}")
    return sampling


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplies; logical shifts by masking)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def choose(logits: torch.Tensor, s, sampling: Sampling) -> torch.Tensor:
    """The next token of each row (graph-safe: the settings live on the device, in the decoder.Session `s`)."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (probs.cumsum(-1) - probs) > s.top_p  # mass before this token already reaches top_p
        logits = logits.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    # argmax(p / E) with E ~ Exp(1) samples from p; E from a hash of (seed, step, index): 24 random bits
    bits = _mix(s.noise_index + (s.seed * 1_000_003 + s.count) * s.noise_index.numel())
    uniform = (((bits >> 40) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))
    return (probs / -torch.log(uniform)).argmax(-1)
