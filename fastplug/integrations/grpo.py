"""TRL's GRPO and RLOO trainers with fast rollouts and fused per-token log-probs.

    from fastplug.integrations.trl import FastGRPOTrainer
    trainer = FastGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                              peft_config=LoraConfig(...))   # options=KernelOptions(...), as FastSFTTrainer
    trainer.train()

Two hooks of TRL's trainers are replaced, and nothing else: the loss, the advantages, the rewards, the logging and
the data handling stay TRL's own code.

- `_generate_single_turn` (TRL's transformers-`generate` rollout): the prompts, left padded, go through fastplug's
  `fast_generate` with the model's current adapters, unmerged (static KV cache, CUDA graphs, decode kernels),
  under TRL's generation config (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, EOS
  ids), and the completions are cut after their first EOS as TRL cuts them. The KV cache and graphs are freed
  after each rollout, so that training can use that memory.
- `_get_per_token_logps_and_entropies` (the policy, old-policy and reference passes): the decoder's hidden states
  go through `fused_linear_log_probs` (LM head, temperature, log-softmax and gather in chunks, with its backward;
  the entropy from the same pass) and no [batch, tokens, vocab] logits are made. The pass runs inside a call of
  the model (fastplug.models.log_probs), so peft's `disable_adapter()` (TRL's reference for LoRA) and DDP see it.

Where either cannot reproduce TRL's own path (vLLM or continuous batching asked for, DeepSpeed/FSDP, multimodal
inputs, a model family fast_generate does not cover, a generation setting it lacks, the MoE load-balancing loss)
that call takes TRL's path, and the trainer says so once (a warning and a line in `fast_kernels_summary`).
"""

from __future__ import annotations

import warnings

import torch

try:
    import trl
    from trl.extras.profiling import profiling_context, profiling_decorator
except ImportError as err:
    raise ImportError(f'fastplug.integrations.grpo needs TRL: pip install "fastplug[trl]" ({err})') from err

from ..generate.api import fast_generate, release, unsupported_reason
from ..models.log_probs import LogProbsRequest, install_log_probs_forward, log_probs_reason
from ..models.structure import unwrap

__all__ = ["FastRolloutsMixin", "rl_trainer"]

# Generation settings fast_generate reproduces, and those that change nothing about the tokens
_SUPPORTED_GENERATION = {
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "cache_config", "disable_compile",
    "compile_config", "use_cache", "transformers_version", "_from_model_config", "return_dict_in_generate",
    "output_scores", "output_logits", "output_attentions", "output_hidden_states", "renormalize_logits",
    "remove_invalid_values", "low_memory", "prefill_chunk_size", "max_cache_len",
}  # fmt: skip
# Other settings at the value that turns them off
_NEUTRAL_GENERATION = {
    "num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1, "min_length": 0, "min_new_tokens": 0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0, "guidance_scale": 1.0,
    "length_penalty": 1.0, "diversity_penalty": 0.0, "early_stopping": False,
}  # fmt: skip
_MULTIMODAL = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def unsupported_generation(config) -> list[str]:
    """The settings of a transformers GenerationConfig that fast_generate does not reproduce."""
    if config is None:
        return []
    return sorted(
        f"{name}={value!r}"
        for name, value in config.to_diff_dict().items()
        if name not in _SUPPORTED_GENERATION and value is not None and _NEUTRAL_GENERATION.get(name, object()) != value
    )


