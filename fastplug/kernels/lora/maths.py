"""The forward and backward pieces of projections of one input, on projections already in the compute dtype:
the base GEMM (dense, 4-bit dequantized into the shared buffer, or FP8), the adapter matmuls, dX in one buffer,
the parameters' grads; per projection (`_forward`, `_dy_b`, `_input_grad`, `_param_grads`) or stacked
(`_forward_stacked`, `_grads_stacked`: one GEMM for all bases, one for all adapters' B)."""

from __future__ import annotations

import torch

from ..fp8 import fp8_project, fp8_project_grad, is_fp8
from ..quant import dequantize_4bit_scratch, dequantize_4bit_stacked, is_4bit
from .projections import StackedBase, _Adapters, _StackedAdapters, _weight_shape


def _stacked_weight(stacked: StackedBase, projs, dtype: torch.dtype) -> torch.Tensor:
    """The stacked dense base; 4-bit bases dequantized together into the shared buffer (use it at once)."""
    if stacked.weight is not None:
        return stacked.weight
    return dequantize_4bit_stacked([p.weight for p in projs], dtype)


def _forward_stacked(x2: torch.Tensor, stacked: StackedBase, adapters: _StackedAdapters, projs):
    """([N, sum out_i] outputs side by side, xa [N, R]): three matmuls for any number of projections."""
    xa = x2 @ adapters.a_cat.t()
    b_t = adapters.b_blk.t()
    y = torch.mm(xa, b_t) if stacked.bias is None else torch.addmm(stacked.bias, xa, b_t)
    # the base GEMM adds into y in its epilogue (see `_forward`)
    return y.addmm_(x2, _stacked_weight(stacked, projs, x2.dtype).t()), xa


def _grads_stacked(dy, x2, xa, stacked: StackedBase, adapters: _StackedAdapters, originals, needs, need_x: bool):
    """(dX or None, grads in _flatten's order) from dy [N, sum out_i], the outputs' grads side by side.

    Bases are frozen (no weight or bias grads). The adapter grads are cast to their parameters' dtype once
    for all projections (autograd would cast each one), then sliced."""
    dyb = dy @ adapters.b_blk  # [N, R]: each slice only sees its own projection (the blocks are diagonal)
    dx = None
    if need_x:
        dx = dyb @ adapters.a_cat
        dx.addmm_(dy, _stacked_weight(stacked, originals, dy.dtype))
    need_a = any(needs[4 * i + 2] for i in range(len(originals)))
    need_b = any(needs[4 * i + 3] for i in range(len(originals)))
    da = (dyb.t() @ x2).to(next(p.lora_A.dtype for p in originals if p.lora_A is not None)) if need_a else None
    scalings = {p.scaling for p, sl in zip(originals, adapters.slices) if sl is not None}
    same_scaling = len(scalings) == 1
    db = None
    if need_b:  # [sum out_i, R]; only the diagonal blocks are used
        db = _mm_scaled(dy.t(), xa, scalings.pop()) if same_scaling else dy.t() @ xa
        db = db.to(next(p.lora_B.dtype for p in originals if p.lora_B is not None))
    grads, row = [], 0
    for i, (p, sl) in enumerate(zip(originals, adapters.slices)):
        out = _weight_shape(p.weight)[0]
        grads += [None, None]
        grads.append(da[sl[0] : sl[1]] if sl is not None and needs[4 * i + 2] else None)
        if sl is not None and needs[4 * i + 3]:
            block = db[row : row + out, sl[0] : sl[1]]
            grads.append(block if same_scaling else block * p.scaling)
        else:
            grads.append(None)
        row += out
    return dx, grads


