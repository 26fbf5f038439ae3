"""The blocks' forward and backward (`_project` / `_project_grads` for projections of one input, `_mlp` /
`_mlp_grads` for the MLP), shared by the eager autograd nodes here (`_SharedInputLoRA`, `_LoRAMLP`) and the
registered operators of `ops`."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from .._utils import keep_for_backward, kept_for_backward, no_autocast, rows_view
from ..activations import glu_backward, glu_forward
from ..rope import rope_projections
from .casts import _cast_params, _group_adapters, adapters_cacheable
from .maths import _dy_b, _forward, _forward_stacked, _grads_stacked, _input_grad, _param_grads
from .projections import _adapters, _flatten, _unflatten, _weight_shape


def _side_by_side(dys, outs: list, rotary=None, joined=None) -> torch.Tensor:
    """[N, sum out_i]: the grads of the stacked outputs in one buffer (rotary (cos, sin, batch, head_dim): the
    first two rotated back on the way, as the forward rotated q and k in place). joined: those grads already
    side by side in one tensor (the registered operator's), used as it is when nothing is rotated."""
    if rotary is None and joined is not None:
        return joined
    dy = dys[0].new_empty((dys[0].shape[0], sum(outs)))
    if rotary is None:
        return torch.cat(dys, dim=1, out=dy)
    cols = dy.split(outs, dim=1)
    rope_projections(dys[0], dys[1], *rotary, backward=True, out=cols[:2])
    for col, g in zip(cols[2:], dys[2:]):
        col.copy_(g)
    return dy


class _Projected(NamedTuple):
    """What the forward of projections of one input leaves for their backward."""

    ys: list  # per projection [N, out_i]; column blocks of `y` when there is one
    y: torch.Tensor | None  # [N, sum out_i]: stacked, or joined for the registered operator
    xa: torch.Tensor | None  # [N, R]
    adapters: object  # _StackedAdapters (stacked) or _Adapters / None
    projs: list  # the projections in the compute dtype
    originals: list | None  # as passed (stacked: they key the stacked adapters)


def _project(x, x2, scalings, params, stacked, rotary, joined: bool = False) -> _Projected:
    """Forward of projections of one input (shared by the autograd node and the registered operator).
    rotary: None or (cos, sin, head_dim): q and k rotated in place. joined: dense bases write their outputs
    side by side into one buffer."""
    originals = _unflatten(params, scalings) if stacked is not None else None
    cache = adapters_cacheable(x)
    projs = _unflatten(_cast_params(params, x.dtype, cache), scalings)
    outs = [_weight_shape(p.weight)[0] for p in projs]
    y = None
    with no_autocast(x):
        adapters = _group_adapters(originals, projs, stacked, x.dtype, cache)
        if stacked is not None:
            y, xa = _forward_stacked(x2, stacked, adapters, projs)
            ys = list(y.split(outs, dim=1))
        else:
            y = x2.new_empty((x2.shape[0], sum(outs))) if joined else None
            ys, xa = _forward(x2, projs, adapters, out=None if y is None else y.split(outs, dim=1))
    if rotary is not None:  # q and k are this node's own buffers: no second copy of them
        ys[0], ys[1] = rope_projections(ys[0], ys[1], *rotary[:2], x.shape[0], rotary[2], inplace=True)
    return _Projected(ys, y, xa, adapters, projs, originals)


def _project_grads(dys, x2, fwd: _Projected, stacked, rotary, need_x: bool, needs, joined=None):
    """(dX [N, in] or None, grads in _flatten's order) of `_project`. rotary: None or (cos, sin, batch,
    head_dim). joined: dys side by side in one tensor, when the caller has them so."""
    projs, adapters = fwd.projs, fwd.adapters
    with no_autocast(x2):
        if stacked is not None:
            dy = _side_by_side(dys, [_weight_shape(p.weight)[0] for p in projs], rotary, joined)
            return _grads_stacked(dy, x2, fwd.xa, stacked, adapters, fwd.originals, needs, need_x)
        if rotary is not None:  # the gradients of the rotated q, k, rotated back
            dys[0], dys[1] = rope_projections(dys[0], dys[1], *rotary, backward=True)
        dyb = _dy_b(dys, projs, adapters)
        dx = _input_grad(dys, projs, adapters, dyb) if need_x else None
        return dx, _param_grads(x2, fwd.xa, dys, dyb, projs, adapters, needs)


class _SharedInputLoRA(torch.autograd.Function):
    """Projections of one input (a LoRA linear, or q/k/v), one autograd node."""

    @staticmethod
    def forward(ctx, x, scalings, rotary, stacked, *params):
        """rotary: None, or (cos, sin, head_dim) to rotate the first two outputs (q, k) in place.
        stacked: None, or the projections' StackedBase (one GEMM for all bases)."""
        x2 = rows_view(x)
        fwd = _project(x, x2, scalings, params, stacked, rotary)
        ctx.x_shape, ctx.stacked = x.shape, stacked
        ctx.head_dim = rotary[2] if rotary is not None else None
        # a_cat is small and derived from the params: kept with them (a cat of several is not a param)
        ctx.fwd = fwd._replace(ys=None, y=None, xa=None, projs=None)
        ctx.scalings = scalings
        cast = _flatten(fwd.projs)
        keep_for_backward(ctx, (*cast, *rotary[:2]) if rotary is not None else cast)
        ctx.save_for_backward(x2, fwd.xa)
        lead = tuple(x.shape[:-1])
        return tuple(y.view(*lead, y.shape[-1]) for y in fwd.ys)

    @staticmethod
    def backward(ctx, *grad_outputs):
        x2, xa = ctx.saved_tensors
        kept = kept_for_backward(ctx)
        n = len(ctx.scalings)
        fwd = ctx.fwd._replace(xa=xa, projs=_unflatten(kept[: 4 * n], ctx.scalings))
        dys = [g.reshape(-1, g.shape[-1]) for g in grad_outputs]
        rotary = (*kept[4 * n :], ctx.x_shape[0], ctx.head_dim) if ctx.head_dim else None
        dx, grads = _project_grads(dys, x2, fwd, ctx.stacked, rotary, ctx.needs_input_grad[0], ctx.needs_input_grad[4:])
        return (None if dx is None else dx.view(ctx.x_shape), None, None, None, *grads)


class _MLPForward(NamedTuple):
    """What the MLP's forward leaves for its backward."""

    y: torch.Tensor  # [N, out]
    gate_up: torch.Tensor | None  # [N, 2I]: gate and up side by side (stacked or joined), else None
    gate: torch.Tensor
    up: torch.Tensor
    xa_gu: torch.Tensor | None
    xa_down: torch.Tensor | None
    adapters: tuple  # (gate/up adapters, down adapters)
    projs: list  # gate, up, down in the compute dtype
    originals: list | None  # gate and up as passed (stacked: they key the stacked adapters)


def _mlp(x, x2, activation, scalings, params, stacked, joined: bool = False) -> _MLPForward:
    """Forward of down(act(gate(x)) * up(x)) (shared by the autograd node and the registered operator).
    joined: gate and up (dense) written side by side into one buffer."""
    originals = _unflatten(params, scalings)[:2] if stacked is not None else None
    cache = adapters_cacheable(x)
    gate_p, up_p, down_p = projs = _unflatten(_cast_params(params, x.dtype, cache), scalings)
    down_adapters = _adapters([down_p])
    width = _weight_shape(gate_p.weight)[0]
    with no_autocast(x):
        gu_adapters = _group_adapters(originals, [gate_p, up_p], stacked, x.dtype, cache)
        if stacked is not None:
            gate_up, xa_gu = _forward_stacked(x2, stacked, gu_adapters, [gate_p, up_p])
            gate, up = gate_up.split(width, dim=1)
        else:
            gate_up = x2.new_empty((x2.shape[0], 2 * width)) if joined else None
            blocks = None if gate_up is None else gate_up.split(width, dim=1)
            (gate, up), xa_gu = _forward(x2, [gate_p, up_p], gu_adapters, out=blocks)
        h = glu_forward(gate, up, activation)
        (y,), xa_down = _forward(h, [down_p], down_adapters)
    return _MLPForward(y, gate_up, gate, up, xa_gu, xa_down, (gu_adapters, down_adapters), projs, originals)


def _mlp_grads(dy, x2, fwd: _MLPForward, stacked, activation, need_x: bool, needs, into=None):
    """(dX or None, grads in _flatten's order) of `_mlp`. into: None to write dgate and dup over gate and up
    (buffers the caller owns and will not read again), else a fresh [N, 2I] buffer for them side by side."""
    gate_p, up_p, down_p = fwd.projs
    gu_adapters, down_adapters = fwd.adapters
    gate, up = fwd.gate, fwd.up
    with no_autocast(x2):
        # grad_h = dY W_down + s (dY B_down) A_down, in a buffer of our own...
        dyb_down = _dy_b([dy], [down_p], down_adapters)
        grad_h = _input_grad([dy], [down_p], down_adapters, dyb_down)
        # ...which glu_backward overwrites with h; dgate and dup go over gate and up, or into `into`.
        joined = fwd.gate_up if into is None else into
        out = (grad_h, gate, up) if into is None else (grad_h, *into.split(gate.shape[1], dim=1))
        h, dgate, dup = glu_backward(grad_h, gate, up, activation, recompute_h=True, out=out)
        if into is None:  # kernel writes bypass autograd: a second backward (retain_graph) must fail
            increment_version((gate, up) if fwd.gate_up is None else (fwd.gate_up,))
        down_grads = _param_grads(h, fwd.xa_down, [dy], dyb_down, [down_p], down_adapters, needs[8:])
        del h, grad_h
        if stacked is not None:  # dgate and dup lie side by side
            dx, gu_grads = _grads_stacked(joined, x2, fwd.xa_gu, stacked, gu_adapters, fwd.originals, needs[:8], need_x)
        else:
            dgu = [dgate, dup]
            dyb_gu = _dy_b(dgu, [gate_p, up_p], gu_adapters)
            dx = _input_grad(dgu, [gate_p, up_p], gu_adapters, dyb_gu) if need_x else None
            gu_grads = _param_grads(x2, fwd.xa_gu, dgu, dyb_gu, [gate_p, up_p], gu_adapters, needs[:8])
    return dx, [*gu_grads, *down_grads]


class _LoRAMLP(torch.autograd.Function):
    """down(act(gate(x)) * up(x)), one autograd node; saves x, gate and up, recomputes the activation."""

    @staticmethod
    def forward(ctx, x, activation, scalings, stacked, *params):
        """stacked: None, or gate and up's StackedBase (one GEMM for both)."""
        x2 = rows_view(x)
        fwd = _mlp(x, x2, activation, scalings, params, stacked)
        ctx.activation, ctx.scalings, ctx.x_shape, ctx.stacked = activation, scalings, x.shape, stacked
        ctx.fwd = fwd._replace(y=None, gate_up=None, gate=None, up=None, xa_gu=None, xa_down=None, projs=None)
        keep_for_backward(ctx, _flatten(fwd.projs))
        # gate and up are this function's own buffers (side by side when stacked): backward overwrites them
        # with dgate and dup.
        gu = (fwd.gate_up, None) if stacked is not None else (fwd.gate, fwd.up)
        ctx.save_for_backward(x2, *gu, fwd.xa_gu, fwd.xa_down)
        # rows [N, out], the function's own buffer: a view of it made here could not be written in place by the
        # caller (Llama 4 adds the routed experts into its shared expert's output); the caller reshapes it
        return fwd.y

    @staticmethod
    def backward(ctx, grad_y):
        x2, gate, up, xa_gu, xa_down = ctx.saved_tensors
        gate_up = None
        if ctx.stacked is not None:
            gate_up = gate
            gate, up = gate_up.split(gate_up.shape[1] // 2, dim=1)
        fwd = ctx.fwd._replace(
            gate_up=gate_up,
            gate=gate,
            up=up,
            xa_gu=xa_gu,
            xa_down=xa_down,
            projs=_unflatten(kept_for_backward(ctx), ctx.scalings),
        )
        dy = grad_y.reshape(-1, grad_y.shape[-1])
        dx, grads = _mlp_grads(
            dy, x2, fwd, ctx.stacked, ctx.activation, ctx.needs_input_grad[0], ctx.needs_input_grad[4:]
        )
        return (None if dx is None else dx.view(ctx.x_shape), None, None, None, *grads)
