"""The MoE expert MLP, out[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])) with e = index[t, j],
built on the grouped GEMMs, with optional LoRA on the expert weights and optional per-expert biases.

Forward: routing metadata (one launch) -> gate_up grouped GEMM gathering token rows on load, with the gated
activation in its epilogue (`grouped_mm_glu`; with LoRA on gate_up the rank-r term goes into the GEMM's
epilogue instead and `glu.glu_rows_forward` runs after it) -> down grouped GEMM storing each row at its
(token, slot) place times its routing weight -> one pass summing each token's k slots (`_sum_slots`).
LoRA on an expert weight W [E, out, in] is the rank-r grouped term s * (x A_e^T) B_e^T: a grouped GEMM to
[rows, r], added in the epilogue of the base GEMM. No E x out x in delta weight is ever formed.
The gated activation and the layout of gate_up's rows are a `glu.GluSpec` (silu/gelu GLUs on [gate; up] halves,
gpt-oss's clamped SwiGLU on interleaved rows); biases [E, 2I] / [E, H] are added in the GEMMs' epilogues, before the
routing weight, and their gradients are per-expert sums of the gradient rows (a grouped dW against a column of ones).
Weights stored transposed ([E, in, out], gpt-oss) are passed as their transposed views: the kernels read strides.

Two autograd paths:
- `MoEExperts`, one node, when the down projection is trained (full fine-tuning, LoRA on down_proj). Saved:
  x, the gate_up output and the [rows, r] LoRA inputs; h is recomputed by `glu.glu_rows_backward`, which also
  applies the routing weights to dgate/dup and computes their gradient <d(unweighted row), h> in one pass.
- `ExpertsUp` + `ExpertsDown` when down_proj (and its bias) is frozen without LoRA (LoRA on attention, or on gate_up
  only). ExpertsDown saves nothing through save_for_backward, so a non-reentrant checkpoint's recompute (early stop,
  torch's default) ends after ExpertsUp: the down GEMM and the combine are not recomputed (about 8% less
  device time a step at Mixtral widths: docs/benchmarks/kernels.md, "MoE", `python scripts/moe_gpu.py`).
Under torch.compile both run as the registered operator pair `fastplug::moe_experts` / `_backward` (the
MoEExperts maths; the split path's early stop is a property of eager checkpointing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._utils import (
    cdiv,
    check_dtype,
    check_same_device,
    check_shape,
    keep_for_backward,
    kept_for_backward,
    next_power_of_2,
    use_triton,
)
from .glu import GluSpec, glu_rows_backward, glu_rows_forward, glu_rows_reference, glu_spec
from .grouped_gemm import grouped_mm_dw, grouped_mm_glu, grouped_mm_rows
from .routing import routing_metadata


class ExpertLoRA(NamedTuple):
    """LoRA on one 3-D expert weight W [E, out, in]: W_e + scaling * B_e @ A_e."""

    A: torch.Tensor  # [E, r, in]
    B: torch.Tensor  # [E, out, r]
    scaling: float


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over j < TOP_K of y[t * TOP_K + j], in fp32 (the combine over a token's experts)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _sum_slots(y: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[T * k, H] rows in (token, slot) order -> [T, H]: one pass (torch's strided sum over the middle dim
    of a [T, k, H] view ran at a third of the memory bandwidth)."""
    if k == 1:
        return y
    H = y.shape[1]
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if T and H:
        block = min(1024, next_power_of_2(H))
        _sum_slots_kernel[(T, cdiv(H, block))](
            y, out, H, y.stride(0), out.stride(0), TOP_K=k, BLOCK_H=block, num_warps=4
        )
    return out


