"""MoE routing: the top-k router (softmax, top-k, renormalisation) and the routing metadata that the
grouped GEMMs read (per-expert row offsets, gather and scatter indices). Nothing syncs with the host.

- `_router_fwd`: a program takes a block of tokens' logits, computes the softmax in fp32, picks the top k
  by k rounds of argmax (ties to the lower expert, sorted descending as torch.topk) and renormalises.
  `_router_bwd` recomputes the softmax from the logits (nothing else is saved) and returns dlogits.
- `_routing_metadata`: one program per expert walks the flat [T * k] expert ids twice: first counting the
  ids below and equal to its own (its first row and row count), then writing its rows in slot order. So
  rows are grouped by expert and, inside an expert, in token order: the same order as a stable sort,
  deterministic, in one launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._utils import cdiv, check_dtype, next_power_of_2, use_triton

_BLOCK_T = 16  # tokens per router program
_BLOCK_S = 1024  # expert ids per step of a metadata program


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _softmax_rows(logits_ptr, rows, cols, T, E, stride_t):
    mask = (rows[:, None] < T) & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(cols[None, :] < E, x, float("-inf"))  # rows past T stay finite: no NaN in masked lanes
    p = tl.exp(x - tl.max(x, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def _pick(remaining, cols, BLOCK_E: tl.constexpr):
    """The largest value of each row and its expert (the lower one on ties); that entry is then retired."""
    best = tl.max(remaining, 1)
    pick = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_E), 1)
    return best, pick, tl.where(cols[None, :] == pick[:, None], -2.0, remaining)


@triton.jit(do_not_specialize=["T"])  # a new batch length compiles nothing
def _router_fwd(
    logits_ptr,
    weights_ptr,
    index_ptr,
    T,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    p = _softmax_rows(logits_ptr, rows, cols, T, E, stride_t)
    row_ok = rows < T
    # padded experts get -1 so they are never picked
    valid = tl.where(cols[None, :] < E, p, -1.0)
    total = tl.full((BLOCK_T,), 1.0, dtype=tl.float32)
    if NORMALIZE:  # a first round of picks for the sum of the top k (keeps the stores below final)
        remaining = valid
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best, pick, remaining = _pick(remaining, cols, BLOCK_E)
            total += best
    remaining = valid
    for j in tl.static_range(TOP_K):
        best, pick, remaining = _pick(remaining, cols, BLOCK_E)
        tl.store(index_ptr + rows * TOP_K + j, pick.to(index_ptr.dtype.element_ty), mask=row_ok)
        tl.store(weights_ptr + rows * TOP_K + j, best / total, mask=row_ok)


@triton.jit(do_not_specialize=["T"])  # a new batch length compiles nothing
def _router_bwd(
    logits_ptr,
    index_ptr,
    dweights_ptr,
    dlogits_ptr,
    T,
    E,
    stride_t,
    stride_dt,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    p = _softmax_rows(logits_ptr, rows, cols, T, E, stride_t)
    # dense [T, E] views of the selected probabilities and their incoming gradients
    sel = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    dsel = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        idx = tl.load(index_ptr + rows * TOP_K + j, mask=row_ok, other=-1)
        g = tl.load(dweights_ptr + rows * TOP_K + j, mask=row_ok, other=0.0).to(tl.float32)
        hit = cols[None, :] == idx[:, None]
        sel = tl.where(hit, 1.0, sel)
        dsel = tl.where(hit, g[:, None], dsel)
    if NORMALIZE:
        # w_j = p_j / S, S = sum of the selected p: dp_j = (dw_j - sum_i dw_i w_i) / S
        total = tl.where(row_ok, tl.sum(p * sel, 1), 1.0)
        wdot = tl.sum(dsel * p * sel, 1) / total
        dsel = (dsel - wdot[:, None]) / total[:, None] * sel
    # softmax backward; dp is zero outside the selected experts
    dlogits = p * (dsel - tl.sum(dsel * p, 1)[:, None])
    tl.store(
        dlogits_ptr + rows[:, None] * stride_dt + cols[None, :],
        dlogits.to(dlogits_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols[None, :] < E),
    )


@triton.jit(do_not_specialize=["S"])  # a new batch length compiles nothing
def _routing_metadata(
    ids_ptr,
    offsets_ptr,
    gather_ptr,
    scatter_ptr,
    S,
    TOP_K,
    BLOCK_S: tl.constexpr,
):
    expert = tl.program_id(0)
    before = tl.zeros((), dtype=tl.int32)
    count = tl.zeros((), dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(ids_ptr + s, mask=s < S, other=-1)
        before += tl.sum(((ids < expert) & (s < S)).to(tl.int32), 0)
        count += tl.sum((ids == expert).to(tl.int32), 0)
    tl.store(offsets_ptr + expert, before + count)
    row = before
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        hit = tl.load(ids_ptr + s, mask=s < S, other=-1) == expert
        rank = tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(gather_ptr + row + rank, s // TOP_K, mask=hit)
        tl.store(scatter_ptr + row + rank, s, mask=hit)
        row += tl.sum(hit.to(tl.int32), 0)


# ---------------------------------------------------------------------------------------------- autograd
def _router_forward(logits, top_k, normalize):
    """(weights fp32 [T, k], index int64 [T, k])."""
    T, E = logits.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    index = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        _router_fwd[(cdiv(T, _BLOCK_T),)](
            logits,
            weights,
            index,
            T,
            E,
            logits.stride(0),
            TOP_K=top_k,
            NORMALIZE=normalize,
            BLOCK_T=_BLOCK_T,
            BLOCK_E=next_power_of_2(E),
        )
    return weights, index


def _router_backward(dweights, logits, index, normalize):
    T, E = logits.shape
    dlogits = torch.empty_like(logits)
    if T:
        dweights = dweights.contiguous()
        _router_bwd[(cdiv(T, _BLOCK_T),)](
            logits,
            index,
            dweights,
            dlogits,
            T,
            E,
            logits.stride(0),
            dlogits.stride(0),
            TOP_K=index.shape[1],
            NORMALIZE=normalize,
            BLOCK_T=_BLOCK_T,
            BLOCK_E=next_power_of_2(E),
        )
    return dlogits


class TopKRouter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, normalize, weights_dtype):
        weights, index = _router_forward(logits, top_k, normalize)
        ctx.save_for_backward(logits, index)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(index)
        return weights.to(weights_dtype), index

    @staticmethod
    def backward(ctx, dweights, _dindex):
        logits, index = ctx.saved_tensors
        return _router_backward(dweights, logits, index, ctx.normalize), None, None, None


def _check_router(logits: torch.Tensor, top_k: int) -> None:
    check_dtype("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [tokens, experts]; got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}] (the number of experts); got {top_k}")
    if logits.shape[1] > 1024:
        raise ValueError(f"logits may have at most 1024 experts; got {logits.shape[1]}")


# ------------------------------------------------------------------------------------------- public API
def moe_router(
    logits: torch.Tensor, top_k: int, *, normalize: bool = True, weights_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert indices [T, k] int64) from router logits [T, E]: softmax in fp32, top k
    (sorted descending), renormalised to sum 1 when `normalize`. Weights come in `weights_dtype` (default
    fp32); differentiable in logits."""
    _check_router(logits, top_k)
    weights_dtype = weights_dtype or torch.float32
    if not use_triton(logits):
        return moe_router_reference(logits, top_k, normalize=normalize, weights_dtype=weights_dtype)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if torch.compiler.is_compiling():
        weights, index = _router_op(logits, top_k, normalize)
        return weights.to(weights_dtype), index
    return TopKRouter.apply(logits, top_k, normalize, weights_dtype)


