"""The public functions: `lora_linear`, `lora_projections`, `lora_qkv` and `lora_mlp` check their inputs and run
one autograd node (eager), or one registered operator while Dynamo traces dense bases."""

from __future__ import annotations

import torch

from .._utils import check_dtype, compute_dtype, promote_types, use_triton
from ..activations import ACTIVATIONS
from ..fp8 import is_fp8
from ..quant import is_4bit
from ..rope import rope
from .functions import _LoRAMLP, _SharedInputLoRA
from .ops import _mlp_op, _pack, _projections_op
from .projections import LoRAProjection, StackedBase, _check_projection, _check_stacked, _flatten, _weight_shape


def _checked_input(x: torch.Tensor) -> torch.Tensor:
    """x in the compute dtype (no dispatch when it already is); raises ValueError on a bad x."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError("x must be a tensor of shape [..., in]")
    check_dtype("x", x)
    dtype = compute_dtype(x)
    return x if x.dtype == dtype else x.to(dtype)


def _compiling_dense(projs) -> bool:
    """Whether Dynamo traces projections with dense bases: they then run as the registered operators (the
    autograd nodes keep Python-side state on ctx). Quantized bases keep the eager function (a graph break):
    their dequantization reads Python-side buffers."""
    return torch.compiler.is_compiling() and not any(is_4bit(p.weight) or is_fp8(p.weight) for p in projs)


def _registered_shared(x: torch.Tensor, projs, rotary) -> tuple:
    """`_launch_shared` under torch.compile: one registered operator, its joined output split into views."""
    in_node = rotary is not None and _rotary_in_node(x, rotary)
    cos, sin, head_dim = rotary if in_node else (None, None, 0)
    y, _ = _projections_op(x, *_pack(_flatten(projs)), [float(p.scaling) for p in projs], cos, sin, head_dim)
    lead = tuple(x.shape[:-1])
    ys = tuple(t.view(*lead, t.shape[-1]) for t in y.split([p.weight.shape[0] for p in projs], dim=1))
    return _rope_after(ys, rotary) if rotary is not None and not in_node else ys


def _rotary_in_node(x: torch.Tensor, rotary) -> bool:
    """Whether the QKV node can rotate q and k itself: [B, T, in] input, cos/sin that do not promote q's
    dtype (RoPE then keeps it: Llama's rotary tables come in the hidden states' dtype) and take no grads."""
    cos, sin, _ = rotary
    return (
        x.dim() == 3
        and cos.dtype == sin.dtype
        and promote_types(x.dtype, cos.dtype) == x.dtype
        and not (cos.requires_grad or sin.requires_grad)
        and use_triton(x, cos, sin)
    )


def _rope_after(ys: tuple, rotary) -> tuple:
    """RoPE on projection outputs (..., T, heads * head_dim) by the rope op, outputs in the same layout."""
    cos, sin, head_dim = rotary
    q, k = (y.view(*y.shape[:-1], -1, head_dim).transpose(-3, -2) for y in ys[:2])
    q, k = rope(q, k, cos, sin)
    return (*(t.transpose(-3, -2).reshape(*t.shape[:-3], t.shape[-2], -1) for t in (q, k)), *ys[2:])


def _usable_stacked(stacked, projs, x: torch.Tensor):
    """The StackedBase to run on, after checking it: None when there is none, when the weights are not in x's
    compute dtype (they would need a cast per projection anyway) or when no projection has an adapter."""
    if stacked is None:
        return None
    _check_stacked(stacked, projs, x)
    if (stacked.weight is not None and stacked.weight.dtype != x.dtype) or all(p.lora_A is None for p in projs):
        return None
    return stacked


def _launch_shared(x, named_projs: dict, rotary=None, stacked=None):
    x = _checked_input(x)
    for name, proj in named_projs.items():
        _check_projection(name, proj, x)
    projs = list(named_projs.values())
    stacked = _usable_stacked(stacked, projs, x)
    if _compiling_dense(projs):
        return _registered_shared(x, projs, rotary)
    in_node = rotary is not None and _rotary_in_node(x, rotary)
    ys = _SharedInputLoRA.apply(
        x, tuple(float(p.scaling) for p in projs), rotary if in_node else None, stacked, *_flatten(projs)
    )
    return _rope_after(ys, rotary) if rotary is not None and not in_node else ys


def lora_linear(x: torch.Tensor, proj: LoRAProjection) -> torch.Tensor:
    """y = x W^T + b + s * (x A^T) B^T for x [..., in]; one autograd node. A/B None: a plain linear."""
    (y,) = _launch_shared(x, {"proj": proj})
    return y


def lora_projections(x: torch.Tensor, *projs: LoRAProjection, stacked: StackedBase | None = None) -> tuple:
    """The outputs of any number of projections of one x [..., in] (Gemma 4's q and k where v is k); one node,
    as `lora_qkv` without RoPE. stacked: their frozen weights as one matrix (`StackedBase`)."""
    if not projs:
        raise ValueError("lora_projections needs at least one projection")
    return _launch_shared(x, {f"projs[{i}]": p for i, p in enumerate(projs)}, None, stacked)


def lora_qkv(
    x: torch.Tensor,
    q_proj: LoRAProjection,
    k_proj: LoRAProjection,
    v_proj: LoRAProjection,
    rotary: tuple | None = None,
    stacked: StackedBase | None = None,
):
    """(q, k, v) projections of one x [..., in] (GQA: k/v may be narrower, ranks may differ); one node.

    rotary (cos, sin, head_dim): q and k come out with RoPE applied (`fastplug.kernels.rope` maths, cos/sin
    as the model's rotary embedding returns them), in the projections' layout [..., heads * head_dim];
    for a [B, T, in] x the node rotates its own output buffers in place.
    stacked: the frozen q/k/v weights (biases) as one matrix (`StackedBase`): one GEMM for the three bases and
    one for the three adapters' B; q, k, v are then column blocks of one output buffer."""
    return _launch_shared(x, {"q_proj": q_proj, "k_proj": k_proj, "v_proj": v_proj}, rotary, stacked)


def lora_mlp(
    x: torch.Tensor,
    gate_proj: LoRAProjection,
    up_proj: LoRAProjection,
    down_proj: LoRAProjection,
    activation: str = "silu",
    stacked: StackedBase | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) for x [..., hidden]; activation one of ACTIVATIONS; one autograd node.
    stacked: the frozen gate and up weights (biases) as one matrix (`StackedBase`): one GEMM for both."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    x = _checked_input(x)
    _check_projection("gate_proj", gate_proj, x)
    intermediate = _weight_shape(gate_proj.weight)[0]
    _check_projection("up_proj", up_proj, x, out_features=intermediate)
    _check_projection("down_proj", down_proj, x, in_features=intermediate)
    projs = (gate_proj, up_proj, down_proj)
    stacked = _usable_stacked(stacked, projs[:2], x)
    if _compiling_dense(projs):
        y = _mlp_op(x, *_pack(_flatten(projs)), [float(p.scaling) for p in projs], activation)[0]
        return y.view(*x.shape[:-1], y.shape[-1])
    y = _LoRAMLP.apply(x, activation, tuple(float(p.scaling) for p in projs), stacked, *_flatten(projs))
    return y.view(*x.shape[:-1], y.shape[-1])