# ---------------------------------------------------------------------------------------------- autograd
def _t(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.transpose(1, 2)


def _gate_up_forward(x, gate_up, bias1, a1, b1, offsets, gather, glu: GluSpec, store_gu: bool):
    """(t1, gu, h): the gate_up GEMM over gathered token rows (plus its bias) and h = act(gate) * up. Without LoRA
    the activation runs in the GEMM's epilogue (gu is only written when the backward needs it); with LoRA the
    rank-r term goes into the GEMM's epilogue and the activation is a separate pass."""
    if a1 is None:
        gu, h = grouped_mm_glu(x, gate_up, offsets, glu, a_index=gather, store_gu=store_gu, bias=bias1)
        return None, gu, h
    t1 = grouped_mm_rows(x, a1, offsets, a_index=gather)
    gu = grouped_mm_rows(x, gate_up, offsets, a_index=gather, lora=(t1, b1), bias=bias1)
    return t1, gu, glu_rows_forward(gu, glu)


def _prepared(a, b, s):
    """peft's factors are strided views ([out, r * E] seen as [E, out, r]): a few MiB of contiguous copies keep
    the kernels' loads coalesced. B carries the scale (b = s B): the kernels then add the LoRA term into their
    accumulator, and in backward u = dy b already holds s for dA and dX."""
    if a is None:
        return None, None
    return a.contiguous(), (b * s if s != 1.0 else b).contiguous()


def _bias_grad(dy, offsets, E, bias, dy_index=None, row_weights=None):
    """Per-expert sums of the gradient rows [M, N] (gathered, weighted): a grouped dW against a column of ones."""
    ones = dy.new_ones((dy_index.shape[0] if dy_index is not None else dy.shape[0], 1))
    dw = grouped_mm_dw(dy, ones, offsets, E, dy_index=dy_index, row_weights=row_weights, dtype=bias.dtype)
    return dw.view(E, -1)


def _bias_rw_grad(g, bias, offsets, gather):
    """The routing weights' gradient from a down bias (fp32 [M]): each row's <g[token], bias[e]>, the bias read as a
    one-row weight of the grouped GEMM."""
    out = torch.empty((gather.shape[0], 1), dtype=torch.float32, device=g.device)
    return grouped_mm_rows(g, bias.to(g.dtype).unsqueeze(1), offsets, a_index=gather, out=out).view(-1)


def _experts_forward(x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, glu):
    """(out [T, H], what backward reads: gu, t1, t2, offsets, gather, scatter, rw); a/b already `_prepared`."""
    T = x.shape[0]
    E = gate_up.shape[0]
    k = top_k_index.shape[1]
    offsets, gather, scatter = routing_metadata(top_k_index, E)
    rw = top_k_weights.reshape(-1)[scatter.long()]
    t1, gu, h = _gate_up_forward(x, gate_up, bias1, a1, b1, offsets, gather, glu, True)
    t2 = grouped_mm_rows(h, a2, offsets) if a2 is not None else None
    lora2 = (t2, b2) if a2 is not None else None
    y = grouped_mm_rows(h, down, offsets, out_index=scatter, row_weights=rw, lora=lora2, bias=bias2)
    return _sum_slots(y, T, k), (gu, t1, t2, offsets, gather, scatter, rw)


def _experts_backward(g, x, saved, weights, scales, glu, k, weights_dtype, needs):
    """Grads of (x, top_k_weights, gate_up, down, a1, b1, a2, b2, bias1, bias2) (None where `needs` says no) from
    the output's gradient g; weights = (gate_up, down, a1, b1, a2, b2, bias1, bias2), a/b as `_prepared`, scales the
    LoRA scalings (s1, s2)."""
    gate_up, down, a1, b1, a2, b2, bias1, bias2 = weights
    gu, t1, t2, offsets, gather, scatter, rw = saved
    s1, s2 = scales
    E = gate_up.shape[0]
    T = x.shape[0]
    g = g.to(x.dtype)
    grads = [None] * 10

    # down projection: d(unweighted h) rows, read from the token gradients
    u2 = grouped_mm_rows(g, _t(b2), offsets, a_index=gather) if a2 is not None else None
    dh = grouped_mm_rows(g, _t(down), offsets, a_index=gather, lora=(u2, _t(a2)) if a2 is not None else None)
    dgu, h, drw = glu_rows_backward(dh, gu, rw, glu)
    if needs[1] and bias2 is not None:  # the routing weight multiplies the bias too
        drw += _bias_rw_grad(g, bias2, offsets, gather)
    if needs[3]:
        grads[3] = grouped_mm_dw(g, h, offsets, E, dy_index=gather, row_weights=rw, dtype=down.dtype)
    if needs[9]:
        grads[9] = _bias_grad(g, offsets, E, bias2, dy_index=gather, row_weights=rw)
    if a2 is not None:
        if needs[7]:
            grads[7] = grouped_mm_dw(g, t2, offsets, E, dy_index=gather, row_weights=rw, scale=s2, dtype=b2.dtype)
        if needs[6]:
            grads[6] = grouped_mm_dw(u2, h, offsets, E, row_weights=rw, dtype=a2.dtype)
    if needs[1]:
        dw = torch.zeros(scatter.shape[0], dtype=torch.float32, device=x.device)
        dw.index_copy_(0, scatter.long(), drw)
        grads[1] = dw.view(T, k).to(weights_dtype)

    # gate_up projection (dgu already carries the routing weights)
    grads[0], grads[2], grads[4], grads[5], grads[8] = _gate_up_backward(
        dgu, x, t1, gate_up, a1, b1, bias1, s1, offsets, gather, scatter, k, (needs[0], needs[2], *needs[4:6], needs[8])
    )
    return grads


def _gate_up_backward(dgu, x, t1, gate_up, a1, b1, bias1, s1, offsets, gather, scatter, k, needs):
    """Grads of (x, gate_up, a1, b1, bias1) from the weighted gradient rows dgu of the gate_up GEMM."""
    E = gate_up.shape[0]
    need_x, need_w, need_a1, need_b1, need_bias = needs
    dx = dw = da1 = db1 = dbias = None
    u1 = grouped_mm_rows(dgu, _t(b1), offsets) if a1 is not None else None
    if need_x:
        slots = grouped_mm_rows(
            dgu, _t(gate_up), offsets, out_index=scatter, lora=(u1, _t(a1)) if a1 is not None else None
        )
        dx = _sum_slots(slots, x.shape[0], k)
    if need_w:
        dw = grouped_mm_dw(dgu, x, offsets, E, x_index=gather, dtype=gate_up.dtype)
    if need_bias:
        dbias = _bias_grad(dgu, offsets, E, bias1)
    if a1 is not None:
        if need_b1:
            db1 = grouped_mm_dw(dgu, t1, offsets, E, scale=s1, dtype=b1.dtype)
        if need_a1:
            da1 = grouped_mm_dw(u1, x, offsets, E, x_index=gather, dtype=a1.dtype)
    return dx, dw, da1, db1, dbias


class MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, s1, s2, glu):
        (a1, b1), (a2, b2) = _prepared(a1, b1, s1), _prepared(a2, b2, s2)
        out, saved = _experts_forward(x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, glu)
        ctx.save_for_backward(x, *saved)
        keep_for_backward(ctx, (gate_up, down, a1, b1, a2, b2, bias1, bias2))
        ctx.scales, ctx.glu, ctx.k = (s1, s2), glu, top_k_index.shape[1]
        ctx.weights_dtype = top_k_weights.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = _experts_backward(
            grad_out,
            x,
            saved,
            kept_for_backward(ctx),
            ctx.scales,
            ctx.glu,
            ctx.k,
            ctx.weights_dtype,
            needs[:2] + needs[3:11],
        )
        # inputs: x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, s1, s2, glu
        return (*grads[:2], None, *grads[2:], None, None, None)