def moe_router_reference(
    logits: torch.Tensor, top_k: int, *, normalize: bool = True, weights_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype or torch.float32), index


def routing_metadata(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets [E] int32 cumulative rows per expert, gather_index [T*k] int32: the token of each grouped
    row, scatter_index [T*k] int32: its flat (token, slot) position) for top_k_index [T, k]."""
    if top_k_index.dim() != 2 or top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"top_k_index must be an int32/int64 [tokens, k] tensor; got {top_k_index.dtype} {tuple(top_k_index.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got {num_experts}")
    if not use_triton(top_k_index):
        return routing_metadata_reference(top_k_index, num_experts)
    ids = top_k_index.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    S = ids.shape[0]
    device = ids.device
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    gather = torch.empty(S, dtype=torch.int32, device=device)
    scatter = torch.empty(S, dtype=torch.int32, device=device)
    _routing_metadata[(num_experts,)](
        ids, offsets, gather, scatter, S, top_k_index.shape[1], BLOCK_S=min(_BLOCK_S, max(16, next_power_of_2(S)))
    )
    return offsets, gather, scatter


def routing_metadata_reference(top_k_index: torch.Tensor, num_experts: int):
    ids = top_k_index.reshape(-1)
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=num_experts)[:num_experts]
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return offsets, (order // top_k_index.shape[1]).to(torch.int32), order.to(torch.int32)


# ---------------------------------------------------------------------------------- registered operators
# What torch.compile traces; eager calls keep TopKRouter.
@torch.library.custom_op("fastplug::moe_router", mutates_args=())
def _router_op(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _router_forward(logits, top_k, normalize)


@_router_op.register_fake
def _(logits, top_k, normalize):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("fastplug::moe_router_backward", mutates_args=())
def _router_backward_op(
    dweights: torch.Tensor, logits: torch.Tensor, index: torch.Tensor, normalize: bool
) -> torch.Tensor:
    return _router_backward(dweights, logits, index, normalize)


@_router_backward_op.register_fake
def _(dweights, logits, index, normalize):
    return torch.empty_like(logits)


def _setup_router(ctx, inputs, output):
    logits, _, normalize = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.normalize = normalize
    ctx.mark_non_differentiable(output[1])


def _router_op_backward(ctx, dweights, _dindex):
    logits, index = ctx.saved_tensors
    return _router_backward_op(dweights, logits, index, ctx.normalize), None, None


_router_op.register_autograd(_router_op_backward, setup_context=_setup_router)
