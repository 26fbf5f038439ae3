"""The plan fast_generate runs: a model's decoder read from its own weights, one `Proj` per linear layer (base
weight, bias and the unmerged LoRA adapter, or a packed bitsandbytes 4-bit base), the norms as
(weight, eps, offset), the MLP, and per layer the attention's shapes, softcap, window and rotary table.

`Plan.key` changes when adapters are added, swapped, disabled or merged, or weights move; the decoder is then
rebuilt (and every CUDA graph captured from it)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.activations import geglu, swiglu
from ..kernels.norms import rms_norm, rms_norm_reference
from ..kernels.quant import gemv_4bit, is_4bit, shape_4bit, unpack
from ..models.families import SUPPORTED_FAMILIES, family_of
from ..models.mlp import activation_name
from ..models.peft_lora import lora_projection
from ..models.structure import other_towers, unwrap

_GLU = {
    "silu": swiglu,
    "gelu_tanh": functools.partial(geglu, approximate="tanh"),
    "gelu": functools.partial(geglu, approximate="none"),
}


def tensor_key(t: torch.Tensor | None):
    # the storage too: model.to(...) keeps the Parameter objects but moves their data, which a graph reads
    return None if t is None else (id(t), t.data_ptr(), t.dtype)


def _view_4bit(module: nn.Module):
    """The fused view of a bitsandbytes 4-bit base (alone or under peft's LoRA), else None; its weight is the
    packed Params4bit (other formats that `quantized=True` accepts, FP8, keep running as modules)."""
    view = lora_projection(module, quantized=True)
    return view if view is not None and is_4bit(view.weight) else None


class Proj:
    """One linear layer as it computes now: base weight (+ bias) and the unmerged adapter, or the module
    itself when fastplug cannot reproduce it (DoRA, several adapters, 8-bit and other quantized layers).
    A bitsandbytes 4-bit base (NF4/FP4) stays packed (`packed`): the per-op step's rows go through `gemv_4bit`
    (the decode kernels' GEMV decodes it itself), the prompt through its dequantized weight, all in the
    activations' dtype (as fastplug's QLoRA layers)."""

    def __init__(self, module: nn.Module):
        view = lora_projection(module)
        if view is None:
            view = _view_4bit(module)
        self.module = module if view is None else None
        self.weight = self.bias = self.lora_A = self.lora_B = None
        self.packed = False
        self.scaling = 0.0
        self._sources = ()
        if view is None:
            self.key = ("module", id(module))
            return
        self.weight, self.bias, self.scaling = view.weight, view.bias, view.scaling
        self.packed = is_4bit(view.weight)
        self.key = (*map(tensor_key, view[:4]), view.scaling)
        if view.lora_A is None:
            return
        dtype = self.dtype
        if view.lora_A.dtype == dtype and view.lora_B.dtype == dtype:
            self.lora_A, self.lora_B = view.lora_A, view.lora_B  # live: the trained values, always
        else:  # fp32 adapters on a bf16 base: compute-dtype copies, made and refreshed by refresh()
            self._sources = (view.lora_A, view.lora_B)

    def refresh(self) -> None:
        """Update the adapter copies in place (a captured graph keeps reading the same buffers)."""
        if not self._sources:
            return
        if self.lora_A is None:
            self.lora_A, self.lora_B = (torch.empty_like(t, dtype=self.dtype) for t in self._sources)
        self.lora_A.copy_(self._sources[0])
        self.lora_B.copy_(self._sources[1])

    @property
    def out_features(self) -> int:
        return shape_4bit(self.weight)[0] if self.packed else self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the projection computes in: the weight's, or the one a 4-bit weight was quantized from."""
        return (
            unpack(self.weight).dtype if self.packed else self.weight.dtype
        )  # bnb's CPU repack changes quant_state.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is not None:
            return self.module(x)
        if self.packed:  # gemv_4bit picks: its GEMV for a few rows, else one dequantization and a matmul
            y = gemv_4bit(x, self.weight)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora_A is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = torch.addmm(y.reshape(-1, y.shape[-1]), x2 @ self.lora_A.t(), self.lora_B.t(), alpha=self.scaling)
        return y2.view(y.shape)


def _norm_of(module: nn.Module | None, offset: float):
    if module is None:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None or getattr(module, "weight", None) is None:
        raise ValueError(f"fast_generate: {type(module).__name__} is not an RMSNorm with a weight and an eps")
    return (module.weight, float(eps), offset)


def apply_norm(norm, x: torch.Tensor) -> torch.Tensor:
    if norm is None:
        return x
    weight, eps, offset = norm
    # on CPU the torch maths (the Triton interpreter would be slow and adds nothing at decode sizes)
    return rms_norm(x, weight, eps, offset) if x.is_cuda else rms_norm_reference(x, weight, eps, offset)


class _MLP:
    def __init__(self, mlp: nn.Module):
        dense = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        self.module = None if dense else mlp  # MoE blocks: the model's (or fastplug's patched) block
        if dense:
            self.gate, self.up, self.down = Proj(mlp.gate_proj), Proj(mlp.up_proj), Proj(mlp.down_proj)
            self.act = mlp.act_fn
            self.glu = _GLU.get(activation_name(mlp.act_fn))
        self.projs = (self.gate, self.up, self.down) if dense else ()
        self.key = tuple(p.key for p in self.projs) if dense else ("module", id(mlp))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is not None:
            out = self.module(x)
            return out[0] if isinstance(out, tuple) else out  # some versions also return router logits
        gate, up = self.gate(x), self.up(x)
        # on CUDA the activation and the product are one kernel
        hidden = self.glu(gate, up) if self.glu is not None and x.is_cuda else self.act(gate) * up
        return self.down(hidden)


# The families whose layers generate/decoder.py reproduces, each tested against transformers' generate
# (tests/generate/test_generation.py). A Family entry alone says training patches apply, not that the decoder
# computes the family's layers: granite's multipliers and glm4's interleaved RoPE decoded wrong tokens silently.
DECODER_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe"}
)