class ExpertsUp(torch.autograd.Function):
    """The first half of the split path: x -> h = act(gate) * up per grouped row (gate_up GEMM gathering
    token rows, LoRA term and bias in its epilogue, the gated activation). Its gradient input is d(unweighted h)
    from `ExpertsDown`, an internal convention of the pair: h reaches no one else."""

    @staticmethod
    def forward(ctx, x, rw, gate_up, a1, b1, bias1, s1, offsets, gather, scatter, glu, k, need_grad):
        a1, b1 = _prepared(a1, b1, s1)
        t1, gu, h = _gate_up_forward(x, gate_up, bias1, a1, b1, offsets, gather, glu, need_grad)
        ctx.save_for_backward(x, gu, t1, rw)
        keep_for_backward(ctx, (gate_up, a1, b1, bias1, offsets, gather, scatter))  # weights and routing metadata
        ctx.s1, ctx.glu, ctx.k = s1, glu, k
        return h

    @staticmethod
    def backward(ctx, dh):
        x, gu, t1, rw = ctx.saved_tensors
        gate_up, a1, b1, bias1, offsets, gather, scatter = kept_for_backward(ctx)
        needs = ctx.needs_input_grad
        dgu, _, drw = glu_rows_backward(dh, gu, rw, ctx.glu, store_h=False)
        dx, dw, da1, db1, dbias = _gate_up_backward(
            dgu, x, t1, gate_up, a1, b1, bias1, ctx.s1, offsets, gather, scatter, ctx.k, (*needs[:1], *needs[2:6])
        )
        drw = drw.to(rw.dtype) if needs[1] else None
        return dx, drw, dw, da1, db1, dbias, None, None, None, None, None, None, None


