"""The MoE expert MLP, out[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])) with e = index[t, j],
built on the grouped GEMMs, with optional LoRA on the expert weights.

Forward: routing metadata (one launch) -> gate_up grouped GEMM gathering token rows on load, with the gated
activation in its epilogue (`grouped_mm_glu`; with LoRA on gate_up the rank-r term goes into the GEMM's
epilogue instead and `activations.glu_forward` runs after it) -> down grouped GEMM storing each row at its
(token, slot) place times its routing weight -> one pass summing each token's k slots (`_sum_slots`).
LoRA on an expert weight W [E, out, in] is the rank-r grouped term s * (x A_e^T) B_e^T: a grouped GEMM to
[rows, r], added in the epilogue of the base GEMM. No E x out x in delta weight is ever formed.

Two autograd paths:
- `MoEExperts`, one node, when the down projection is trained (full fine-tuning, LoRA on down_proj). Saved:
  x, the gate_up output and the [rows, r] LoRA inputs; h is recomputed by `_glu_rows_bwd`, which also
  applies the routing weights to dgate/dup and computes their gradient <d(unweighted row), h> in one pass.
- `ExpertsUp` + `ExpertsDown` when down_proj is frozen without LoRA (LoRA on attention, or on gate_up only).
  ExpertsDown saves nothing through save_for_backward, so a non-reentrant checkpoint's recompute (early stop,
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
from ..activations import ACTIVATIONS, gate_factor_torch, glu_forward
from ..jit_helpers import gate_factor
from .grouped_gemm import grouped_mm_dw, grouped_mm_glu, grouped_mm_rows
from .routing import routing_metadata

_BLOCK_ROWS = 16
_MAX_BLOCK_I = 256


class ExpertLoRA(NamedTuple):
    """LoRA on one 3-D expert weight W [E, out, in]: W_e + scaling * B_e @ A_e."""

    A: torch.Tensor  # [E, r, in]
    B: torch.Tensor  # [E, out, r]
    scaling: float


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _glu_rows_bwd(
    dh_ptr,
    gu_ptr,
    rw_ptr,
    dgu_ptr,
    drw_ptr,
    M,
    I,
    stride_dh,
    stride_gu,
    stride_dgu,
    ACT: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """dh: d(unweighted h) [M, I]; gu: [gate | up] [M, 2I]. Writes dgu = rw * d[gate | up], drw = <dh, h>
    and (STORE_H) h into dh's buffer (each element is read before this program overwrites it)."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = rows < M
    rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_I):
        cols = c0 + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols[None, :] < I)
        g = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(gu_ptr + rows[:, None] * stride_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rows[:, None] * stride_gu + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        p, dp = gate_factor(x, ACT)
        act = x * p
        h = act * u
        dot += tl.sum(g * h, 1)
        if STORE_H:
            tl.store(dh_ptr + rows[:, None] * stride_dh + cols[None, :], h.to(dh_ptr.dtype.element_ty), mask=mask)
        gw = g * rw[:, None]
        tl.store(
            dgu_ptr + rows[:, None] * stride_dgu + cols[None, :],
            (gw * u * (p + x * dp)).to(dgu_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            dgu_ptr + rows[:, None] * stride_dgu + I + cols[None, :], (gw * act).to(dgu_ptr.dtype.element_ty), mask=mask
        )
    tl.store(drw_ptr + rows, dot, mask=row_ok)


def _glu_rows_backward(dh: torch.Tensor, gu: torch.Tensor, rw: torch.Tensor, activation: str, store_h: bool = True):
    """(dgu, h, drw); h is written into dh's buffer (owned by the caller) when store_h, else h is None."""
    M, I = dh.shape
    dgu = torch.empty_like(gu)
    drw = torch.empty(M, dtype=torch.float32, device=dh.device)
    if M:
        _glu_rows_bwd[(cdiv(M, _BLOCK_ROWS),)](
            dh,
            gu,
            rw,
            dgu,
            drw,
            M,
            I,
            dh.stride(0),
            gu.stride(0),
            dgu.stride(0),
            ACT=ACTIVATIONS.index(activation),
            STORE_H=store_h,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_I=min(_MAX_BLOCK_I, next_power_of_2(I)),
        )
    return dgu, (dh if store_h else None), drw


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


def _gate_up_forward(x, gate_up, a1, b1, offsets, gather, activation, store_gu: bool):
    """(t1, gu, h): the gate_up GEMM over gathered token rows and h = act(gate) * up. Without LoRA the
    activation runs in the GEMM's epilogue (gu is only written when the backward needs it); with LoRA the
    rank-r term goes into the GEMM's epilogue and the activation is a separate pass."""
    if a1 is None:
        gu, h = grouped_mm_glu(x, gate_up, offsets, activation, a_index=gather, store_gu=store_gu)
        return None, gu, h
    t1 = grouped_mm_rows(x, a1, offsets, a_index=gather)
    gu = grouped_mm_rows(x, gate_up, offsets, a_index=gather, lora=(t1, b1))
    inter = gu.shape[1] // 2
    return t1, gu, glu_forward(gu[:, :inter], gu[:, inter:], activation)


def _prepared(a, b, s):
    """peft's factors are strided views ([out, r * E] seen as [E, out, r]): a few MiB of contiguous copies keep
    the kernels' loads coalesced. B carries the scale (b = s B): the kernels then add the LoRA term into their
    accumulator, and in backward u = dy b already holds s for dA and dX."""
    if a is None:
        return None, None
    return a.contiguous(), (b * s if s != 1.0 else b).contiguous()


def _experts_forward(x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, activation):
    """(out [T, H], what backward reads: gu, t1, t2, offsets, gather, scatter, rw); a/b already `_prepared`."""
    T = x.shape[0]
    E = gate_up.shape[0]
    k = top_k_index.shape[1]
    offsets, gather, scatter = routing_metadata(top_k_index, E)
    rw = top_k_weights.reshape(-1)[scatter.long()]
    t1, gu, h = _gate_up_forward(x, gate_up, a1, b1, offsets, gather, activation, True)
    t2 = grouped_mm_rows(h, a2, offsets) if a2 is not None else None
    y = grouped_mm_rows(h, down, offsets, out_index=scatter, row_weights=rw, lora=(t2, b2) if a2 is not None else None)
    return _sum_slots(y, T, k), (gu, t1, t2, offsets, gather, scatter, rw)


def _experts_backward(g, x, saved, gate_up, down, a1, b1, a2, b2, scales, activation, k, weights_dtype, needs):
    """Grads of (x, top_k_weights, gate_up, down, a1, b1, a2, b2) (None where `needs` says no) from the
    output's gradient g; a/b as `_prepared`, scales the LoRA scalings (s1, s2)."""
    gu, t1, t2, offsets, gather, scatter, rw = saved
    s1, s2 = scales
    E = gate_up.shape[0]
    T = x.shape[0]
    g = g.to(x.dtype)
    grads = [None] * 8

    # down projection: d(unweighted h) rows, read from the token gradients
    u2 = grouped_mm_rows(g, _t(b2), offsets, a_index=gather) if a2 is not None else None
    dh = grouped_mm_rows(g, _t(down), offsets, a_index=gather, lora=(u2, _t(a2)) if a2 is not None else None)
    dgu, h, drw = _glu_rows_backward(dh, gu, rw, activation)
    if needs[3]:
        grads[3] = grouped_mm_dw(g, h, offsets, E, dy_index=gather, row_weights=rw, dtype=down.dtype)
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
    u1 = grouped_mm_rows(dgu, _t(b1), offsets) if a1 is not None else None
    if needs[0]:
        slots = grouped_mm_rows(
            dgu, _t(gate_up), offsets, out_index=scatter, lora=(u1, _t(a1)) if a1 is not None else None
        )
        grads[0] = _sum_slots(slots, T, k)
    if needs[2]:
        grads[2] = grouped_mm_dw(dgu, x, offsets, E, x_index=gather, dtype=gate_up.dtype)
    if a1 is not None:
        if needs[5]:
            grads[5] = grouped_mm_dw(dgu, t1, offsets, E, scale=s1, dtype=b1.dtype)
        if needs[4]:
            grads[4] = grouped_mm_dw(u1, x, offsets, E, x_index=gather, dtype=a1.dtype)
    return grads


class MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, s1, s2, activation):
        (a1, b1), (a2, b2) = _prepared(a1, b1, s1), _prepared(a2, b2, s2)
        out, saved = _experts_forward(x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, activation)
        ctx.save_for_backward(x, *saved)
        keep_for_backward(ctx, (gate_up, down, a1, b1, a2, b2))
        ctx.scales, ctx.activation, ctx.k = (s1, s2), activation, top_k_index.shape[1]
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
            *kept_for_backward(ctx),
            ctx.scales,
            ctx.activation,
            ctx.k,
            ctx.weights_dtype,
            needs[:2] + needs[3:9],
        )
        # inputs: x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, s1, s2, activation
        return (*grads[:2], None, *grads[2:], None, None, None)


