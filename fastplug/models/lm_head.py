"""The causal-LM head: with labels in training, the loss comes from `fused_linear_cross_entropy` on the
decoder's hidden states, and no [tokens, vocab] logits are ever made. Evaluation, generation and anything
unusual take the original forward.

Logits, by choice: the fused loss returns `logits=None`, as transformers' and Liger's fused paths do. None
rather than an object that raises when used, because code downstream tests for it (the Trainer's `if logits is
not None`, ModelOutput.to_tuple() leaving None out, accelerate walking the outputs). A caller that wants the
logits asks: `skip_logits=False` (the keyword of Liger and the Trainer) takes the original forward, logits and
loss; so do calls without labels, model.eval() (Trainer evaluation and compute_metrics get logits), and
patching with cross_entropy=False. `skip_logits=True` asks for the fused loss outside training too.

The loss is computed inside a call of the head module (its patched forward takes `fused_loss=`), so that hooks
on the head run around the weight read: FSDP2 gathers a sharded head in its pre-forward hook (accelerate puts
the head in an FSDP unit of its own) and sets up its backward in the post-forward hook.
"""

from __future__ import annotations

import dataclasses
import sys
import types

from torch import nn

from ..kernels.cross_entropy import fused_linear_cross_entropy
from .attention import CACHE_KEYWORDS
from .fast_attention import DOCUMENT_BOUNDS
from .padding import loss_only_inputs, packs_rows
from .rules import MatchContext, Patch, Skip, is_fsdp, own_class
from .structure import other_towers


def _head_forward(self, hidden_states, fused_loss=None):
    """nn.Linear's forward, or with `fused_loss` (fused_linear_cross_entropy's other arguments) the loss."""
    if fused_loss is None:
        return type(self).forward(self, hidden_states)
    return fused_linear_cross_entropy(hidden_states, self.weight, bias=self.bias, **fused_loss)


def _foreign_hooks(module: nn.Module) -> bool:
    # A hook of someone else may expect logits out of the head; FSDP2's only gather and reshard its weight.
    return bool(module._forward_hooks or module._forward_pre_hooks) and not is_fsdp(module)


def _head_reason(head) -> str | None:
    """Why the fused loss cannot run through this LM head at patch time (None: it can)."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return f"LM head is not a plain nn.Linear ({type(head).__name__})"
    if "forward" in vars(head):
        return "LM head forward already replaced on this instance by another library"
    if _foreign_hooks(head):
        return "LM head has forward hooks"
    return None


def _fused_head(model: nn.Module):
    """The LM head when the fused loss may run through it now (still ours, no foreign hooks), else None."""
    head = model.lm_head
    if getattr(vars(head).get("forward"), "__func__", None) is not _head_forward or _foreign_hooks(head):
        return None
    return head


def _install_head_forward(head: nn.Module):
    def switch():
        bound = types.MethodType(_head_forward, head)
        head.forward = bound

        def undo():
            if vars(head).get("forward") is bound:
                del head.forward

        return undo

    return switch


def _default_causal_lm_loss(model: nn.Module) -> bool:
    # A loss set on the instance, or another loss_type, is someone's choice: leave it to the original forward.
    return "_loss_function" not in vars(model) and getattr(model, "loss_type", None) in (None, "ForCausalLM")


def _moe_aux_loss(model, outputs, attention_mask):
    balance = sys.modules[own_class(model).__module__].load_balancing_loss_func
    return balance(outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def _output_class(moe: bool):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    return MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast


def _cache_field(moe: bool) -> str:
    """The outputs' KV-cache field by their own declaration (transformers 5.24 renamed past_key_values to cache),
    read at patch time: dataclasses.fields() inside a forward breaks torch.compile's graph."""
    names = {f.name for f in dataclasses.fields(_output_class(moe))}
    return next(name for name in CACHE_KEYWORDS if name in names)


def _output(moe: bool, cache_field: str, decoder_outputs, **fields):
    if not moe:
        fields.pop("aux_loss"), fields.pop("router_logits")
    fields[cache_field] = getattr(decoder_outputs, cache_field, None)  # the decoder's outputs use the same name
    return _output_class(moe)(**fields)


def _check_tokens(input_ids, inputs_embeds) -> None:
    """An empty batch or rows without tokens: say so here (transformers fails later, reshaping in attention)."""
    for name, tokens in (("input_ids", input_ids), ("inputs_embeds", inputs_embeds)):
        if tokens is not None and tokens.dim() >= 2 and (tokens.shape[0] == 0 or tokens.shape[1] == 0):
            what = "an empty batch (0 rows)" if tokens.shape[0] == 0 else "rows of length 0 (no tokens)"
            raise ValueError(
                f"fastplug: {name} has shape {tuple(tokens.shape)}: {what}; a causal LM needs at least one token "
                "per row. Drop empty batches and empty rows from the data (its filter or collator)."
            )