class ExpertsDown(torch.autograd.Function):
    """The second half of the split path, for a frozen down projection and bias without LoRA: h -> sum over each
    token's slots of rw * (h @ down_e^T + bias_e). It saves nothing through save_for_backward (the weight and the
    routing metadata, a few KiB, are kept on ctx), so under non-reentrant checkpointing, whose recompute
    stops once the last saved tensor is back (early stop, torch's default), the recompute ends after
    ExpertsUp: the down GEMM and the combine run once per step instead of twice. Its rw input carries a gradient
    only with a bias: the bias's share <g, bias_e> (ExpertsUp gives the rest)."""

    @staticmethod
    def forward(ctx, h, rw, down, bias2, offsets, gather, scatter, k):
        T = gather.shape[0] // k
        y = grouped_mm_rows(h, down, offsets, out_index=scatter, row_weights=rw, bias=bias2)
        keep_for_backward(ctx, (down, bias2, offsets, gather))
        return _sum_slots(y, T, k)

    @staticmethod
    def backward(ctx, grad_out):
        down, bias2, offsets, gather = kept_for_backward(ctx)
        g = grad_out.to(down.dtype)
        # d(unweighted h): ExpertsUp applies the routing weights and takes their gradient <dh, h>
        dh = grouped_mm_rows(g, _t(down), offsets, a_index=gather)
        drw = _bias_rw_grad(g, bias2, offsets, gather) if ctx.needs_input_grad[1] else None
        return dh, drw, None, None, None, None, None, None


def _check_experts(x, gate_up, down, top_k_index, top_k_weights, lora, biases):
    check_dtype("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden]; got shape {tuple(x.shape)}")
    T, H = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != H or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [experts, 2 * intermediate, {H}]; got {tuple(gate_up.shape)}")
    E, two_i, _ = gate_up.shape
    check_shape("down_proj", down, (E, H, two_i // 2), "[experts, hidden, intermediate]")
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}; got {w.dtype}")
    for name, bias, n in (("gate_up_bias", biases[0], two_i), ("down_bias", biases[1], H)):
        if bias is not None:
            check_shape(name, bias, (E, n), f"[experts, {n}]")
            check_dtype(name, bias)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"top_k_index must be int32/int64 [{T}, k]; got {top_k_index.dtype} {tuple(top_k_index.shape)}"
        )
    check_shape("top_k_weights", top_k_weights, tuple(top_k_index.shape), "the shape of top_k_index")
    check_dtype("top_k_weights", top_k_weights)
    for name, (w, adapter) in (lora or {}).items():
        if adapter is None:
            continue
        E_, out, inp = w.shape
        r = adapter.A.shape[1]
        check_shape(f"{name}.A", adapter.A, (E_, r, inp), "[experts, r, in]")
        check_shape(f"{name}.B", adapter.B, (E_, out, r), "[experts, out, r]")
    check_same_device(
        x=x,
        gate_up_proj=gate_up,
        down_proj=down,
        top_k_index=top_k_index,
        top_k_weights=top_k_weights,
        gate_up_bias=biases[0],
        down_bias=biases[1],
    )