class ExpertsUp(torch.autograd.Function):
    """The first half of the split path: x -> h = act(gate) * up per grouped row (gate_up GEMM gathering
    token rows, LoRA term in its epilogue, the gated activation). Its gradient input is d(unweighted h)
    from `ExpertsDown`, an internal convention of the pair: h reaches no one else."""

    @staticmethod
    def forward(ctx, x, rw, gate_up, a1, b1, s1, offsets, gather, scatter, activation, k, need_grad):
        a1, b1 = _prepared(a1, b1, s1)
        t1, gu, h = _gate_up_forward(x, gate_up, a1, b1, offsets, gather, activation, need_grad)
        ctx.save_for_backward(x, gu, t1, rw)
        keep_for_backward(ctx, (gate_up, a1, b1, offsets, gather, scatter))  # weights and routing metadata
        ctx.s1, ctx.activation, ctx.k = s1, activation, k
        return h

    @staticmethod
    def backward(ctx, dh):
        x, gu, t1, rw = ctx.saved_tensors
        gate_up, a1, b1, offsets, gather, scatter = kept_for_backward(ctx)
        needs = ctx.needs_input_grad
        E = gate_up.shape[0]
        grads = [None] * 12
        dgu, _, drw = _glu_rows_backward(dh, gu, rw, ctx.activation, store_h=False)
        if needs[1]:
            grads[1] = drw.to(rw.dtype)
        u1 = grouped_mm_rows(dgu, _t(b1), offsets) if a1 is not None else None
        if needs[0]:
            slots = grouped_mm_rows(
                dgu, _t(gate_up), offsets, out_index=scatter, lora=(u1, _t(a1)) if a1 is not None else None
            )
            grads[0] = _sum_slots(slots, x.shape[0], ctx.k)
        if needs[2]:
            grads[2] = grouped_mm_dw(dgu, x, offsets, E, x_index=gather, dtype=gate_up.dtype)
        if a1 is not None:
            if needs[4]:
                grads[4] = grouped_mm_dw(dgu, t1, offsets, E, scale=ctx.s1, dtype=b1.dtype)
            if needs[3]:
                grads[3] = grouped_mm_dw(u1, x, offsets, E, x_index=gather, dtype=a1.dtype)
        return tuple(grads)


