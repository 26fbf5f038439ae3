"""Per-token log-probabilities of a causal LM's completions for RL trainers, through the fused LM-head kernel
(`fastplug.kernels.cross_entropy.fused_linear_log_probs`): the decoder's hidden states go through the head in
chunks, and no [batch, tokens, vocab] logits are made.

The computation runs inside a call of the model (an instance `forward` that takes `fastplug_log_probs=`), so that
whatever wraps the model sees a forward: peft's adapters and `disable_adapter()`, DDP's reducer, accelerate's
hooks. Any other call of the model goes to the forward it had before, untouched.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.cross_entropy import fused_linear_log_probs
from .families import family_of
from .lm_head import _head_forward as _patched_head_forward
from .structure import unwrap


@dataclass(frozen=True)
class LogProbsRequest:
    """What a `fastplug_log_probs=` call asks for: the log-probs of the last `logits_to_keep` tokens of each row
    under the temperature-scaled distribution, their entropies, and whether the head runs in fp32."""

    logits_to_keep: int
    temperature: float = 1.0
    entropy: bool = False
    fp32_head: bool = False


def log_probs_reason(model: nn.Module, fp32_head: bool = False) -> str | None:
    """Why the fused log-probs cannot reproduce this model's (None: they can)."""
    base = unwrap(model)
    if family_of(base) is None:
        model_type = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
        return f"model type {model_type!r} is not a family fastplug supports"
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"the config scales the logits ({name})"
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    if not isinstance(backbone, nn.Module) or backbone is base:
        return "no decoder backbone under the causal-LM head"
    head = base.get_output_embeddings()
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return f"the LM head is a {type(head).__name__}, not a plain nn.Linear (an adapter on it?)"
    forward = vars(head).get("forward")
    # fastplug's patched head is nn.Linear's forward; TRL's cast_lm_head_to_fp32 installs an fp32 linear
    if forward is not None and getattr(forward, "__func__", None) is not _patched_head_forward and not fp32_head:
        return "the LM head's forward was replaced on the instance"
    if head._forward_hooks or head._forward_pre_hooks:
        hooks = [*head._forward_pre_hooks.values(), *head._forward_hooks.values()]
        if not (fp32_head and all("cast" in getattr(h, "__name__", "") for h in hooks)):
            return "the LM head has forward hooks"
    return None


def completion_log_probs(model: nn.Module, input_ids, attention_mask, request: LogProbsRequest):
    """(log_probs, entropy or None) [rows, logits_to_keep], fp32, of input_ids' last `logits_to_keep` tokens given
    the tokens before them; positions whose attention_mask is 0 give 0. `model` is the transformers causal LM."""
    keep = request.logits_to_keep
    if not 0 < keep < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep must lie in [1, {input_ids.shape[1] - 1}]; got {keep}")
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden[:, -keep - 1 : -1]  # position t predicts token t + 1
    valid = attention_mask[:, -keep:].bool()
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    rows = hidden[valid]  # only the completion tokens go through the head
    autocast = torch.is_autocast_enabled(rows.device.type)
    if request.fp32_head:  # TRL's cast_lm_head_to_fp32: the head in fp32, outside autocast
        rows, weight = rows.float(), weight.float()
        bias = None if bias is None else bias.float()
    elif not autocast and weight.dtype != rows.dtype:
        rows = rows.to(weight.dtype)  # what nn.Linear would compute in
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if request.fp32_head and autocast:
        context = torch.autocast(rows.device.type, enabled=False)
    else:
        context = contextlib.nullcontext()
    with context:
        log_probs, entropy = fused_linear_log_probs(
            rows,
            weight,
            input_ids[:, -keep:][valid],
            bias=bias,
            temperature=request.temperature,
            softcap=softcap,
            entropy=request.entropy,
        )
    # masked_scatter keeps a batch without valid positions connected to the graph (a zero gradient)
    zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    log_probs = zeros.masked_scatter(valid, log_probs)
    return log_probs, None if entropy is None else zeros.masked_scatter(valid, entropy)


def install_log_probs_forward(model: nn.Module):
    """Give the causal LM under `model` an instance forward that answers `fastplug_log_probs=LogProbsRequest(...)`
    (with input_ids and attention_mask) with (log_probs, entropy) and passes every other call to the forward it
    had; returns the undo, which puts that forward back (a no-op once someone replaced ours)."""
    base = unwrap(model)
    had = vars(base).get("forward")
    previous = base.forward

    def forward(self, *args, fastplug_log_probs: LogProbsRequest | None = None, **kwargs):
        if fastplug_log_probs is None:
            return previous(*args, **kwargs)
        if args or kwargs.get("inputs_embeds") is not None or kwargs.get("input_ids") is None:
            raise TypeError("fastplug_log_probs calls take input_ids and attention_mask as keywords")
        return completion_log_probs(self, kwargs["input_ids"], kwargs["attention_mask"], fastplug_log_probs)

    bound = types.MethodType(forward, base)
    base.forward = bound

    def undo():
        if vars(base).get("forward") is bound:
            if had is None:
                del base.forward
            else:
                base.forward = had

    return undo
