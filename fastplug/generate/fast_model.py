"""FastModel: the model path users start from. Load a causal LM patched for fast fine-tuning, add LoRA with
defaults that keep the fused paths, switch between training and inference, generate with `fast_generate`.

    model, tokenizer = FastModel.from_pretrained("path/or/hub-name", max_seq_length=4096)
    model = FastModel.get_peft_model(model, r=16)
    ... train with Trainer / TRL / Lightning ...
    FastModel.for_inference(model)
    out = model.fast_generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=256)
"""

from __future__ import annotations

import numbers
import types
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..models.structure import unwrap
from ..options import KernelOptions, check_checkpointing_mode
from ..patch import checkpointing
from ..patch.engine import active_handle, patch_model
from .api import fast_generate

# from_pretrained keyword arguments that the config and the tokenizer need too (where to find the files)
_SHARED_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "subfolder", "trust_remote_code")
_DTYPES = {
    "auto": "auto",
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
_MODE = "_fastplug_checkpointing"  # the checkpointing mode for_training() turns back on
_BUDGET = "_fastplug_memory_budget"  # the options' memory_budget, for "auto" once the patch was restored


def _dtype_of(dtype):
    if isinstance(dtype, torch.dtype) and dtype in (torch.bfloat16, torch.float16, torch.float32):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto', a float dtype or one of {sorted(_DTYPES)}; got {dtype!r}")


def _scale_rope(config, max_seq_length: int) -> None:
    """Linear RoPE scaling so positions up to max_seq_length fall in the range the model was trained on."""
    trained = getattr(config, "max_position_embeddings", None)
    if not trained or max_seq_length <= trained:
        return
    factor = max_seq_length / trained
    name = "rope_parameters" if isinstance(getattr(config, "rope_parameters", None), dict) else "rope_scaling"
    params = dict(getattr(config, name, None) or {})
    # Gemma3 keeps one dict per layer type: only the full-attention layers see the long range
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    targets = [nested["full_attention"]] if "full_attention" in nested else list(nested.values()) or [params]
    for target in targets:
        kind = target.get("rope_type", target.get("type", "default"))
        if kind != "default":
            warnings.warn(
                f"fastplug: max_seq_length {max_seq_length} exceeds max_position_embeddings {trained}, but the "
                f"config already scales RoPE ({kind!r}); left as it is",
                stacklevel=3,
            )
            return
        target.update(rope_type="linear", factor=factor)
        target.pop("type", None)
    setattr(config, name, params)
    config.max_position_embeddings = max_seq_length


def _tokenizer(name_or_path, model: nn.Module, shared: dict):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **shared)
    except (OSError, ValueError, TypeError) as error:
        tokenizer, reason = None, str(error)
    else:  # recent transformers build an empty tokenizer when the folder has no tokenizer files
        reason = "its tokenizer has an empty vocabulary" if not tokenizer.vocab_size else None
    if reason is not None:
        warnings.warn(f"fastplug: no tokenizer loaded from {name_or_path!r} ({reason}); returning None", stacklevel=3)
        return None
    if tokenizer.pad_token is None:  # batching needs one; the EOS (or UNK) token is the usual stand-in
        stand_in = tokenizer.eos_token or tokenizer.unk_token
        if stand_in is not None:
            tokenizer.pad_token = stand_in
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            model.resize_token_embeddings(len(tokenizer))
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def _attach_generate(model: nn.Module) -> None:
    # an instance attribute (not a class change): other models in the process are untouched
    vars(model)["fast_generate"] = types.MethodType(fast_generate, model)


