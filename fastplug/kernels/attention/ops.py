"""How autograd and torch.compile reach the kernels: the autograd Function `FlashAttention` that eager calls
take (the cheaper one), and the registered operators `fastplug::flash_attention` and
`fastplug::flash_attention_backward` with their fake (meta) implementations and autograd registration, which
torch.compile traces."""

from __future__ import annotations

import torch

from .backward import _flash_backward
from .config import _problem
from .forward import _flash_forward


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem, start, end, sinks=None):  # backward's extra None is dropped without sinks
        out, lse = _flash_forward(q, k, v, problem, start, end, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.problem, ctx.bounds = problem, (start, end)  # int32 bounds: no grads, never written in place
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = _flash_backward(do, q, k, v, out, lse, ctx.problem, *ctx.bounds, sinks=sinks)
        return dq, dk, dv, None, None, None, dsinks if ctx.needs_input_grad[6:7] == (True,) else None


@torch.library.custom_op(
    "fastplug::flash_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, int? window, float? softcap, float scale, Tensor? doc_start, "
    "Tensor? doc_end, Tensor? sinks) -> (Tensor, Tensor)",
)
def _flash_attention_op(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks):
    problem = _problem(q, k, causal, window, softcap, scale)
    out, lse = _flash_forward(q, k, v, problem, doc_start, doc_end, sinks=sinks)
    return out, lse


@_flash_attention_op.register_fake
def _(q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks):
    B, Hq, T, D = q.shape
    return q.new_empty((B, T, Hq, D)), q.new_empty((B, Hq, T), dtype=torch.float32)


@torch.library.custom_op(
    "fastplug::flash_attention_backward",
    mutates_args=(),
    schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, int? window, "
    "float? softcap, float scale, Tensor? doc_start, Tensor? doc_end, Tensor? sinks) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _flash_attention_backward_op(do, q, k, v, out, lse, causal, window, softcap, scale, doc_start, doc_end, sinks):
    problem = _problem(q, k, causal, window, softcap, scale)
    dq, dk, dv, dsinks = _flash_backward(do, q, k, v, out, lse, problem, doc_start, doc_end, sinks=sinks)
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks  # operators return tensors, not None


@_flash_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, causal, window, softcap, scale, doc_start, doc_end, sinks):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_flash_attention(ctx, inputs, output):
    q, k, v, causal, window, softcap, scale, doc_start, doc_end, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, doc_start, doc_end, sinks)
    ctx.problem = (causal, window, softcap, scale)


def _flash_attention_op_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, doc_start, doc_end, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attention_backward_op(
        grad_out, q, k, v, out, lse, *ctx.problem, doc_start, doc_end, sinks
    )
    return dq, dk, dv, None, None, None, None, None, None, dsinks if sinks is not None else None


_flash_attention_op.register_autograd(_flash_attention_op_backward, setup_context=_setup_flash_attention)