# ------------------------------------------------------------------------------------------- public API
def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: str = "silu",
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    interleaved: bool = False,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The routed experts of an MoE block: x [T, H]; gate_up_proj [E, 2I, H] ([gate; up] halves, as in
    transformers, or interleaved rows: gate c at 2c, up c at 2c + 1, as gpt-oss); down_proj [E, H, I] (any strides:
    gpt-oss's [E, in, out] weights pass as .transpose(1, 2)); top_k_index / top_k_weights [T, k]; biases [E, 2I]
    (gate_up's row order) and [E, H]. activation: silu, gelu_tanh, gelu, or clamped_swiglu with swiglu_alpha and
    swiglu_limit (gpt-oss's (clamp(up, -l, l) + 1) * g sigmoid(alpha g), g = min(gate, l)). Returns [T, H] in x's
    dtype. LoRA adapters are cast to the weights' dtype (as peft does) and differentiable; so are the biases."""
    glu = glu_spec(activation, interleaved=interleaved, alpha=swiglu_alpha, limit=swiglu_limit)
    biases = (gate_up_bias, down_bias)
    _check_experts(
        x,
        gate_up_proj,
        down_proj,
        top_k_index,
        top_k_weights,
        {"gate_up_lora": (gate_up_proj, gate_up_lora), "down_lora": (down_proj, down_lora)},
        biases,
    )
    if not use_triton(x, gate_up_proj, down_proj):
        return _reference(x, gate_up_proj, down_proj, top_k_index, top_k_weights, glu, gate_up_lora, down_lora, biases)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    a1, b1, s1 = _adapter(gate_up_lora, gate_up_proj.dtype)
    a2, b2, s2 = _adapter(down_lora, down_proj.dtype)
    bias1, bias2 = (None if b is None else b.to(x.dtype) for b in biases)
    if torch.compiler.is_compiling():  # one registered operator (the split path's trick is eager-only)
        return _moe_experts_op(
            x, top_k_weights, top_k_index, gate_up_proj, down_proj, a1, b1, a2, b2, bias1, bias2, s1, s2, *glu
        )[0]
    down_trained = torch.is_grad_enabled() and (down_proj.requires_grad or (bias2 is not None and bias2.requires_grad))
    if down_lora is None and not down_trained:
        # frozen down projection: the split path (ExpertsDown is not recomputed under checkpointing)
        k = top_k_index.shape[1]
        offsets, gather, scatter = routing_metadata(top_k_index, gate_up_proj.shape[0])
        rw = top_k_weights.reshape(-1)[scatter.long()]
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, top_k_weights, gate_up_proj, a1, b1, bias1)
        )
        h = ExpertsUp.apply(x, rw, gate_up_proj, a1, b1, bias1, s1, offsets, gather, scatter, glu, k, need_grad)
        rw_down = rw if bias2 is not None else rw.detach()  # with a bias, its share of the routing weights' gradient
        return ExpertsDown.apply(h, rw_down, down_proj, bias2, offsets, gather, scatter, k)
    return MoEExperts.apply(
        x, top_k_weights, top_k_index, gate_up_proj, down_proj, a1, b1, a2, b2, bias1, bias2, s1, s2, glu
    )


def _adapter(adapter: ExpertLoRA | None, dtype: torch.dtype):
    if adapter is None:
        return None, None, 0.0
    return adapter.A.to(dtype), adapter.B.to(dtype), float(adapter.scaling)


def moe_experts_reference(
    x,
    gate_up_proj,
    down_proj,
    top_k_index,
    top_k_weights,
    *,
    activation="silu",
    gate_up_lora=None,
    down_lora=None,
    gate_up_bias=None,
    down_bias=None,
    interleaved=False,
    swiglu_alpha=None,
    swiglu_limit=None,
):
    """Per-expert loop in plain torch (the maths of transformers' eager experts, LoRA as W + s B A); float64 too."""
    glu = glu_spec(activation, interleaved=interleaved, alpha=swiglu_alpha, limit=swiglu_limit)
    biases = (gate_up_bias, down_bias)
    return _reference(x, gate_up_proj, down_proj, top_k_index, top_k_weights, glu, gate_up_lora, down_lora, biases)


def _reference(x, gate_up_proj, down_proj, top_k_index, top_k_weights, glu, gate_up_lora, down_lora, biases):
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        rows = x[token]
        gu = rows @ gate_up_proj[e].T
        if gate_up_lora is not None:
            gu = gu + gate_up_lora.scaling * (rows @ gate_up_lora.A[e].to(x.dtype).T) @ gate_up_lora.B[e].to(x.dtype).T
        if biases[0] is not None:
            gu = gu + biases[0][e].to(x.dtype)
        h = glu_rows_reference(gu, glu)
        y = h @ down_proj[e].T
        if down_lora is not None:
            y = y + down_lora.scaling * (h @ down_lora.A[e].to(x.dtype).T) @ down_lora.B[e].to(x.dtype).T
        if biases[1] is not None:
            y = y + biases[1][e].to(x.dtype)
        out = out.index_add(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------- registered operators
# What torch.compile traces (eager calls keep the autograd Functions above): the forward returns what the
# backward reads, as extra outputs; a LoRA input left out comes back as an empty tensor (operators return
# tensors, not None). The GluSpec passes as its four fields.
def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


@torch.library.custom_op("fastplug::moe_experts", mutates_args=())
def _moe_experts_op(
    x: torch.Tensor,
    top_k_weights: torch.Tensor,
    top_k_index: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    a1: torch.Tensor | None,
    b1: torch.Tensor | None,
    a2: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias1: torch.Tensor | None,
    bias2: torch.Tensor | None,
    s1: float,
    s2: float,
    act: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(out, gu, t1, t2, offsets, gather, scatter, rw)."""
    (a1, b1), (a2, b2) = _prepared(a1, b1, s1), _prepared(a2, b2, s2)
    glu = GluSpec(act, interleaved, alpha, limit)
    out, (gu, t1, t2, offsets, gather, scatter, rw) = _experts_forward(
        x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, glu
    )
    return out, gu, _or_empty(t1, x), _or_empty(t2, x), offsets, gather, scatter, rw


@_moe_experts_op.register_fake
def _(x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, s1, s2, *glu):
    rows = top_k_index.numel()
    ints = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(x.shape),
        x.new_empty((rows, gate_up.shape[1])),
        x.new_empty((rows, a1.shape[1]) if a1 is not None else 0),
        x.new_empty((rows, a2.shape[1]) if a2 is not None else 0),
        torch.empty(gate_up.shape[0], **ints),
        torch.empty(rows, **ints),
        torch.empty(rows, **ints),
        top_k_weights.new_empty(rows),
    )


@torch.library.custom_op("fastplug::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    top_k_weights: torch.Tensor,
    gu: torch.Tensor,
    t1: torch.Tensor,
    t2: torch.Tensor,
    offsets: torch.Tensor,
    gather: torch.Tensor,
    scatter: torch.Tensor,
    rw: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    a1: torch.Tensor | None,
    b1: torch.Tensor | None,
    a2: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias1: torch.Tensor | None,
    bias2: torch.Tensor | None,
    s1: float,
    s2: float,
    act: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    k: int,
    needs: list[bool],
) -> list[torch.Tensor]:
    """Grads of (x, top_k_weights, gate_up, down, a1, b1, a2, b2, bias1, bias2); an empty tensor where not needed."""
    (a1p, b1p), (a2p, b2p) = _prepared(a1, b1, s1), _prepared(a2, b2, s2)
    saved = (gu, t1 if a1 is not None else None, t2 if a2 is not None else None, offsets, gather, scatter, rw)
    weights = (gate_up, down, a1p, b1p, a2p, b2p, bias1, bias2)
    glu = GluSpec(act, interleaved, alpha, limit)
    grads = _experts_backward(grad_out, x, saved, weights, (s1, s2), glu, k, top_k_weights.dtype, needs)
    return [x.new_empty(0) if g is None else g for g in grads]


@_moe_experts_backward_op.register_fake
def _(
    grad_out,
    x,
    top_k_weights,
    gu,
    t1,
    t2,
    offsets,
    gather,
    scatter,
    rw,
    gate_up,
    down,
    a1,
    b1,
    a2,
    b2,
    bias1,
    bias2,
    s1,
    s2,
    act,
    interleaved,
    alpha,
    limit,
    k,
    needs,
):
    like = (x, top_k_weights, gate_up, down, a1, b1, a2, b2, bias1, bias2)
    return [t.new_empty(t.shape) if need and t is not None else x.new_empty(0) for t, need in zip(like, needs)]


def _setup_experts(ctx, inputs, output):
    x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, s1, s2, *glu = inputs
    ctx.save_for_backward(x, top_k_weights, *output[1:], gate_up, down, a1, b1, a2, b2, bias1, bias2)
    ctx.scales, ctx.glu, ctx.k = (s1, s2), glu, top_k_index.shape[1]


def _experts_op_backward(ctx, grad_out, *_unused):
    x, top_k_weights, gu, t1, t2, offsets, gather, scatter, rw, *weights = ctx.saved_tensors
    gate_up, down, a1, b1, a2, b2, bias1, bias2 = weights
    n = ctx.needs_input_grad
    # inputs: x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, bias1, bias2, s1, s2, glu fields
    needs = [n[0], n[1], n[3], n[4], *(n[i] and t is not None for i, t in zip(range(5, 11), weights[2:]))]
    grads = _moe_experts_backward_op(
        grad_out,
        x,
        top_k_weights,
        gu,
        t1,
        t2,
        offsets,
        gather,
        scatter,
        rw,
        *weights,
        *ctx.scales,
        *ctx.glu,
        ctx.k,
        needs,
    )
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads[:2], None, *grads[2:], None, None, None, None, None, None)


_moe_experts_op.register_autograd(_experts_op_backward, setup_context=_setup_experts)
