"""fast_generate: batched decoding with a static KV cache, sampling on the device and the UNMERGED LoRA
adapters a model is training, for evaluation and RL rollouts.

How it is fast:
- the KV cache is allocated once per (batch bucket, length bucket) and kept on the model between calls; a
  sliding-window layer keeps only its last `window` columns, as a ring (Gemma2/3: half the cache or less);
- the decoder runs as a plan built from the model's own weights (no transformers forward, no mask
  builders, no cache objects): on CUDA one decode step is captured in a CUDA graph and replayed, with the
  position, cache slot, stop flags and output buffer living on the device;
- the host syncs only to check for EOS, every `_EOS_CHECK_EVERY` tokens; rows that finished keep decoding
  pad tokens (as transformers' generate does) until every row is done;
- LoRA stays unmerged: y = x W^T + s (x A^T) B^T reads the adapter tensors themselves (or compute-dtype
  copies refreshed at each call), so what generates is what is being trained;
- QLoRA: a bitsandbytes 4-bit base (NF4/FP4) is read packed, never run as a bitsandbytes module: the decode
  kernels' GEMV decodes it in its weight tiles (the per-op step: `gemv_4bit`), the prompt dequantizes it once;
- sampling (temperature, top-k, top-p) draws its noise from a counter-based hash of (seed, step, index):
  no RNG state inside the graph, and a seeded call gives the same tokens with or without a graph.

Supports the families fastplug patches (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Mixtral, Qwen2/3-MoE):
softcaps, sliding windows (a ring of the last `window` columns per windowed layer), q/k norms, scaled
embeddings; MoE blocks run through the model's own (or fastplug's patched) block.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import decode as decode_kernels
from .kernels._utils import interpreter_enabled
from .kernels.activations import geglu, swiglu
from .kernels.norms import rms_norm, rms_norm_reference
from .kernels.quant import gemv_4bit, is_4bit, shape_4bit, unpack
from .kernels.rope import rope, rope_reference
from .models.families import SUPPORTED_FAMILIES, family_of
from .models.lm_head import _head_forward as _patched_head_forward
from .models.mlp import activation_name
from .models.peft_lora import lora_projection
from .models.structure import unwrap

_EOS_CHECK_EVERY = 16  # decode steps between host checks of "has every row finished"
_BATCH_BUCKETS = (1, 2, 4, 8, 16)  # batch sizes a cache (and graph) is built for; larger: multiples of 16
_LENGTH_BUCKET = 256  # cache lengths are rounded up to a multiple of this, so graphs survive new prompt lengths
_EAGER_WARMUP_STEPS = 2  # real decode steps run eagerly before capture (compiles Triton kernels, cuBLAS init)
_MAX_EOS = 8  # EOS ids one call may stop on
# the decode step through fastplug.kernels.decode (~5 launches per layer) where the model allows it; False: the
# per-op path (projections through cuBLAS, ~21 launches per layer), kept for comparisons and the other cases
FAST_DECODE = True
_FAST_DECODE_ON_CPU = False  # tests: run the decode kernels under the Triton interpreter on CPU tensors
_UNSET = object()
_GLU = {"silu": swiglu, "gelu_tanh": functools.partial(geglu, approximate="tanh"),
        "gelu": functools.partial(geglu, approximate="none")}
# model -> its _Decoder. Kept beside the model, not on it: deepcopy (TRL's reference model) and pickling
# must not copy caches and CUDA graphs; the decoder holds the model's submodules, never the model itself,
# so the entry goes when the model does.
_DECODERS: "weakref.WeakKeyDictionary[nn.Module, _Decoder]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------------------- the plan
def _tensor_key(t: torch.Tensor | None):
    # the storage too: model.to(...) keeps the Parameter objects but moves their data, which a graph reads
    return None if t is None else (id(t), t.data_ptr(), t.dtype)


def _view_4bit(module: nn.Module):
    """The fused view of a bitsandbytes 4-bit base (alone or under peft's LoRA), else None; its weight is the
    packed Params4bit (other formats that `quantized=True` accepts, FP8, keep running as modules)."""
    view = lora_projection(module, quantized=True)
    return view if view is not None and is_4bit(view.weight) else None


class _Proj:
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
        self.key = (*map(_tensor_key, view[:4]), view.scaling)
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
        return unpack(self.weight).dtype if self.packed else self.weight.dtype  # bnb's CPU repack changes quant_state.dtype

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


def _apply_norm(norm, x: torch.Tensor) -> torch.Tensor:
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
            self.gate, self.up, self.down = _Proj(mlp.gate_proj), _Proj(mlp.up_proj), _Proj(mlp.down_proj)
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


@dataclass
class _Layer:
    input_norm: tuple
    post_attn_norm: tuple | None  # Gemma2/3: norm of the attention output before the residual add
    ff_norm: tuple
    post_ff_norm: tuple | None
    q: _Proj
    k: _Proj
    v: _Proj
    o: _Proj
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
        return [n for n in (self.input_norm, self.post_attn_norm, self.ff_norm, self.post_ff_norm, self.q_norm,
                            self.k_norm) if n is not None]

    @property
    def projs(self):
        return (self.q, self.k, self.v, self.o, *self.mlp.projs)


class _Plan:
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
        offset = family.rms_norm_offset
        self.embed = decoder.embed_tokens
        # Gemma scales embeddings by sqrt(hidden): in the embedding module (recent transformers) or in the
        # model's forward (earlier ones)
        self.embed_scale = None
        if family.name.startswith("gemma") and not hasattr(self.embed, "embed_scale"):
            # a tensor made once: a captured graph cannot copy a Python number to the device
            self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=self.embed.weight.dtype,
                                            device=self.embed.weight.device)
        self.rotary = decoder.rotary_emb
        self.rotary_takes_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.rotary_local = getattr(decoder, "rotary_emb_local", None)
        self.final_norm = _norm_of(decoder.norm, offset)
        head = base.get_output_embeddings()
        self.lm_head = _Proj(head)
        self.vocab = head.weight.shape[0]
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.layers = [self._layer(layer, family, offset) for layer in decoder.layers]
        norms = [self.final_norm] + [n for lp in self.layers for n in lp.norms]
        self.key = (
            self.lm_head.key, _tensor_key(self.embed.weight), tuple(_tensor_key(n[0]) for n in norms),
            tuple((*(p.key for p in lp.projs), lp.mlp.key) for lp in self.layers),
        )
        self.weight = self.embed.weight

    def _layer(self, layer: nn.Module, family, offset: float) -> _Layer:
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
        return _Layer(
            input_norm=_norm_of(layer.input_layernorm, offset),
            post_attn_norm=_norm_of(layer.post_attention_layernorm, offset) if sandwich else None,
            ff_norm=_norm_of(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, offset),
            post_ff_norm=_norm_of(layer.post_feedforward_layernorm, offset) if sandwich else None,
            q=_Proj(attn.q_proj), k=_Proj(attn.k_proj), v=_Proj(attn.v_proj), o=_Proj(attn.o_proj),
            q_norm=_norm_of(getattr(attn, "q_norm", None), offset),
            k_norm=_norm_of(getattr(attn, "k_norm", None), offset),
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
            scaling=float(attn.scaling), softcap=extra.get("softcap"), window=extra.get("sliding_window"),
            rope_key=rope_key, mlp=_MLP(layer.mlp),
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


class _FastLayer:
    """One layer's operands for the decode kernels: weights grouped by the input they read."""

    def __init__(self, lp: _Layer):
        self.qkv = _group((lp.q, lp.k, lp.v))
        self.o = _group((lp.o,))
        self.gate_up = _group((lp.mlp.gate, lp.mlp.up))
        self.down = _group((lp.mlp.down,))
        self.act = activation_name(lp.mlp.act)
        self.qk_norm = None
        if lp.q_norm is not None:
            self.qk_norm = (lp.q_norm[0], lp.k_norm[0], lp.q_norm[1], lp.q_norm[2])


def _group(projs):
    """(weights, biases or None, lora A's, (B's, scalings) or None) of projections that read one input."""
    weights = [p.weight for p in projs]
    biases = [p.bias for p in projs]
    if all(b is None for b in biases):
        biases = None
    elif any(b is None for b in biases):  # some with a bias: zeros for the others (a plan rebuild renews them)
        given = next(b for b in biases if b is not None)
        biases = [torch.zeros(p.out_features, dtype=given.dtype, device=given.device) if b is None else b
                  for b, p in zip(biases, projs)]
    if all(p.lora_A is None for p in projs):
        return weights, biases, None, None
    a = [p.lora_A for p in projs if p.lora_A is not None]
    return weights, biases, a, ([p.lora_B for p in projs], [p.scaling for p in projs])


def _fast_decode_reason(plan: _Plan) -> str | None:
    """Why the decode kernels cannot run this plan (None: they can)."""
    dtype = plan.weight.dtype
    rope_type = str(getattr(plan.rotary, "rope_type", "default"))
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"RoPE type {rope_type} depends on the sequence length"
    for i, lp in enumerate(plan.layers):
        projs = [_head_proj(plan), *lp.projs]
        if lp.mlp.module is not None:
            return f"layer {i}: MoE block"
        if activation_name(lp.mlp.act) not in ("silu", "gelu_tanh", "gelu"):
            return f"layer {i}: activation {type(lp.mlp.act).__name__}"
        if (lp.q_norm is None) != (lp.k_norm is None) or lp.head_dim % 2:
            return f"layer {i}: attention layout"
        for p in projs:
            if p.module is not None:
                return f"layer {i}: {type(p.module).__name__} runs as a module"
            if not p.packed and (p.weight.dtype != dtype or p.weight.stride(-1) != 1):
                return f"layer {i}: a weight of another dtype or layout"
            if p.bias is not None and p.bias.dtype != dtype:
                return f"layer {i}: a bias of another dtype"
            if p.lora_A is not None and (p.lora_A.dtype != dtype or not p.lora_A.is_contiguous()
                                         or not p.lora_B.is_contiguous()):
                return f"layer {i}: adapters of another dtype or layout"
        # a launch reads one input's weights: all dense, or all 4-bit of one format
        for group in ((lp.q, lp.k, lp.v), (lp.o,), (lp.mlp.gate, lp.mlp.up), (lp.mlp.down,)):
            reason = decode_kernels.packed_reason([p.weight for p in group])
            if reason:
                return f"layer {i}: {reason}"
    return None


def _head_proj(plan: _Plan) -> _Proj:
    """The LM head as a projection the decode kernels can read: fastplug's patched head (nn.Linear's forward
    without a fused loss) counts as the plain Linear it wraps."""
    p = plan.lm_head
    module = p.module
    bound = module.__dict__.get("forward") if module is not None else None
    if (isinstance(module, nn.Linear) and getattr(bound, "__func__", None) is _patched_head_forward
            and not module._forward_hooks and not module._forward_pre_hooks):
        p = _Proj.__new__(_Proj)
        p.module, p.weight, p.bias, p.lora_A, p.lora_B, p.scaling, p._sources, p.packed = (
            None, module.weight, module.bias, None, None, 0.0, (), False)
        p.key = ("head", _tensor_key(module.weight), _tensor_key(module.bias))
    return p


class _FastDecode:
    """The decode step (one token per row, at most `decode_kernels.MAX_ROWS` rows) through the decode kernels."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.layers = [_FastLayer(lp) for lp in plan.layers]
        self.head = _group((_head_proj(plan),))

    @staticmethod
    def _project(x, group, **kw):
        weights, biases, a, lora = group
        xa = decode_kernels.gemv(x, a, norm=kw.get("norm")) if a is not None else None
        return decode_kernels.gemv(x, weights, biases=biases, lora=None if a is None else (xa, *lora), **kw)

    def logits(self, s: "_Session") -> torch.Tensor:
        plan = self.plan
        b = s.tok.shape[0]
        h = plan.embed(s.tok).view(b, -1)
        if plan.embed_scale is not None:
            h = h * plan.embed_scale
        for index, (lp, fl) in enumerate(zip(plan.layers, self.layers)):
            qkv = self._project(h, fl.qkv, norm=lp.input_norm)
            cos, sin = s.rope[lp.rope_key]
            ring = s.k[index].shape[2] < s.length
            attn = decode_kernels.decode_attention(
                qkv, s.k[index], s.v[index], s.valid, s.slot, s.pos, cos, sin, heads=lp.heads, scaling=lp.scaling,
                softcap=lp.softcap, window=lp.window, ring=ring, qk_norm=fl.qk_norm)
            if lp.post_attn_norm is None:
                self._project(attn, fl.o, residual=h, out=h)
            else:
                decode_kernels.add_rms_norm(h, self._project(attn, fl.o), lp.post_attn_norm)
            hidden = self._project(h, fl.gate_up, norm=lp.ff_norm, activation=fl.act)
            if lp.post_ff_norm is None:
                self._project(hidden, fl.down, residual=h, out=h)
            else:
                decode_kernels.add_rms_norm(h, self._project(hidden, fl.down), lp.post_ff_norm)
        return self._project(h, self.head, norm=plan.final_norm, out_dtype=torch.float32, softcap=plan.final_softcap)

    def rope_tables(self, s: "_Session") -> dict:
        """cos, sin [cache length, head_dim] per rotary embedding, from the model's own rotary modules."""
        plan = self.plan
        w = plan.weight
        positions = torch.arange(s.length, device=w.device)[None]
        probe = torch.zeros(1, s.length, 1, device=w.device, dtype=w.dtype)
        tables = {}
        for key, (cos, sin) in plan.rotary_embeddings(probe, positions).items():
            tables[key] = (cos.reshape(s.length, -1).contiguous(), sin.reshape(s.length, -1).contiguous())
        return tables


# ------------------------------------------------------------------------------------ per-batch state
class _Session:
    """Static buffers for one (batch bucket, cache length): the KV cache and the decode state, all on the
    device, so a captured decode step reads and advances them by itself."""

    def __init__(self, plan: _Plan, batch: int, length: int, vocab: int):
        w = plan.weight
        device, dtype = w.device, w.dtype
        self.batch, self.length = batch, length
        # windowed layers keep a ring of their last `window` columns (column c at c % window)
        self.k = [torch.zeros(batch, lp.kv_heads, _cache_length(lp.window, length), lp.head_dim, device=device,
                              dtype=dtype) for lp in plan.layers]
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
        self.eos = torch.full((_MAX_EOS,), -1, **longs)  # fixed size: a graph keeps reading the same buffer
        self.pad = torch.zeros((), **longs)
        self.seed = torch.zeros((), **longs)
        self.temperature = torch.ones((), device=device, dtype=torch.float32)
        self.top_p = torch.ones((), device=device, dtype=torch.float32)
        self.noise_index = torch.arange(batch * vocab, **longs).view(batch, vocab)
        self.graphs: dict = {}  # (do_sample, top_k, uses top_p) -> CUDAGraph
        self.rope: dict | None = None  # the decode kernels' RoPE tables, made at the first prefill


def _cache_length(window: int | None, length: int) -> int:
    """Cache columns of a layer: a window shorter than the session's length is all it ever reads."""
    return window if window is not None and window < length else length


@dataclass(frozen=True)
class _Sampling:
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float


# ---------------------------------------------------------------------------------- the decoder itself
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


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplies; logical shifts by masking)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