class ExpertsDown(torch.autograd.Function):
    """The second half of the split path, for a frozen down projection without LoRA: h -> sum over each
    token's slots of rw * (h @ down_e^T). It saves nothing through save_for_backward (the weight and the
    routing metadata, a few KiB, are kept on ctx), so under non-reentrant checkpointing, whose recompute
    stops once the last saved tensor is back (early stop, torch's default), the recompute ends after
    ExpertsUp: the down GEMM and the combine run once per step instead of twice."""

    @staticmethod
    def forward(ctx, h, rw, down, offsets, gather, scatter, k):
        T = gather.shape[0] // k
        y = grouped_mm_rows(h, down, offsets, out_index=scatter, row_weights=rw)
        keep_for_backward(ctx, (down, offsets, gather))
        return _sum_slots(y, T, k)

    @staticmethod
    def backward(ctx, grad_out):
        down, offsets, gather = kept_for_backward(ctx)
        # d(unweighted h): ExpertsUp applies the routing weights and takes their gradient <dh, h>
        dh = grouped_mm_rows(grad_out.to(down.dtype), _t(down), offsets, a_index=gather)
        return dh, None, None, None, None, None, None


def _check_experts(x, gate_up, down, top_k_index, top_k_weights, activation, lora):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
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
    check_same_device(x=x, gate_up_proj=gate_up, down_proj=down, top_k_index=top_k_index, top_k_weights=top_k_weights)


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
) -> torch.Tensor:
    """The routed experts of an MoE block: x [T, H]; gate_up_proj [E, 2I, H] ([gate; up] halves, as in
    transformers); down_proj [E, H, I]; top_k_index / top_k_weights [T, k]. Returns [T, H] in x's dtype.
    LoRA adapters are cast to the weights' dtype (as peft does) and differentiable."""
    _check_experts(
        x,
        gate_up_proj,
        down_proj,
        top_k_index,
        top_k_weights,
        activation,
        {"gate_up_lora": (gate_up_proj, gate_up_lora), "down_lora": (down_proj, down_lora)},
    )
    if not use_triton(x, gate_up_proj, down_proj):
        return moe_experts_reference(
            x,
            gate_up_proj,
            down_proj,
            top_k_index,
            top_k_weights,
            activation=activation,
            gate_up_lora=gate_up_lora,
            down_lora=down_lora,
        )
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    a1, b1, s1 = _adapter(gate_up_lora, gate_up_proj.dtype)
    a2, b2, s2 = _adapter(down_lora, down_proj.dtype)
    if torch.compiler.is_compiling():  # one registered operator (the split path's trick is eager-only)
        return _moe_experts_op(
            x, top_k_weights, top_k_index, gate_up_proj, down_proj, a1, b1, a2, b2, s1, s2, activation
        )[0]
    if down_lora is None and not (torch.is_grad_enabled() and down_proj.requires_grad):
        # frozen down projection: the split path (ExpertsDown is not recomputed under checkpointing)
        k = top_k_index.shape[1]
        offsets, gather, scatter = routing_metadata(top_k_index, gate_up_proj.shape[0])
        rw = top_k_weights.reshape(-1)[scatter.long()]
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, top_k_weights, gate_up_proj, a1, b1)
        )
        h = ExpertsUp.apply(x, rw, gate_up_proj, a1, b1, s1, offsets, gather, scatter, activation, k, need_grad)
        return ExpertsDown.apply(h, rw.detach(), down_proj, offsets, gather, scatter, k)
    return MoEExperts.apply(x, top_k_weights, top_k_index, gate_up_proj, down_proj, a1, b1, a2, b2, s1, s2, activation)


