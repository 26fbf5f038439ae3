"""The decode step through fastplug.kernels.decode (about 5 launches per layer): a plan's weights grouped by
the input they read (q/k/v, o, gate/up, down, the LM head), and why a plan cannot take this path (then the
decoder runs the per-op step of decoder.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import decode as decode_kernels
from ..models.lm_head import _head_forward as _patched_head_forward
from ..models.mlp import activation_name
from .plan import LayerPlan, Plan, Proj, tensor_key


class _FastLayer:
    """One layer's operands for the decode kernels: weights grouped by the input they read."""

    def __init__(self, lp: LayerPlan):
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
        biases = [
            torch.zeros(p.out_features, dtype=given.dtype, device=given.device) if b is None else b
            for b, p in zip(biases, projs)
        ]
    if all(p.lora_A is None for p in projs):
        return weights, biases, None, None
    a = [p.lora_A for p in projs if p.lora_A is not None]
    return weights, biases, a, ([p.lora_B for p in projs], [p.scaling for p in projs])


def fast_decode_reason(plan: Plan) -> str | None:
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
            if p.lora_A is not None and (
                p.lora_A.dtype != dtype or not p.lora_A.is_contiguous() or not p.lora_B.is_contiguous()
            ):
                return f"layer {i}: adapters of another dtype or layout"
        # a launch reads one input's weights: all dense, or all 4-bit of one format
        for group in ((lp.q, lp.k, lp.v), (lp.o,), (lp.mlp.gate, lp.mlp.up), (lp.mlp.down,)):
            reason = decode_kernels.packed_reason([p.weight for p in group])
            if reason:
                return f"layer {i}: {reason}"
    return None


def _head_proj(plan: Plan) -> Proj:
    """The LM head as a projection the decode kernels can read: fastplug's patched head (nn.Linear's forward
    without a fused loss) counts as the plain Linear it wraps."""
    p = plan.lm_head
    module = p.module
    bound = module.__dict__.get("forward") if module is not None else None
    if (
        isinstance(module, nn.Linear)
        and getattr(bound, "__func__", None) is _patched_head_forward
        and not module._forward_hooks
        and not module._forward_pre_hooks
    ):
        p = Proj.__new__(Proj)
        p.module, p.weight, p.bias, p.lora_A, p.lora_B, p.scaling, p._sources, p.packed = (
            None,
            module.weight,
            module.bias,
            None,
            None,
            0.0,
            (),
            False,
        )
        p.key = ("head", tensor_key(module.weight), tensor_key(module.bias))
    return p


class FastDecode:
    """The decode step (one token per row, at most `decode_kernels.MAX_ROWS` rows) through the decode kernels;
    its methods read and advance a decoder.Session `s`."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.layers = [_FastLayer(lp) for lp in plan.layers]
        self.head = _group((_head_proj(plan),))

    @staticmethod
    def _project(x, group, **kw):
        weights, biases, a, lora = group
        xa = decode_kernels.gemv(x, a, norm=kw.get("norm")) if a is not None else None
        return decode_kernels.gemv(x, weights, biases=biases, lora=None if a is None else (xa, *lora), **kw)

    def logits(self, s) -> torch.Tensor:
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
                qkv,
                s.k[index],
                s.v[index],
                s.valid,
                s.slot,
                s.pos,
                cos,
                sin,
                heads=lp.heads,
                scaling=lp.scaling,
                softcap=lp.softcap,
                window=lp.window,
                ring=ring,
                qk_norm=fl.qk_norm,
            )
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

    def rope_tables(self, s) -> dict:
        """cos, sin [cache length, head_dim] per rotary embedding, from the model's own rotary modules."""
        plan = self.plan
        w = plan.weight
        positions = torch.arange(s.length, device=w.device)[None]
        probe = torch.zeros(1, s.length, 1, device=w.device, dtype=w.dtype)
        tables = {}
        for key, (cos, sin) in plan.rotary_embeddings(probe, positions).items():
            tables[key] = (cos.reshape(s.length, -1).contiguous(), sin.reshape(s.length, -1).contiguous())
        return tables
