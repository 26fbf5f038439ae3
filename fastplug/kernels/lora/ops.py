"""The registered operators torch.compile traces for dense bases: `fastplug::lora_projections`,
`fastplug::lora_mlp` and their backward, which run the forward and backward of `functions`, opaque to the
compiler (the cast cache and the stacked adapters are Python-side state). Outputs that lie side by side in one
buffer come out as that buffer (an operator's outputs may not alias each other); the traced wrapper splits it.
The bases are stacked when their weights already lie as row blocks of one matrix (patching stacks them before
anything compiles); grads come in the parameters' dtypes."""

from __future__ import annotations

import torch

from .._utils import rows_view
from ..fp8 import is_fp8
from ..quant import is_4bit
from .casts import _cast_params, _group_adapters, adapters_cacheable
from .functions import _mlp, _mlp_grads, _MLPForward, _project, _project_grads, _Projected
from .projections import StackedBase, _adapters, _unflatten, is_stacked


def _pack(params) -> tuple[list, list]:
    """(the present tensors, which of the slots hold one): a Tensor[] argument takes no None entries."""
    return [t for t in params if t is not None], [t is not None for t in params]


def _unpack(tensors, present) -> list:
    it = iter(tensors)
    return [next(it) if here else None for here in present]


def _rows_ahead(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """t extended to `rows` rows along its storage (t's strides), or None when the storage is shorter."""
    end = (
        t.storage_offset() + (rows - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1) + 1
        if t.dim() == 2
        else t.storage_offset() + rows
    )
    if end * t.element_size() > t.untyped_storage().nbytes():
        return None
    return t.as_strided((rows, *t.shape[1:]), t.stride())


def _stacked_in_memory(projs, dtype: torch.dtype) -> StackedBase | None:
    """The StackedBase the projections' frozen dense weights (biases) form where they lie, or None."""
    weights, biases = [p.weight for p in projs], [p.bias for p in projs]
    first = weights[0]
    if (
        len(projs) < 2
        or first.dtype != dtype
        or first.dim() != 2
        or all(p.lora_A is None for p in projs)
        or any(w.requires_grad or is_4bit(w) or is_fp8(w) for w in weights)
    ):
        return None
    rows = sum(w.shape[0] for w in weights)
    weight = _rows_ahead(first, rows)
    bias = None if biases[0] is None else _rows_ahead(biases[0], rows)
    if weight is None or (biases[0] is not None and bias is None):
        return None
    candidate = StackedBase(weight, bias)
    return candidate if is_stacked(candidate, weights, biases) else None


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((like.shape[0], 0)) if t is None else t


def _grads_out(grads, params, x: torch.Tensor) -> list:
    """Grads in their parameters' dtypes, contiguous, an empty tensor for None, each in a storage of its own."""
    out, seen = [], set()
    for g, p in zip(grads, params):
        if g is None:
            out.append(x.new_empty(0))
            continue
        # contiguous, as the fake implementation says (Inductor checks); blocks of the stacked adapters' grads
        # are small
        g = g.to(p.dtype).contiguous()
        key = g.untyped_storage().data_ptr()
        if key in seen:  # row blocks of one buffer are contiguous too
            g = g.clone()
        seen.add(key)
        out.append(g)
    return out


def _op_needs(x: torch.Tensor, tensors) -> list:
    """Which inputs of a registered LoRA operator take grads: x first, then the packed tensors."""
    return [x.requires_grad] + [t.requires_grad for t in tensors]


def _op_grads(grads, needs) -> tuple:
    """(dx, [grads of the packed tensors]) from a backward operator's outputs, None where not needed."""
    grads = [g if need else None for g, need in zip(grads, needs)]
    return grads[0], grads[1:]


def _param_needs(needs, present) -> list[bool]:
    """Which unpacked parameters (in _flatten's order, absent ones included) take grads."""
    return [bool(n) for n in _unpack(needs[1:], present)]


def _backward_op_out(dx, grads, present, x, tensors) -> list:
    """A backward operator's output: dx, then the grads of the packed (present) tensors, via `_grads_out`."""
    grads = [g for g, here in zip(grads, present) if here]
    return _grads_out([None if dx is None else dx.view(x.shape), *grads], [x, *tensors], x)


def _fake_grads(x, tensors, needs) -> list:
    return [x.new_empty(x.shape) if needs[0] else x.new_empty(0)] + [
        torch.empty_like(p) if need else x.new_empty(0) for p, need in zip(tensors, needs[1:])
    ]


def _rotary_args(cos, sin, head_dim):
    return None if cos is None else (cos, sin, head_dim)


@torch.library.custom_op(
    "fastplug::lora_projections",
    mutates_args=(),
    schema="(Tensor x, Tensor[] tensors, bool[] present, float[] scalings, Tensor? cos, Tensor? sin, int head_dim) "
    "-> (Tensor, Tensor)",
)
def _projections_op(x, tensors, present, scalings, cos, sin, head_dim):
    """(y [N, sum out_i] with q and k rotated when cos is given, xa [N, R]); params packed by `_pack`."""
    params = _unpack(tensors, present)
    projs = _unflatten(params, scalings)
    fwd = _project(
        x,
        rows_view(x),
        scalings,
        params,
        _stacked_in_memory(projs, x.dtype),
        _rotary_args(cos, sin, head_dim),
        joined=True,
    )
    return fwd.y, _or_empty(fwd.xa, fwd.y)


@_projections_op.register_fake
def _(x, tensors, present, scalings, cos, sin, head_dim):
    params = _unpack(tensors, present)
    rows = x.numel() // x.shape[-1]
    outs = sum(params[i].shape[0] for i in range(0, len(params), 4))
    rank = sum(a.shape[0] for a in params[2::4] if a is not None)
    return x.new_empty((rows, outs)), x.new_empty((rows, rank))


@torch.library.custom_op(
    "fastplug::lora_projections_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor xa, Tensor[] tensors, bool[] present, float[] scalings, Tensor? cos, "
    "Tensor? sin, int head_dim, bool[] needs) -> Tensor[]",
)
def _projections_backward_op(dy, x, xa, tensors, present, scalings, cos, sin, head_dim, needs):
    """[dx, grads of the packed tensors]; an empty tensor where needs (x first, then tensors) is False."""
    params = _unpack(tensors, present)
    projs = _unflatten(params, scalings)
    stacked = _stacked_in_memory(projs, x.dtype)
    cache = adapters_cacheable(x)
    cast = _unflatten(_cast_params(params, x.dtype, cache), scalings)
    adapters = _group_adapters(projs, cast, stacked, x.dtype, cache)
    fwd = _Projected(None, None, xa if xa.shape[1] else None, adapters, cast, projs)
    rotary = None if cos is None else (cos, sin, x.shape[0], head_dim)
    dys = list(dy.split([p.weight.shape[0] for p in projs], dim=1))
    dx, grads = _project_grads(
        dys, rows_view(x), fwd, stacked, rotary, needs[0], _param_needs(needs, present), joined=dy
    )
    return _backward_op_out(dx, grads, present, x, tensors)


@_projections_backward_op.register_fake
def _(dy, x, xa, tensors, present, scalings, cos, sin, head_dim, needs):
    return _fake_grads(x, tensors, needs)


def _setup_projections(ctx, inputs, output):
    x, tensors, present, scalings, cos, sin, head_dim = inputs
    ctx.save_for_backward(x, output[1], cos, sin, *tensors)
    ctx.present, ctx.scalings, ctx.head_dim = present, scalings, head_dim
    ctx.needs = _op_needs(x, tensors)


def _projections_op_backward(ctx, dy, _dxa):
    x, xa, cos, sin, *tensors = ctx.saved_tensors
    grads = _projections_backward_op(dy, x, xa, tensors, ctx.present, ctx.scalings, cos, sin, ctx.head_dim, ctx.needs)
    return *_op_grads(grads, ctx.needs), None, None, None, None, None


_projections_op.register_autograd(_projections_op_backward, setup_context=_setup_projections)


@torch.library.custom_op(
    "fastplug::lora_mlp",
    mutates_args=(),
    schema="(Tensor x, Tensor[] tensors, bool[] present, float[] scalings, str activation) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _mlp_op(x, tensors, present, scalings, activation):
    """(y [N, out], gate_up [N, 2I], xa of gate/up, xa of down); params packed by `_pack`."""
    params = _unpack(tensors, present)
    projs = _unflatten(params, scalings)
    fwd = _mlp(x, rows_view(x), activation, scalings, params, _stacked_in_memory(projs[:2], x.dtype), joined=True)
    return fwd.y, fwd.gate_up, _or_empty(fwd.xa_gu, fwd.y), _or_empty(fwd.xa_down, fwd.y)


@_mlp_op.register_fake
def _(x, tensors, present, scalings, activation):
    params = _unpack(tensors, present)
    rows = x.numel() // x.shape[-1]
    width, out = params[0].shape[0], params[8].shape[0]
    rank_gu = sum(a.shape[0] for a in (params[2], params[6]) if a is not None)
    rank_down = params[10].shape[0] if params[10] is not None else 0
    return (
        x.new_empty((rows, out)),
        x.new_empty((rows, 2 * width)),
        x.new_empty((rows, rank_gu)),
        x.new_empty((rows, rank_down)),
    )


@torch.library.custom_op(
    "fastplug::lora_mlp_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor gate_up, Tensor xa_gu, Tensor xa_down, Tensor[] tensors, bool[] present, "
    "float[] scalings, str activation, bool[] needs) -> Tensor[]",
)
def _mlp_backward_op(dy, x, gate_up, xa_gu, xa_down, tensors, present, scalings, activation, needs):
    """[dx, grads of the packed tensors]; dgate and dup go into a new buffer (gate_up is the graph's, not ours)."""
    params = _unpack(tensors, present)
    projs = _unflatten(params, scalings)
    stacked = _stacked_in_memory(projs[:2], x.dtype)
    cache = adapters_cacheable(x)
    cast = _unflatten(_cast_params(params, x.dtype, cache), scalings)
    adapters = (_group_adapters(projs[:2], cast[:2], stacked, x.dtype, cache), _adapters(cast[2:]))
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=1)
    fwd = _MLPForward(
        None,
        gate_up,
        gate,
        up,
        xa_gu if xa_gu.shape[1] else None,
        xa_down if xa_down.shape[1] else None,
        adapters,
        cast,
        projs[:2],
    )
    dx, grads = _mlp_grads(
        dy.reshape(-1, dy.shape[-1]),
        rows_view(x),
        fwd,
        stacked,
        activation,
        needs[0],
        _param_needs(needs, present),
        into=torch.empty_like(gate_up),
    )
    return _backward_op_out(dx, grads, present, x, tensors)


@_mlp_backward_op.register_fake
def _(dy, x, gate_up, xa_gu, xa_down, tensors, present, scalings, activation, needs):
    return _fake_grads(x, tensors, needs)


def _setup_mlp(ctx, inputs, output):
    x, tensors, present, scalings, activation = inputs
    ctx.save_for_backward(x, *output[1:], *tensors)
    ctx.present, ctx.scalings, ctx.activation = present, scalings, activation
    ctx.needs = _op_needs(x, tensors)


def _mlp_op_backward(ctx, dy, *_):
    x, gate_up, xa_gu, xa_down, *tensors = ctx.saved_tensors
    grads = _mlp_backward_op(
        dy, x, gate_up, xa_gu, xa_down, tensors, ctx.present, ctx.scalings, ctx.activation, ctx.needs
    )
    return *_op_grads(grads, ctx.needs), None, None, None


_mlp_op.register_autograd(_mlp_op_backward, setup_context=_setup_mlp)