def _adapter(adapter: ExpertLoRA | None, dtype: torch.dtype):
    if adapter is None:
        return None, None, 0.0
    return adapter.A.to(dtype), adapter.B.to(dtype), float(adapter.scaling)


def moe_experts_reference(
    x, gate_up_proj, down_proj, top_k_index, top_k_weights, *, activation="silu", gate_up_lora=None, down_lora=None
):
    """Per-expert loop in plain torch (the maths of transformers' eager experts, LoRA as W + s B A)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = down_proj.shape[2]
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        rows = x[token]
        gu = rows @ gate_up_proj[e].T
        if gate_up_lora is not None:
            gu = gu + gate_up_lora.scaling * (rows @ gate_up_lora.A[e].to(x.dtype).T) @ gate_up_lora.B[e].to(x.dtype).T
        gate, up = gu[:, :inter], gu[:, inter:]
        h = gate * gate_factor_torch(gate, activation)[0] * up
        y = h @ down_proj[e].T
        if down_lora is not None:
            y = y + down_lora.scaling * (h @ down_lora.A[e].to(x.dtype).T) @ down_lora.B[e].to(x.dtype).T
        out = out.index_add(0, token, (y * top_k_weights[token, slot, None]).float())
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------- registered operators
# What torch.compile traces (eager calls keep the autograd Functions above): the forward returns what the
# backward reads, as extra outputs; a LoRA input left out comes back as an empty tensor (operators return
# tensors, not None).
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
    s1: float,
    s2: float,
    activation: str,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(out, gu, t1, t2, offsets, gather, scatter, rw)."""
    (a1, b1), (a2, b2) = _prepared(a1, b1, s1), _prepared(a2, b2, s2)
    out, (gu, t1, t2, offsets, gather, scatter, rw) = _experts_forward(
        x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, activation
    )
    return out, gu, _or_empty(t1, x), _or_empty(t2, x), offsets, gather, scatter, rw


@_moe_experts_op.register_fake
def _(x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, s1, s2, activation):
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
    s1: float,
    s2: float,
    activation: str,
    k: int,
    needs: list[bool],
) -> list[torch.Tensor]:
    """Grads of (x, top_k_weights, gate_up, down, a1, b1, a2, b2); an empty tensor where not needed."""
    (a1p, b1p), (a2p, b2p) = _prepared(a1, b1, s1), _prepared(a2, b2, s2)
    saved = (gu, t1 if a1 is not None else None, t2 if a2 is not None else None, offsets, gather, scatter, rw)
    grads = _experts_backward(
        grad_out, x, saved, gate_up, down, a1p, b1p, a2p, b2p, (s1, s2), activation, k, top_k_weights.dtype, needs
    )
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
    s1,
    s2,
    activation,
    k,
    needs,
):
    like = (x, top_k_weights, gate_up, down, a1, b1, a2, b2)
    return [t.new_empty(t.shape) if need and t is not None else x.new_empty(0) for t, need in zip(like, needs)]


def _setup_experts(ctx, inputs, output):
    x, top_k_weights, top_k_index, gate_up, down, a1, b1, a2, b2, s1, s2, activation = inputs
    ctx.save_for_backward(x, top_k_weights, *output[1:], gate_up, down, a1, b1, a2, b2)
    ctx.scales, ctx.activation, ctx.k = (s1, s2), activation, top_k_index.shape[1]


def _experts_op_backward(ctx, grad_out, *_unused):
    x, top_k_weights, gu, t1, t2, offsets, gather, scatter, rw, gate_up, down, a1, b1, a2, b2 = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [
        n[0],
        n[1],
        n[3],
        n[4],
        n[5] and a1 is not None,
        n[6] and b1 is not None,
        n[7] and a2 is not None,
        n[8] and b2 is not None,
    ]
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
        gate_up,
        down,
        a1,
        b1,
        a2,
        b2,
        *ctx.scales,
        ctx.activation,
        ctx.k,
        needs,
    )
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads[:2], None, *grads[2:], None, None, None)


_moe_experts_op.register_autograd(_experts_op_backward, setup_context=_setup_experts)