class FastModel:
    """Namespace of the model-path functions; not instantiated."""

    def __init__(self):
        raise TypeError("FastModel is not instantiated: call FastModel.from_pretrained(...)")

    @staticmethod
    def from_pretrained(
        name_or_path,
        *,
        dtype="auto",
        max_seq_length: int | None = None,
        device_map=None,
        attn_implementation: str | None = None,
        options: KernelOptions | dict | None = None,
        load_in_4bit: bool = False,
        **hf_kwargs,
    ):
        """(model, tokenizer): a causal LM loaded with transformers' Auto classes, patched with `options`
        (a KernelOptions or a dict; every kernel on by default; gradient checkpointing per options), RoPE scaled
        linearly when `max_seq_length` exceeds the config's `max_position_embeddings`, and its tokenizer with a pad
        token (None, with a warning, when the path has no tokenizer). `model.fast_generate(...)` generates.
        Unknown families load and are patched by structure, with a warning. `load_in_4bit=True`: the QLoRA
        base (bitsandbytes NF4, double quantization, bf16 compute; needs `fastplug[qlora]`), whose LoRA
        layers then take the fused 4-bit path. A fine-grained FP8 checkpoint (transformers' FineGrainedFP8Config)
        is patched with fp8=True unless `options` is given: its FP8 layers run, LoRA fused, on fastplug's kernel."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(options, Mapping):
            options = KernelOptions.build(options)  # an unknown name raises before anything loads
        elif options is not None and not isinstance(options, KernelOptions):
            raise ValueError(f"options must be a fastplug.KernelOptions or a dict; got {type(options).__name__}")
        if max_seq_length is not None and (
            not isinstance(max_seq_length, numbers.Integral) or isinstance(max_seq_length, bool) or max_seq_length < 1
        ):
            raise ValueError(f"max_seq_length must be a positive int; got {max_seq_length!r}")
        torch_dtype = _dtype_of(dtype)
        shared = {k: hf_kwargs[k] for k in _SHARED_KWARGS if k in hf_kwargs}
        config = AutoConfig.from_pretrained(name_or_path, **shared)
        if type(config) not in AutoModelForCausalLM._model_mapping:
            raise ValueError(
                f"{name_or_path!r} is a {getattr(config, 'model_type', type(config).__name__)!r} model, which has "
                "no causal-LM class in transformers (FastModel loads AutoModelForCausalLM models)"
            )
        if max_seq_length is not None:
            _scale_rope(config, int(max_seq_length))
        load = dict(hf_kwargs, config=config, dtype=torch_dtype)
        if load_in_4bit:
            load["quantization_config"] = _nf4_config(hf_kwargs)
            if torch_dtype == "auto":
                load["dtype"] = torch.bfloat16  # the compute dtype of the 4-bit layers
        if device_map is not None:
            load["device_map"] = device_map
        if attn_implementation is not None:
            load["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **load)
        tokenizer = _tokenizer(name_or_path, model, shared)
        handle = patch_model(model, options if options is not None else _default_options(model))
        if max_seq_length is not None:
            vars(model)["_fastplug_max_seq_length"] = int(max_seq_length)
        vars(model)[_MODE] = handle.options.gradient_checkpointing
        vars(model)[_BUDGET] = handle.options.memory_budget
        _attach_generate(model)
        return model, tokenizer

    @staticmethod
    def get_peft_model(
        model: nn.Module,
        r: int = 16,
        target_modules="all-linear",
        lora_alpha: float = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing=True,
        random_state: int | None = None,
        **lora_kwargs,
    ):
        """peft's get_peft_model with defaults that keep fastplug's fused LoRA paths eligible (no dropout, no
        bias, no DoRA); warns about each choice that turns them off. `use_gradient_checkpointing`: True
        (non-reentrant), "offload" (layer inputs in pinned host memory), False, or "auto" (checkpoint only the
        layers GPU memory needs, as KernelOptions' "auto", under the memory_budget of the options the model was
        patched with). `random_state` seeds the adapters' initialisation."""
        from peft import LoraConfig, get_peft_model

        if type(model).__module__.startswith("peft"):
            raise ValueError("model already has peft adapters (a PeftModel); add adapters to the base model once")
        if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 1:
            raise ValueError(f"r must be a positive int; got {r!r}")
        if not isinstance(lora_alpha, numbers.Real) or lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be a positive number; got {lora_alpha!r}")
        if not isinstance(lora_dropout, numbers.Real) or not 0.0 <= lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1); got {lora_dropout!r}")
        if bias not in ("none", "all", "lora_only"):
            raise ValueError(f"bias must be 'none', 'all' or 'lora_only'; got {bias!r}")
        check_checkpointing_mode(use_gradient_checkpointing, "use_gradient_checkpointing")
        off = []
        if lora_dropout > 0:
            off.append(f"lora_dropout={lora_dropout}")
        if lora_kwargs.get("use_dora"):
            off.append("use_dora=True")
        if lora_kwargs.get("lora_bias"):
            off.append("lora_bias=True")
        if off:
            warnings.warn(
                f"fastplug: {', '.join(off)} turns the fused LoRA kernels off for these layers while training "
                "(peft's own path runs them); lora_dropout=0.0 without DoRA keeps them on",
                stacklevel=2,
            )
        config = LoraConfig(
            r=int(r),
            target_modules=target_modules,
            lora_alpha=lora_alpha,
            lora_dropout=float(lora_dropout),
            bias=bias,
            task_type=lora_kwargs.pop("task_type", "CAUSAL_LM"),
            **lora_kwargs,
        )
        if random_state is not None:
            torch.manual_seed(random_state)
        peft_model = get_peft_model(model, config)
        base = unwrap(peft_model)
        handle = active_handle(base)
        if handle is not None and handle.options.fp8:  # the bases are frozen only now: quantize them now
            handle.restore()
            patch_model(peft_model, handle.options)
        mode = use_gradient_checkpointing
        vars(base)[_MODE] = mode
        if mode:
            _enable_checkpointing(base, mode)
            if "_require_grads_hook" not in vars(base):  # frozen embeddings: checkpointed layers need grad inputs
                base.enable_input_require_grads()
        else:
            checkpointing.disable(base)
        if vars(base).get("fast_generate") is not None:
            _attach_generate(peft_model)
        return peft_model

    @staticmethod
    def for_inference(model: nn.Module) -> nn.Module:
        """Eval mode, KV cache on, gradient checkpointing off; the patches stay (for_training undoes it)."""
        base = unwrap(model)
        model.eval()
        checkpointing.disable(base)
        base.config.use_cache = True
        return model

    @staticmethod
    def for_training(model: nn.Module) -> nn.Module:
        """Train mode with gradient checkpointing as loaded / set by get_peft_model, KV cache off."""
        base = unwrap(model)
        mode = vars(base).get(_MODE)
        if mode is None:
            handle = active_handle(base)
            mode = handle.options.gradient_checkpointing if handle is not None else False
        model.train()
        if mode:
            _enable_checkpointing(base, mode)
        base.config.use_cache = False
        return model


def _default_options(model: nn.Module) -> KernelOptions:
    """fastplug's defaults; fp8 on for a model loaded from a fine-grained FP8 checkpoint."""
    config = getattr(model.config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return KernelOptions(fp8=method == "fp8")


def _nf4_config(hf_kwargs):
    from transformers import BitsAndBytesConfig

    from ..kernels.quant import require_bitsandbytes

    if "quantization_config" in hf_kwargs:
        raise ValueError("pass either load_in_4bit=True or a quantization_config, not both")
    require_bitsandbytes()
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip


def _enable_checkpointing(model: nn.Module, mode) -> None:
    # Through the patch's handle: it plans "auto" against its options' memory_budget (FastModel's mode has no
    # budget of its own) and its restore() undoes what is turned on here, the "auto" plan's hooks included.
    handle = active_handle(model)
    if handle is not None:
        handle.enable_checkpointing(mode)
    else:
        checkpointing.enable(model, mode, vars(model).get(_BUDGET, KernelOptions.memory_budget))