def _causal_lm_forward(
    moe: bool, cache_field: str, row_lengths, batch_paths, logits_divided_by: str | None = None, family=None
):
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        _check_tokens(input_ids, inputs_embeds)
        skip_logits = kwargs.pop("skip_logits", None)
        if skip_logits is not None and not isinstance(skip_logits, bool):
            raise TypeError(f"skip_logits must be True, False or None; got {skip_logits!r}")
        if skip_logits and labels is None:
            raise ValueError("skip_logits=True needs labels: without them there is no loss to compute instead")
        wants_fused = labels is not None and (self.training if skip_logits is None else skip_logits)
        head = _fused_head(self) if wants_fused else None
        fused = (
            head is not None
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
            and kwargs.get("return_dict", True) is not False
            and _default_causal_lm_loss(self)
        )
        if not fused:
            return type(self).forward(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        kwargs.pop("return_dict", None)  # the original's @can_return_tuple consumes it too
        router_logits_wanted = False
        if moe:
            requested = kwargs.pop("output_router_logits", None)
            router_logits_wanted = self.config.output_router_logits if requested is None else requested
            kwargs["output_router_logits"] = router_logits_wanted
        decoder_mask, batch = attention_mask, None
        if self.training and inputs_embeds is None:  # right padding needs no mask; rows packed; lengths into buckets
            packs = packs_rows(self, family)
            batch = loss_only_inputs(
                self, input_ids, attention_mask, labels, position_ids, kwargs, row_lengths, packs, batch_paths
            )
            if batch is not None:
                input_ids, labels, decoder_mask, attention_mask = batch[:4]
                if batch.bounds is not None:
                    position_ids, kwargs[DOCUMENT_BOUNDS] = batch.position_ids, batch.bounds
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=decoder_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        if batch is not None and batch.index is not None:  # a packed row: its pads come last and predict nothing
            real = batch.index.numel()
            hidden, labels = hidden[:, :real], labels[:, :real]
        ignore_index = kwargs.get("ignore_index", -100)
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:  # tokens < n predict token n (transformers' ForCausalLMLoss)
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        # num_items_in_batch: the Trainer's count over all micro-batches and ranks (the loss is a sum over it)
        loss = head(
            hidden.reshape(-1, hidden.shape[-1]),
            fused_loss=dict(
                labels=shift_labels.reshape(-1).to(hidden.device),
                ignore_index=ignore_index,
                softcap=getattr(self.config, "final_logit_softcapping", None),
                # Granite divides its logits by config.logits_scaling
                logit_scale=1.0 / getattr(self.config, logits_divided_by) if logits_divided_by else 1.0,
                num_items_in_batch=kwargs.get("num_items_in_batch"),
            ),
        )
        aux_loss = None
        if router_logits_wanted:
            aux_loss = _moe_aux_loss(self, outputs, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return _output(
            moe,
            cache_field,
            outputs,
            loss=loss,
            aux_loss=aux_loss,
            logits=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=getattr(outputs, "router_logits", None),
        )

    return forward


def match_multimodal_head(module: nn.Module, ctx: MatchContext):
    """A vision-language model of a known family (Qwen3.5's, Qwen2.5-VL's, Gemma 3's ... ForConditionalGeneration):
    its forward (vision features merged into the embeddings, 3-D RoPE positions, deepstack features) is not
    reproduced, so its loss stays transformers' (said in the summary); its language model is patched."""
    if module is not ctx.root or not ctx.options.cross_entropy or ctx.family is None:
        return None
    if type(module).__name__.endswith("ForCausalLM") or not hasattr(module, "lm_head") or not other_towers(module):
        return None
    return Skip(
        "lm_head_loss",
        f"{type(module).__name__}'s forward (vision features merged into the embeddings) is not reproduced: "
        "transformers' loss on full logits",
    )


def match_lm_head(module: nn.Module, ctx: MatchContext):
    if module is not ctx.root or not ctx.options.cross_entropy:
        return None
    if not type(module).__name__.endswith("ForCausalLM") or not hasattr(module, "lm_head"):
        return None
    if ctx.family is None:
        return Skip("lm_head_loss", "causal-LM forward of an unknown family is not reproduced")
    if not isinstance(getattr(module, "model", None), nn.Module):
        return Skip("lm_head_loss", "no `model` decoder attribute")
    reason = _head_reason(module.lm_head)
    if reason:
        return Skip("lm_head_loss", reason)
    if ctx.family.moe and not hasattr(sys.modules[own_class(module).__module__], "load_balancing_loss_func"):
        return Skip("lm_head_loss", "MoE family without load_balancing_loss_func")
    return Patch(
        "lm_head_loss",
        _causal_lm_forward(
            ctx.family.moe,
            _cache_field(ctx.family.moe),
            ctx.row_lengths,
            ctx.batch_paths,
            ctx.family.logits_divided_by,
            ctx.family,
        ),
        switch=_install_head_forward(module.lm_head),
    )
