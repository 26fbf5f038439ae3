"""The causal-LM head: with labels in training, the loss comes from `fused_linear_cross_entropy` on the
decoder's hidden states, and no [tokens, vocab] logits are ever made (logits=None is returned, as
transformers' own fused paths do). Evaluation, generation and anything unusual take the original forward.
"""

from __future__ import annotations

import sys

from torch import nn

from ..kernels.cross_entropy import fused_linear_cross_entropy
from .peft_lora import lora_projection
from .rules import MatchContext, Patch, Skip


def _plain_head(model: nn.Module):
    """(weight, bias) of the LM head when it is a plain linear right now, else None (LoRA on the head...)."""
    proj = lora_projection(model.lm_head)
    if proj is None or proj.lora_A is not None:
        return None
    return proj.weight, proj.bias


def _default_causal_lm_loss(model: nn.Module) -> bool:
    # A loss set on the instance, or another loss_type, is someone's choice: leave it to the original forward.
    return "_loss_function" not in vars(model) and getattr(model, "loss_type", None) in (None, "ForCausalLM")


def _moe_aux_loss(model, outputs, attention_mask):
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    return balance(outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def _output(moe: bool, **fields):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if moe:
        return MoeCausalLMOutputWithPast(**fields)
    fields.pop("aux_loss"), fields.pop("router_logits")
    return CausalLMOutputWithPast(**fields)


def _causal_lm_forward(moe: bool):
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        head = _plain_head(self) if labels is not None and self.training else None
        fused = (
            head is not None
            and isinstance(logits_to_keep, int) and logits_to_keep == 0
            and kwargs.get("return_dict", True) is not False
            and _default_causal_lm_loss(self)
        )
        if not fused:
            return type(self).forward(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                logits_to_keep=logits_to_keep, **kwargs,
            )
        kwargs.pop("return_dict", None)  # the original's @can_return_tuple consumes it too
        router_logits_wanted = False
        if moe:
            requested = kwargs.pop("output_router_logits", None)
            router_logits_wanted = self.config.output_router_logits if requested is None else requested
            kwargs["output_router_logits"] = router_logits_wanted
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )
        hidden = outputs.last_hidden_state
        ignore_index = kwargs.get("ignore_index", -100)
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:  # tokens < n predict token n (transformers' ForCausalLMLoss)
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        weight, bias = head
        loss = fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            shift_labels.reshape(-1).to(hidden.device),
            bias=bias,
            ignore_index=ignore_index,
            softcap=getattr(self.config, "final_logit_softcapping", None),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
        )
        aux_loss = None
        if router_logits_wanted:
            aux_loss = _moe_aux_loss(self, outputs, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return _output(
            moe,
            loss=loss,
            aux_loss=aux_loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=getattr(outputs, "router_logits", None),
        )

    return forward


def match_lm_head(module: nn.Module, ctx: MatchContext):
    if module is not ctx.root or not ctx.options.cross_entropy:
        return None
    if not type(module).__name__.endswith("ForCausalLM") or not hasattr(module, "lm_head"):
        return None
    if ctx.family is None:
        return Skip("lm_head_loss", "causal-LM forward of an unknown family is not reproduced")
    if not isinstance(getattr(module, "model", None), nn.Module):
        return Skip("lm_head_loss", "no `model` decoder attribute")
    if _plain_head(module) is None:
        return Skip("lm_head_loss", f"LM head is not a plain linear ({type(module.lm_head).__name__})")
    if ctx.family.moe and not hasattr(sys.modules[type(module).__module__], "load_balancing_loss_func"):
        return Skip("lm_head_loss", "MoE family without load_balancing_loss_func")
    return Patch("lm_head_loss", _causal_lm_forward(ctx.family.moe))