def _check_decodable(base: nn.Module, decoder: nn.Module, family) -> None:
    """ValueError naming what the static-KV decoder cannot run: linear-attention layers (their convolution and
    recurrent states are no KV cache), output-gated attention (Qwen3.5, Qwen3-Next) and a vision-language model's
    generation (image features merged into the embeddings, multimodal RoPE positions)."""
    name = type(base).__name__
    layers = list(decoder.layers)
    linear = sum(hasattr(layer, "linear_attn") for layer in layers)
    if linear:
        raise ValueError(
            f"fast_generate: {name} has {linear} linear-attention (Gated DeltaNet) layers of {len(layers)}; its "
            "decoder keeps a static KV cache, not their convolution and recurrent states. Use model.generate "
            "(transformers' cache), which the patched model runs"
        )
    if family.attention_output_gate:
        raise ValueError(
            f"fast_generate: {name}'s attention gates its output (q_proj gives a gate per head), which its decoder "
            "does not run. Use model.generate (transformers' cache), which the patched model runs"
        )
    towers = other_towers(base)
    if towers:
        raise ValueError(
            f"fast_generate: {name} is a vision-language model ({', '.join(towers)} beside its language model); its "
            "generation merges image features into the embeddings and positions, which the decoder does not run. "
            "Use model.generate (transformers' cache), which the patched model runs"
        )


def _unreproduced_parts(decoder: nn.Module) -> list[str]:
    """What this decoder's layers compute that the plan's layer does not (Gemma 4's), by structure."""
    layers = list(decoder.layers)
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    found = {
        "per-layer inputs": bool(getattr(decoder, "hidden_size_per_layer_input", 0)),
        "keys and values shared between layers": any(getattr(a, "is_kv_shared_layer", False) for a in attns),
        "values that are the keys (no v_proj)": any(a is not None and getattr(a, "v_proj", 0) is None for a in attns),
        "a norm on the values": any(hasattr(a, "v_norm") for a in attns),
        "a scalar on each layer's output": any(hasattr(layer, "layer_scalar") for layer in layers),
        "an MoE block beside the MLP": any(hasattr(layer, "experts") and hasattr(layer, "mlp") for layer in layers),
    }
    return [part for part, present in found.items() if present]


@dataclass
class LayerPlan:
    input_norm: tuple
    post_attn_norm: tuple | None  # Gemma2/3: norm of the attention output before the residual add
    ff_norm: tuple
    post_ff_norm: tuple | None
    q: Proj
    k: Proj
    v: Proj
    o: Proj
    q_norm: tuple | None
    k_norm: tuple | None
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    softcap: float | None
    window: int | None
    rope_key: str | None  # Gemma3: which rotary embedding (layer type)
    mlp: _MLP

    @property
    def norms(self):
        return [
            n
            for n in (self.input_norm, self.post_attn_norm, self.ff_norm, self.post_ff_norm, self.q_norm, self.k_norm)
            if n is not None
        ]

    @property
    def projs(self):
        return (self.q, self.k, self.v, self.o, *self.mlp.projs)


