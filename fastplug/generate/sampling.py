"""Choosing tokens: greedy, or temperature / top-k / top-p / min-p sampling whose noise is a counter-based hash
of (seed, step, index), so no RNG state lives inside a captured graph and a seeded call gives the same tokens
with or without a graph. A repetition penalty (greedy or sampled) divides the positive logits and multiplies the
negative ones of every token the row has seen (its prompt without padding, and what it generated), as
transformers' RepetitionPenaltyLogitsProcessor does.

Order, as transformers' generate applies its processors: repetition penalty, temperature, top-k, top-p, min-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0


def sampling_of(config, do_sample, temperature, top_k, top_p, min_p=None, repetition_penalty=None) -> Sampling:
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
        min_p=float(pick(min_p, "min_p", 0.0)),
        repetition_penalty=float(pick(repetition_penalty, "repetition_penalty", 1.0)),
    )
    if not sampling.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1: off); got {sampling.repetition_penalty}")
    if not sampling.do_sample:  # greedy: the warpers do not matter (nor split the captured graphs); the penalty does
        return Sampling(False, 1.0, 0, 1.0, 0.0, sampling.repetition_penalty)
    if not sampling.temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling; got {sampling.temperature}")
    if not isinstance(sampling.top_k, int) or sampling.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off); got {sampling.top_k!r}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1]; got {sampling.top_p}")
    if not 0.0 <= sampling.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0: off); got {sampling.min_p}")
    return sampling


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplies; logical shifts by masking)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def see_prompt(s, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Start the rows' seen-token sets (decoder.Session `s.seen`) from their prompts, padding left out."""
    s.seen.zero_()
    # a pad position writes the row's last token instead (a real one: prompts end in a token)
    s.seen.scatter_(1, torch.where(mask.bool(), ids, ids[:, -1:]), True)


def see(s, token: torch.Tensor) -> None:
    """Add each row's new token [B] to its seen set."""
    s.seen.scatter_(1, token.view(-1, 1), True)


def penalize(logits: torch.Tensor, s, sampling: Sampling) -> torch.Tensor:
    """The repetition penalty on fp32 logits [B, V]: seen tokens' logits divided by it where positive, multiplied
    where negative (transformers' RepetitionPenaltyLogitsProcessor); a no-op when it is 1."""
    if not sampling.penalized:
        return logits
    return torch.where(s.seen, torch.where(logits < 0, logits * s.penalty, logits / s.penalty), logits)


def choose(logits: torch.Tensor, s, sampling: Sampling) -> torch.Tensor:
    """The next token of each row (graph-safe: the settings live on the device, in the decoder.Session `s`)."""
    logits = penalize(logits, s, sampling)
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
    if sampling.min_p > 0:  # keep tokens at least min_p times as likely as the row's most likely one
        probs = probs.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), 0.0)
    # argmax(p / E) with E ~ Exp(1) samples from p; E from a hash of (seed, step, index): 24 random bits
    bits = _mix(s.noise_index + (s.seed * 1_000_003 + s.count) * s.noise_index.numel())
    uniform = (((bits >> 40) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))
    return (probs / -torch.log(uniform)).argmax(-1)