def _dense(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense matrix in dtype: a 4-bit weight in the shared buffer (valid until the next
    dequantization: use it in the very next matmul), any other weight as it is."""
    return dequantize_4bit_scratch(w, dtype) if is_4bit(w) else w


def _base_mm(a: torch.Tensor, w: torch.Tensor, *, grad: bool = False, out=None, bias=None, quantized=None):
    """a @ W^T + bias (grad: a @ W, the dX term), added into `out` when given (its read then happens in the
    matmul's epilogue). FP8 weights take their block-scaled GEMM, sharing a's quantization through `quantized`."""
    if is_fp8(w):
        if grad:
            return fp8_project_grad(a, w, out=out)
        return fp8_project(a, w, bias=bias, out=out, quantized=quantized)
    dense = _dense(w, a.dtype)
    dense = dense if grad else dense.t()
    if out is not None:
        return out.addmm_(a, dense)
    return a @ dense if bias is None else torch.addmm(bias, a, dense)


def _mm_scaled(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * a @ b in one matmul (beta=0: the fresh buffer's contents are never read)."""
    if alpha == 1.0:  # lora_alpha == r, a common set-up: one call less on the host
        return a @ b
    return a.new_empty((a.shape[0], b.shape[1])).addmm_(a, b, beta=0.0, alpha=alpha)


def _forward(x2: torch.Tensor, projs, adapters: _Adapters | None, out: list | None = None):
    """Outputs [N, out_i] of projections of one input x2 [N, in], and xa = x2 @ a_cat^T [N, R] (or None).
    out: dense bases only, a [N, out_i] block (unit last stride) per projection to write instead of new buffers.

    With an adapter, the small LoRA matmul writes y first (bias included) and the base matmul adds into it:
    the read of y then happens in the epilogue of a compute-bound matmul, where it is nearly free, instead
    of in a memory-bound read-modify-write of y by the small one.
    """
    xa = x2 @ adapters.a_cat.t() if adapters is not None else None  # one read of x for all adapters
    ys, quantized = [], {}
    for i, p in enumerate(projs):
        sl = adapters.slices[i] if adapters is not None else None
        block = None if out is None else out[i]
        if sl is None:
            if block is None:
                ys.append(_base_mm(x2, p.weight, bias=p.bias, quantized=quantized))
            else:
                ys.append(
                    torch.mm(x2, p.weight.t(), out=block)
                    if p.bias is None
                    else torch.addmm(p.bias, x2, p.weight.t(), out=block)
                )
            continue
        xa_i, b_t = xa[:, sl[0] : sl[1]], p.lora_B.t()
        if block is None:
            y = _mm_scaled(xa_i, b_t, p.scaling) if p.bias is None else torch.addmm(p.bias, xa_i, b_t, alpha=p.scaling)
        elif p.bias is None:  # beta=0: the block's old contents are never read
            y = block.addmm_(xa_i, b_t, beta=0.0, alpha=p.scaling)
        else:
            y = torch.addmm(p.bias, xa_i, b_t, alpha=p.scaling, out=block)
        ys.append(_base_mm(x2, p.weight, out=y, quantized=quantized))
    return ys, xa


def _dy_b(dys, projs, adapters: _Adapters | None):
    """[N, R]: s_i * dY_i @ B_i side by side, the adapters' grad w.r.t. xa; shared by dX and dA."""
    if adapters is None:
        return None
    dyb = dys[0].new_empty((dys[0].shape[0], adapters.a_cat.shape[0]))
    for dy, p, sl in zip(dys, projs, adapters.slices):
        if sl is not None:
            dyb[:, sl[0] : sl[1]].addmm_(dy, p.lora_B, beta=0.0, alpha=p.scaling)
    return dyb


def _input_grad(dys, projs, adapters: _Adapters | None, dyb) -> torch.Tensor:
    """dX = dyb @ a_cat + sum_i dY_i W_i in one buffer; the small matmul first, so that the large ones add
    into it in their epilogues (see `_forward`)."""
    pairs = list(zip(dys, (p.weight for p in projs)))
    if adapters is not None:
        pairs.insert(0, (dyb, adapters.a_cat))
    dx = _base_mm(*pairs[0], grad=True)
    for dy, w in pairs[1:]:
        _base_mm(dy, w, grad=True, out=dx)
    return dx


def _param_grads(x2, xa, dys, dyb, projs, adapters: _Adapters | None, needs) -> list:
    """Grads of (weight, bias, lora_A, lora_B) per projection, in _flatten's order; None where not needed."""
    need_a = adapters is not None and any(needs[4 * i + 2] for i in range(len(projs)))
    da_cat = dyb.t() @ x2 if need_a else None  # [R, in]: every dA_i in one matmul
    grads = []
    for i, (dy, p) in enumerate(zip(dys, projs)):
        need_w, need_b, need_ai, need_bi = needs[4 * i : 4 * i + 4]
        sl = adapters.slices[i] if adapters is not None else None
        grads.append(dy.t() @ x2 if need_w else None)
        grads.append(dy.sum(0) if need_b and p.bias is not None else None)
        grads.append(da_cat[sl[0] : sl[1]] if need_ai and sl is not None else None)
        grads.append(_mm_scaled(dy.t(), xa[:, sl[0] : sl[1]], p.scaling) if need_bi and sl is not None else None)
    return grads