class Plan:
    """The decoder of one model as fastplug runs it; `key` changes when adapters are added, swapped,
    disabled or merged, and then the plan (and every graph captured from it) is rebuilt."""

    def __init__(self, model: nn.Module):
        base = unwrap(model)
        family = family_of(base)
        if family is None:
            model_type = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
            raise ValueError(
                f"fast_generate supports the families {SUPPORTED_FAMILIES}; got model type {model_type!r} "
                "(use model.generate for it)"
            )
        config = base.config
        decoder = base.get_decoder()
        parts = _unreproduced_parts(decoder)
        if parts:
            raise ValueError(
                f"fast_generate: {type(base).__name__}'s layers have what its decoder does not run: "
                f"{', '.join(parts)}. Use model.generate (transformers' cache), which the patched model runs"
            )
        _check_decodable(base, decoder, family)  # what it can name precisely (linear attention, ...) first
        if family.name not in DECODER_FAMILIES:
            raise ValueError(
                f"fast_generate decodes the families {', '.join(sorted(DECODER_FAMILIES))}; model type "
                f"{family.name!r} is patched for training, but its layers differ from what the decoder runs (RoPE "
                "layout, sinks, multipliers, norms or fused projections). Use model.generate (the patched model)"
            )
        offset = family.rms_norm_offset
        self.embed = decoder.embed_tokens
        # Gemma scales embeddings by sqrt(hidden): in the embedding module (recent transformers) or in the
        # model's forward (earlier ones)
        self.embed_scale = None
        if family.name.startswith("gemma") and not hasattr(self.embed, "embed_scale"):
            # a tensor made once: a captured graph cannot copy a Python number to the device
            self.embed_scale = torch.tensor(
                config.hidden_size**0.5, dtype=self.embed.weight.dtype, device=self.embed.weight.device
            )
        self.rotary = decoder.rotary_emb
        self.rotary_takes_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.rotary_local = getattr(decoder, "rotary_emb_local", None)
        self.final_norm = _norm_of(decoder.norm, offset)
        head = base.get_output_embeddings()
        self.lm_head = Proj(head)
        self.vocab = head.weight.shape[0]
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.layers = [self._layer(layer, family, offset) for layer in decoder.layers]
        norms = [self.final_norm] + [n for lp in self.layers for n in lp.norms]
        self.key = (
            self.lm_head.key,
            tensor_key(self.embed.weight),
            tuple(tensor_key(n[0]) for n in norms),
            tuple((*(p.key for p in lp.projs), lp.mlp.key) for lp in self.layers),
        )
        self.weight = self.embed.weight

    def _layer(self, layer: nn.Module, family, offset: float) -> LayerPlan:
        attn = layer.self_attn
        missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling") if not hasattr(attn, n)]
        if missing:
            raise ValueError(f"fast_generate: {type(attn).__name__} has no {', '.join(missing)}")
        config = attn.config
        extra = family.attention_extra_kwargs(attn)
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        layer_type = getattr(attn, "layer_type", None)
        if self.rotary_takes_layer_type:
            rope_key = layer_type
        else:
            rope_key = "local" if self.rotary_local is not None and getattr(attn, "is_sliding", False) else None
        return LayerPlan(
            input_norm=_norm_of(layer.input_layernorm, offset),
            post_attn_norm=_norm_of(layer.post_attention_layernorm, offset) if sandwich else None,
            ff_norm=_norm_of(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, offset),
            post_ff_norm=_norm_of(layer.post_feedforward_layernorm, offset) if sandwich else None,
            q=Proj(attn.q_proj),
            k=Proj(attn.k_proj),
            v=Proj(attn.v_proj),
            o=Proj(attn.o_proj),
            q_norm=_norm_of(getattr(attn, "q_norm", None), offset),
            k_norm=_norm_of(getattr(attn, "k_norm", None), offset),
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim,
            scaling=float(attn.scaling),
            softcap=extra.get("softcap"),
            window=extra.get("sliding_window"),
            rope_key=rope_key,
            mlp=_MLP(layer.mlp),
        )

    def refresh(self) -> None:
        for p in (self.lm_head, *(p for lp in self.layers for p in lp.projs)):
            p.refresh()

    def rotary_embeddings(self, h: torch.Tensor, pos: torch.Tensor) -> dict:
        out = {}
        for key in {lp.rope_key for lp in self.layers}:
            if self.rotary_takes_layer_type:
                out[key] = self.rotary(h, pos, key)
            else:
                out[key] = (self.rotary_local if key == "local" else self.rotary)(h, pos)
        return out