class FastRolloutsMixin:
    """Fast rollouts and fused log-probs for TRL's GRPO-style trainers (module docstring); goes before
    fastplug.integrations.trl.TRLFastKernelsMixin and the TRL trainer in the bases (`rl_trainer` builds the class).

    Keywords besides the trainer's: `options` (KernelOptions or dict), `fast_generation` (False: TRL's own
    generation), `fast_log_probs` (False: TRL's own log-prob passes), `release_generation_memory` (False: keep
    the KV cache and CUDA graphs between rollouts, faster to start, memory held through training).
    """

    _ROLLOUT_RETURNS_LOGPROBS = True  # what TRL's _generate_single_turn returns: (completions, logprobs) or completions

    def __init__(
        self,
        *args,
        fast_generation: bool = True,
        fast_log_probs: bool = True,
        release_generation_memory: bool = True,
        **kwargs,
    ):
        self.fast_generation = fast_generation
        self.fast_log_probs = fast_log_probs
        self.release_generation_memory = release_generation_memory
        self._undo_log_probs = []  # the undo of each log-prob forward installed
        self._log_prob_models = set()  # id() of the causal LMs carrying it
        self._said = set()
        self._static_rollout_reason = None  # why rollouts take TRL's path whatever the prompts (None: they do not)
        self._said_paths = False
        super().__init__(*args, **kwargs)  # options= (or the deprecated fast_kernels=) go to the kernels mixin

    # -- set-up and restore, with the mixin's patch
    def _patch_fast_kernels(self) -> None:
        super()._patch_fast_kernels()  # (re)writes fast_kernels_summary when it patches
        log_probs = self._install_log_probs()
        if self._static_rollout_reason is None and not self._said_paths:
            self._static_rollout_reason = self._rollout_reason_now()
        rollouts = self._static_rollout_reason
        lines = "\n  rollouts: " + (
            f"TRL's own generation ({rollouts})"
            if rollouts
            else "fastplug fast_generate (static KV cache, CUDA graphs, live unmerged adapters)"
        )
        lines += "\n  per-token log-probs: " + (
            f"TRL's own ({log_probs})" if log_probs else "fastplug's fused LM head (no [B, T, V] logits)"
        )
        if lines not in self.fast_kernels_summary:
            self.fast_kernels_summary += lines
        if not self._said_paths:
            self._said_paths = True
            for what, reason in (("rollouts", rollouts), ("log-probs", log_probs)):
                if reason:
                    self._say_once(what, reason)

    def restore_fast_kernels(self) -> None:
        for undo in reversed(self._undo_log_probs):  # ours wraps the patched forward: off first
            undo()
        self._undo_log_probs, self._log_prob_models = [], set()
        super().restore_fast_kernels()

    def _install_log_probs(self) -> str | None:
        """Install the fused log-prob forward on the policy (and a separate reference model); the reason when not."""
        if not self.fast_log_probs:
            return "fast_log_probs=False"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "parameters sharded by DeepSpeed or FSDP"
        fp32_head = bool(getattr(self.args, "cast_lm_head_to_fp32", False))
        models = [self.model] + ([self.ref_model] if getattr(self, "ref_model", None) is not None else [])
        for model in models:
            reason = log_probs_reason(self.accelerator.unwrap_model(model), fp32_head)
            if reason:
                return reason
        if not self._undo_log_probs:
            for model in models:
                base = unwrap(self.accelerator.unwrap_model(model))
                self._undo_log_probs.append(install_log_probs_forward(base))
                self._log_prob_models.add(id(base))
        return None

    def _say_once(self, what: str, reason: str) -> None:
        if what in self._said:
            return
        self._said.add(what)
        warnings.warn(f"fastplug {type(self).__name__}: {what} take TRL's own path: {reason}", stacklevel=3)

    # -- rollouts
    def _rollout_reason_now(self) -> str | None:
        if not self.fast_generation:
            return "fast_generation=False"
        if getattr(self, "use_vllm", False):
            return "use_vllm=True"
        if getattr(self, "use_transformers_continuous_batching", False):
            return "use_transformers_continuous_batching=True"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "parameters sharded by DeepSpeed or FSDP"
        reason = unsupported_reason(self.accelerator.unwrap_model(self.model))
        if reason:
            return reason
        unsupported = unsupported_generation(getattr(self, "generation_config", None))
        if unsupported:
            return "generation settings fast_generate lacks: " + ", ".join(unsupported)
        return None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        reason = self._static_rollout_reason
        if reason is None and (images is not None or multimodal_fields or kwargs.get("has_tool_images")):
            reason = "multimodal prompts"
        if reason is not None:
            self._say_once("rollouts", reason)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        with profiling_context(self, "fastplug.fast_generate"):
            completion_ids = self._fast_rollouts(prompt_ids)
        # GRPO's rollout also returns the sampling log-probs (None off vLLM); RLOO's only the completions
        return (completion_ids, None) if self._ROLLOUT_RETURNS_LOGPROBS else completion_ids

    def _eos_ids(self, model) -> list[int]:
        """The ids generation stops at: TRL's generation config's, else the model's (as generate() merges them)."""
        eos = self.generation_config.eos_token_id
        if eos is None:
            eos = unwrap(model).generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def _fast_rollouts(self, prompt_ids) -> list[list[int]]:
        device = self.accelerator.device
        pad = self._tokenizer.pad_token_id
        width = max(len(ids) for ids in prompt_ids)
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompt_ids):  # left padding, as TRL pads for generate()
            if len(prompt):
                ids[row, width - len(prompt) :] = torch.as_tensor(prompt)
                mask[row, width - len(prompt) :] = 1
        model = self.accelerator.unwrap_model(self.model)
        config = self.generation_config
        try:
            out = fast_generate(
                model,
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=config.max_new_tokens,
                generation_config=config,
                eos_token_id=self._eos_ids(model),
                pad_token_id=pad,
            )
        finally:
            if self.release_generation_memory:
                release(model)
        completions = out[:, width:]
        # TRL's cut: everything after the first EOS goes (TRL 1.7 knows the tokenizer's EOS only)
        eos = getattr(self, "eos_token_ids", None) or [self._tokenizer.eos_token_id]
        is_eos = torch.isin(completions, torch.tensor(eos, device=completions.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1])
        keep = torch.arange(completions.shape[1], device=completions.device)[None] <= first[:, None]
        return [row[m].tolist() for row, m in zip(completions.cpu(), keep.cpu())]

    # -- per-token log-probs
    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        reason = None
        if compute_aux_loss:
            reason = "the MoE load-balancing loss is asked for"
        elif any(multimodal.get(name) is not None for name in _MULTIMODAL):
            reason = "multimodal inputs"
        elif id(unwrap(self.accelerator.unwrap_model(model))) not in self._log_prob_models:
            reason = "fast_log_probs=False" if not self.fast_log_probs else "a model fastplug did not set up"
        if reason is not None:
            if self._undo_log_probs or not self.fast_log_probs:  # else the summary said it at set-up
                self._say_once("log-probs", reason)
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        request = LogProbsRequest(
            logits_to_keep=logits_to_keep,
            temperature=self.temperature,
            entropy=compute_entropy,
            fp32_head=bool(getattr(self.args, "cast_lm_head_to_fp32", False)),
        )
        batch_size = batch_size or input_ids.size(0)  # TRL's chunks of rows, to bound the activations
        log_probs, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            with self.accelerator.autocast():
                lp, ent = model(
                    input_ids=input_ids[start : start + batch_size],
                    attention_mask=attention_mask[start : start + batch_size],
                    fastplug_log_probs=request,
                )
            log_probs.append(lp)
            entropies.append(ent)
        return torch.cat(log_probs), torch.cat(entropies) if compute_entropy else None, None


# class name -> (TRL's trainer class it extends, whether its _generate_single_turn returns the logprobs too)
TRAINERS = {"FastGRPOTrainer": ("GRPOTrainer", True), "FastRLOOTrainer": ("RLOOTrainer", False)}


def rl_trainer(name: str, kernels_mixin: type) -> type:
    """FastGRPOTrainer or FastRLOOTrainer: (FastRolloutsMixin, kernels_mixin, TRL's trainer). Built by
    fastplug.integrations.trl on first use, with its TRLFastKernelsMixin (this module does not import that one)."""
    base_name, returns_logprobs = TRAINERS[name]
    base = getattr(trl, base_name)
    doc = (
        f"TRL's {base.__name__} with fast rollouts, fused per-token log-probs and fastplug's kernels; takes the same "
        "arguments and `options`, `fast_generation`, `fast_log_probs`, `release_generation_memory` "
        "(fastplug.integrations.grpo.FastRolloutsMixin)."
    )
    namespace = {"__doc__": doc, "__module__": kernels_mixin.__module__, "_ROLLOUT_RETURNS_LOGPROBS": returns_logprobs}
    return type(name, (FastRolloutsMixin, kernels_mixin, base), namespace)