class _Decoder:
    def __init__(self, plan: _Plan):
        self.plan = plan
        self.sessions: dict[tuple[int, int], _Session] = {}
        self.graph_failure: str | None = None  # why capture failed once (then this model decodes eagerly)
        self.fast_reason = _fast_decode_reason(plan)  # why the decode kernels cannot run it (None: they can)
        self.fast = _FastDecode(plan) if self.fast_reason is None else None

    def uses_fast(self, s: _Session) -> bool:
        """Whether this session's decode steps run through the decode kernels."""
        if self.fast is None or not FAST_DECODE or s.batch > decode_kernels.MAX_ROWS:
            return False
        return s.tok.is_cuda or (_FAST_DECODE_ON_CPU and interpreter_enabled())

    # -- the model
    def forward(self, s: _Session, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
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
            x = self._attention(lp, _apply_norm(lp.input_norm, h), rotary[lp.rope_key], s, index, *views[lp.window])
            h = h + _apply_norm(lp.post_attn_norm, x)
            h = h + _apply_norm(lp.post_ff_norm, lp.mlp(_apply_norm(lp.ff_norm, h)))
        logits = plan.lm_head(_apply_norm(plan.final_norm, h[:, -1:]))
        if plan.final_softcap is not None:
            logits = torch.tanh(logits / plan.final_softcap) * plan.final_softcap
        return logits[:, -1].float()

    @classmethod
    def _cache_view(cls, s: _Session, t: int, window: int | None, dtype) -> tuple:
        """(additive mask [B, 1, T, keys], the cache column a decode step writes: a [1] device tensor)."""
        allowed = cls._mask(s, t, window)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        length = _cache_length(window, s.length)
        return bias, (s.slot % length if length < s.length else s.slot)

    @staticmethod
    def _mask(s: _Session, t: int, window: int | None) -> torch.Tensor:
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
    def _attention(lp: _Layer, x, cos_sin, s: _Session, index: int, bias, write: torch.Tensor):
        b, t, _ = x.shape
        q = lp.q(x).view(b, t, lp.heads, lp.head_dim)
        k = lp.k(x).view(b, t, lp.kv_heads, lp.head_dim)
        v = lp.v(x).view(b, t, lp.kv_heads, lp.head_dim).transpose(1, 2)
        q, k = _apply_norm(lp.q_norm, q), _apply_norm(lp.k_norm, k)
        q, k = _rope(q.transpose(1, 2), k.transpose(1, 2), *cos_sin)
        k_cache, v_cache = s.k[index], s.v[index]
        if t == 1:
            k_cache.index_copy_(2, write, k)
            v_cache.index_copy_(2, write, v)
            keys, values = k_cache, v_cache
        else:  # the prompt attends over its own keys; the cache keeps what later tokens can see of them
            length = k_cache.shape[2]
            kept = s.columns[max(0, t - length):t]
            k_cache.index_copy_(2, kept % length, k[:, :, -len(kept):])
            v_cache.index_copy_(2, kept % length, v[:, :, -len(kept):])
            keys, values = k, v
        out = _attend(q, keys, values, bias, lp.scaling, lp.softcap)
        return lp.o(out.transpose(1, 2).reshape(b, t, -1))

    # -- choosing and recording tokens
    @staticmethod
    def _choose(logits: torch.Tensor, s: _Session, sampling: _Sampling) -> torch.Tensor:
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

    def _emit(self, logits: torch.Tensor, s: _Session, sampling: _Sampling) -> None:
        token = torch.where(s.finished, s.pad, self._choose(logits, s, sampling))
        newly = ~s.finished & (token[:, None] == s.eos).any(-1)
        s.done_at.copy_(torch.where(newly, s.count, s.done_at))
        s.finished.logical_or_(newly)
        s.out.index_copy_(1, s.count, token[:, None])
        s.tok.copy_(token[:, None])
        s.count.add_(1)

    def step(self, s: _Session, sampling: _Sampling) -> None:
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
            decode_kernels.greedy_emit(logits, s.finished, s.done_at, s.count, s.eos, s.pad, s.out, s.tok, s.pos)
            s.counters.add_(1)


    # -- a whole call
    def session(self, batch: int, length: int) -> _Session:
        """The cache for this batch bucket: the one in hand when it is long enough (its graphs too)."""
        for (held_batch, held_length), held in self.sessions.items():
            if held_batch == batch and held_length >= length:
                return held
        self.sessions.clear()  # one cache at a time: free the previous one's memory first
        self.sessions[(batch, length)] = _Session(self.plan, batch, length, self.plan.vocab)
        return self.sessions[(batch, length)]

    def prefill(self, s: _Session, ids, mask, real_rows: int, sampling: _Sampling, eos, pad: int, seed: int):
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
        s.count.zero_()
        if s.rope is None and self.uses_fast(s):
            s.rope = self.fast.rope_tables(s)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # left padding: positions count real tokens
        self._emit(self.forward(s, ids, pos), s, sampling)
        s.pos.copy_(mask.sum(-1, keepdim=True))
        s.slot.fill_(t)

    def _capture(self, s: _Session, sampling: _Sampling, key):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step(s, sampling)
        except Exception as error:  # an op that syncs or allocates on the host: decode eagerly instead
            self.graph_failure = f"{type(error).__name__}: {error}".splitlines()[0]
            warnings.warn(f"fast_generate: CUDA graph capture failed, decoding eagerly ({self.graph_failure})",
                          stacklevel=4)
            return None
        s.graphs[key] = graph
        return graph

    def decode(self, s: _Session, sampling: _Sampling, steps: int, streamer, cuda_graph: bool) -> int:
        """Runs up to `steps` decode steps after the prefill; returns how many tokens each row now has."""
        # a graph holds the step it captured: decode kernels or per-op (FAST_DECODE may change between calls)
        key = (sampling.do_sample, sampling.top_k, sampling.top_p < 1.0, self.uses_fast(s))
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


def _decoder(model: nn.Module) -> _Decoder:
    """The model's decoder, rebuilt when its adapters changed (added, swapped, disabled, merged)."""
    base = unwrap(model)
    plan = _Plan(model)
    decoder = _DECODERS.get(base)
    if decoder is None or decoder.plan.key != plan.key:
        plan.refresh()  # the adapters' compute-dtype copies exist before the decode kernels' plan takes them
        decoder = _Decoder(plan)
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


def _sampling_of(config, do_sample, temperature, top_k, top_p) -> _Sampling:
    def pick(value, name, default):
        if value is not None:
            return value
        from_config = getattr(config, name, None) if config is not None else None
        return default if from_config is None else from_config

    sampling = _Sampling(
        do_sample=bool(pick(do_sample, "do_sample", False)),
        temperature=float(pick(temperature, "temperature", 1.0)),
        top_k=pick(top_k, "top_k", 0),
        top_p=float(pick(top_p, "top_p", 1.0)),
    )
    if not sampling.do_sample:  # greedy: the other settings do not matter (nor split the captured graphs)
        return _Sampling(False, 1.0, 0, 1.0)
    if not sampling.temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling; got {sampling.temperature}")
    if not isinstance(sampling.top_k, int) or sampling.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off); got {sampling.top_k!r}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1]; got {sampling.top_p}")
    return sampling


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
        raise ValueError("attention_mask must be 0/1 with LEFT padding (zeros before ones, every row ending in a "
                         "token); use tokenizer.padding_side = 'left' for generation")
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
    eos_token_id=_UNSET,
    pad_token_id=_UNSET,
    streamer=None,
    max_seq_length: int | None = None,
    cuda_graph: bool = True,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` tokens per row; returns [batch, prompt + generated] like
    transformers' `generate` (rows that stopped early are filled with `pad_token_id`).

    `input_ids` [batch, prompt] with LEFT padding (`attention_mask` zeros first). Sampling settings come from
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
    sampling = _sampling_of(config, do_sample, temperature, top_k, top_p)
    eos = _as_ids(getattr(config, "eos_token_id", None) if eos_token_id is _UNSET else eos_token_id, "eos_token_id")
    if len(eos) > _MAX_EOS:
        raise ValueError(f"at most {_MAX_EOS} eos_token_id values; got {len(eos)}")
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
