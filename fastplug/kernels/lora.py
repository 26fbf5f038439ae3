"""Fused LoRA projections: a LoRA linear, a LoRA QKV block and a LoRA MLP, each one autograd node.

A projection is y = x W^T + b + s * (x A^T) B^T. In plain peft that is three matmuls, a scale and two adds,
each its own autograd node saving its own inputs. Here the whole block is one torch.autograd.Function with a
hand-derived backward:

- the adapter term s * (x A^T) B^T is one matmul with alpha=s writing y, and the base matmul adds into it
  (no separate scale or add kernels, and y is read only in the big matmul's epilogue);
- projections that read the same x (q/k/v, gate/up) compute x A^T for all their adapters in one matmul on
  cat(A_1, A_2, ...) (ranks may differ), and in backward one matmul gives the adapters' share of dX and
  one gives every dA;
- dX is accumulated in one buffer (addmm_ with beta=1 for each contribution, the small one first);
- parameters are kept on ctx, not saved tensors (no checkpointing hooks for them), version-checked;
- the MLP saves only x and the gate/up outputs (plus the small [N, r] x A^T): the activation is recomputed
  in backward by `glu_backward`, which writes h, dgate and dup into buffers this function owns.

A base weight may be a frozen bitsandbytes 4-bit weight (QLoRA): it is dequantized by
`fastplug.kernels.quant` into one buffer shared by all layers just before each matmul that reads it, once
in forward and once more in backward for dX (never saved; no dW: 4-bit weights are frozen).
A base weight may also be a frozen FP8 block-scaled weight (`fastplug.kernels.fp8.fp8_parameter`): its forward
term runs on the FP8 GEMM (the input quantized once for all projections that read it), its dX term through
the weight dequantized into that shared buffer.

Matmuls run in the input dtype with fp32 accumulation (what torch's matmul does). The LoRA maths is plain
torch; the MLP activation uses the Triton kernels of `fastplug.kernels.activations`. Knows nothing of peft.

Under torch.compile (while Dynamo traces) the blocks are registered operators (`fastplug::lora_projections`,
`fastplug::lora_mlp` and their backward) that run the same forward and backward code, opaque to the compiler;
bases that patching stacked are found stacked in memory. Quantized bases keep the eager function (a graph
break).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from . import state
from ._utils import (
    check_dtype,
    check_same_device,
    compute_dtype,
    keep_for_backward,
    kept_for_backward,
    no_autocast,
    promote_types,
    rows_view,
    use_triton,
)
from .activations import ACTIVATIONS, glu_backward, glu_forward
from .fp8 import fp8_project, fp8_project_grad, is_fp8
from .quant import dequantize_4bit_scratch, dequantize_4bit_stacked, is_4bit, shape_4bit
from .rope import rope, rope_projections


class LoRAProjection(NamedTuple):
    """One linear layer with an optional LoRA adapter: y = x W^T + b + scaling * (x A^T) B^T."""

    weight: torch.Tensor  # [out, in]; frozen (LoRA) or trainable (full fine-tuning); or a bnb 4-bit / FP8 weight
    bias: torch.Tensor | None  # [out]
    lora_A: torch.Tensor | None  # [r, in]; None: plain linear
    lora_B: torch.Tensor | None  # [out, r]
    scaling: float


class StackedBase(NamedTuple):
    """The frozen base weights (and biases) of projections that read one input, as row blocks of one matrix:
    projection i's weight IS rows [o_i, o_i + out_i) of `weight`, in the same storage (`fastplug.models.stacking`
    arranges that). The blocks then run one GEMM for every base and one for every adapter's B.
    weight None: the bases are bitsandbytes 4-bit weights (no biases), dequantized together into the shared
    buffer right before each GEMM that reads them (`quant.dequantize_4bit_stacked`)."""

    weight: torch.Tensor | None  # [sum out_i, in]
    bias: torch.Tensor | None  # [sum out_i], each projection's bias a block of it; None: no projection has one


QUANTIZED_STACK = StackedBase(None, None)


# --------------------------------------------------------------------------------------------- checks


def _weight_shape(w: torch.Tensor) -> tuple:
    return shape_4bit(w) if is_4bit(w) else tuple(w.shape)


def _check_projection(name: str, proj, x: torch.Tensor, in_features=None, out_features=None) -> None:
    """proj must fit an input x [..., in_features] (default: x's last dim); raises ValueError naming it."""
    if not isinstance(proj, LoRAProjection):
        raise ValueError(f"{name} must be a LoRAProjection; got {type(proj).__name__}")
    in_features = x.shape[-1] if in_features is None else in_features
    w = proj.weight
    shape = _weight_shape(w)
    if len(shape) != 2 or shape[1] != in_features:
        raise ValueError(f"{name}.weight must have shape [out, {in_features}]; got {shape}")
    out = shape[0]
    if out_features is not None and out != out_features:
        raise ValueError(f"{name}.weight must have {out_features} output features; got {shape}")
    if w.requires_grad and (is_4bit(w) or is_fp8(w)):
        raise ValueError(f"{name}.weight is a quantized weight that requires grad; quantized bases must be frozen")
    if proj.bias is not None and tuple(proj.bias.shape) != (out,):
        raise ValueError(f"{name}.bias must have shape ({out},); got {tuple(proj.bias.shape)}")
    a, b = proj.lora_A, proj.lora_B
    if (a is None) != (b is None):
        raise ValueError(f"{name}.lora_A and {name}.lora_B must be both given or both None")
    if a is not None:
        if a.dim() != 2 or a.shape[1] != in_features:
            raise ValueError(f"{name}.lora_A must have shape [r, {in_features}]; got {tuple(a.shape)}")
        if tuple(b.shape) != (out, a.shape[0]):
            raise ValueError(f"{name}.lora_B must have shape ({out}, {a.shape[0]}); got {tuple(b.shape)}")
        if not isinstance(proj.scaling, (int, float)):
            raise ValueError(f"{name}.scaling must be a Python number; got {type(proj.scaling).__name__}")
    device = x.device
    for t in proj[:4]:  # a loop, not any(genexpr): this runs for every projection of every layer
        if t is not None and t.device != device:  # the message is built only on failure
            check_same_device(x=x, **{f"{name}.{k}": getattr(proj, k) for k in ("weight", "bias", "lora_A", "lora_B")})


def _block_ptr(t: torch.Tensor, row: int) -> int:
    return t.data_ptr() + row * t.stride(0) * t.element_size()


def is_stacked(stacked: StackedBase, weights, biases) -> bool:
    """Whether `weights` (and `biases`) are, in order, the row blocks of `stacked` (same storage)."""
    w, b, row = stacked.weight, stacked.bias, 0
    for weight, bias in zip(weights, biases):
        if (
            weight.dim() != 2
            or weight.stride() != w.stride()
            or weight.shape[1] != w.shape[1]
            or weight.data_ptr() != _block_ptr(w, row)
            or (bias is None) != (b is None)
            or (b is not None and bias.data_ptr() != _block_ptr(b, row))
        ):
            return False
        row += weight.shape[0]
    return row == w.shape[0]


def _check_stacked(stacked, projs, x: torch.Tensor) -> None:
    if not isinstance(stacked, StackedBase):
        raise ValueError(f"stacked must be a StackedBase or None; got {type(stacked).__name__}")
    if stacked.weight is None:
        if stacked.bias is not None or not all(is_4bit(p.weight) and p.bias is None for p in projs):
            raise ValueError("a StackedBase without weight stands for 4-bit bases without biases")
        return
    if any(is_4bit(p.weight) or is_fp8(p.weight) or p.weight.requires_grad for p in projs):
        raise ValueError("stacked bases must be frozen dense weights (not quantized, no grad)")
    if not is_stacked(stacked, [p.weight for p in projs], [p.bias for p in projs]):
        raise ValueError(
            "stacked.weight (and .bias) must hold the projections' weights (biases) as consecutive "
            "row blocks, in the same storage"
        )
    check_same_device(x=x, **{"stacked.weight": stacked.weight})


class _Cast:
    """The compute-dtype copy of one parameter; updated in place when the parameter moves, so that a step
    allocates no new Python objects for it (fewer objects to promote means fewer full GC passes)."""

    __slots__ = ("ref", "version", "generation", "dtype", "cast")

    def __init__(self, ref: weakref.ref):
        self.ref = ref  # the parameter; its callback drops this entry when the parameter dies
        self.version = -1  # the parameter's version when `cast` was made
        self.generation = -1  # _generation when `cast` was made
        self.dtype = None
        self.cast = None


# id(param) -> _Cast. Checkpointing runs each forward twice per step; the copy made by the first serves the
# recompute. Keyed by id because tensors compare elementwise.
_CAST_CACHE: dict[int, _Cast] = state.register_cache("lora.adapter_casts", {})

# A copy is valid while its parameter's version AND this generation are what they were when it was made.
# The version alone misses writers that bypass autograd's counter: fused AdamW (the HF Trainer's default),
# bitsandbytes' 8-bit and paged optimizers, writes through `.data`. So the generation moves after every
# torch optimizer step (`state`'s one post-step hook, installed by patch_model or on first use) and whenever
# `invalidate_adapter_casts()` is called: a patched model calls it at the start of each forward.
_generation = 0
# False while a CUDA graph is captured (`uncached_adapters`): a replay runs no Python, so a cached copy read by a
# graph would never be refreshed; the casts and stacks are then recorded into the graph and redone at each replay.
_caching = True


@contextlib.contextmanager
def uncached_adapters():
    """Within: the fused LoRA ops cast and stack adapters at every call instead of reusing cached copies."""
    global _caching
    previous, _caching = _caching, False
    try:
        yield
    finally:
        _caching = previous


def invalidate_adapter_casts(*_) -> None:
    """Make every cached adapter copy stale: the next fused LoRA call recasts them all (one foreach copy).

    Called after each optimizer step and at each forward of a patched model; call it yourself after writing
    adapter parameters in a way autograd does not see, between calls of the fused ops outside a patched model.
    """
    global _generation
    _generation += 1
    _STACKED_ADAPTERS.clear()


state.on_optimizer_step("lora.invalidate_adapter_casts", invalidate_adapter_casts)


def _watch_optimizers() -> None:
    state.ensure_optimizer_hook()


def _is_current(entry: _Cast, p: torch.Tensor) -> bool:
    return entry.version == p._version and entry.generation == _generation


def _refresh_casts(t: torch.Tensor, dtype: torch.dtype) -> None:
    """Cast t, and with it every cached param of its device whose copy is no longer current.

    An optimizer step moves every adapter at once: refreshing them together is one allocation and one
    foreach copy per shape, instead of a launch per adapter per step (a Llama-1B LoRA has 224 adapters of 7
    shapes); the copies of one shape are `unbind` of one buffer, so the host issues a handful of ops, not
    two per adapter. The copies go into new buffers, never into the old copies, which a graph not yet
    backpropagated may still hold."""
    _watch_optimizers()
    key = id(t)
    entry = _CAST_CACHE.get(key)
    if entry is None or entry.ref() is not t:
        entry = _CAST_CACHE[key] = _Cast(weakref.ref(t, lambda _, key=key: _CAST_CACHE.pop(key, None)))
    stale = [(t, entry)]
    for other in _CAST_CACHE.values():
        p = other.ref()
        if p is not None and p is not t and other.dtype == dtype and p.device == t.device and not _is_current(other, p):
            if p.untyped_storage().nbytes():  # FSDP2 frees a gathered parameter's storage between uses
                stale.append((p, other))
    by_shape: dict[tuple, list] = {}
    for p, other in stale:
        by_shape.setdefault(tuple(p.shape), []).append((p, other))
    with torch.no_grad():
        for shape, group in by_shape.items():
            casts = torch.empty((len(group), *shape), dtype=dtype, device=t.device).unbind(0)
            torch._foreach_copy_(casts, [p for p, _ in group])
            for (p, other), cast in zip(group, casts):
                other.version, other.generation, other.dtype, other.cast = p._version, _generation, dtype, cast


def _cast_param(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None or t.dtype == dtype:
        return t
    if _caching:
        hit = _CAST_CACHE.get(id(t))  # a hit is checked inline: this runs for every adapter of every layer
        if (
            hit is not None
            and hit.ref() is t
            and hit.dtype == dtype
            and hit.version == t._version
            and hit.generation == _generation
        ):
            return hit.cast
    if is_4bit(t) or is_fp8(t):  # quantized weights: converted where read
        return t
    if not _caching:
        return t.to(dtype)
    _refresh_casts(t, dtype)
    return _CAST_CACHE[id(t)].cast


def _cast_params(params, dtype: torch.dtype) -> list:
    """The parameters in the compute dtype, cast inside the autograd function rather than before it: a
    `.to` outside would add an autograd node per tensor per call (peft keeps adapters in fp32 next to a
    bf16 base by default), and its Python cost per step is what a LoRA step is short of. Backward returns
    grads in the compute dtype; autograd casts each to its parameter's dtype."""
    return [_cast_param(t, dtype) for t in params]


def _flatten(projs) -> list:
    return [t for p in projs for t in (p.weight, p.bias, p.lora_A, p.lora_B)]


def _unflatten(params, scalings) -> list[LoRAProjection]:
    return [LoRAProjection(*params[4 * i : 4 * i + 4], s) for i, s in enumerate(scalings)]


# ------------------------------------------------------------------------- forward / backward pieces


class _Adapters(NamedTuple):
    """The adapters of projections sharing one input, side by side along the rank dimension."""

    a_cat: torch.Tensor  # [R, in] = cat of the present lora_A (the tensor itself when there is one)
    slices: list  # per projection: its (start, stop) in R, or None without adapter


def _adapters(projs) -> _Adapters | None:
    present = [p.lora_A for p in projs if p.lora_A is not None]
    if not present:
        return None
    slices, start = [], 0
    for p in projs:
        if p.lora_A is None:
            slices.append(None)
        else:
            slices.append((start, start + p.lora_A.shape[0]))
            start += p.lora_A.shape[0]
    a_cat = present[0] if len(present) == 1 else torch.cat(present)
    return _Adapters(a_cat, slices)


class _StackedAdapters(NamedTuple):
    """The adapters of stacked projections as two matrices (compute dtype), rebuilt once per generation."""

    a_cat: torch.Tensor  # [R, in]: the present lora_A side by side along the rank
    b_blk: torch.Tensor  # [sum out_i, R]: scaling_i * B_i on the diagonal blocks, zeros elsewhere
    slices: list  # per projection: its (start, stop) in R, or None without adapter


# (ids of the adapters' parameters, dtype) -> (weakrefs to them, their versions, _StackedAdapters); emptied
# with each new generation (`invalidate_adapter_casts`), so it holds the current step's matrices and nothing
# older. The weakrefs tell a hit from a dead adapter's entry whose ids new parameters reuse (no generation
# passes between two calls of the fused ops outside a patched model).
_STACKED_ADAPTERS: dict[tuple, tuple] = state.register_cache("lora.stacked_adapters", {})


def _stacked_adapters(originals, casts, dtype: torch.dtype) -> _StackedAdapters:
    """originals: the projections as the caller passed them (versions and ids of their adapters key the
    cache); casts: the same in the compute dtype. A zero block stands in for a projection without adapter."""
    # loops, not generator expressions: this runs twice per layer per step (the host sets the pace)
    adapter_params, ids, versions = [], [], []
    for p in originals:
        for t in (p.lora_A, p.lora_B):
            if t is not None:
                adapter_params.append(t)
                ids.append(id(t))
                versions.append(t._version)
    key, versions = (*ids, dtype), tuple(versions)
    hit = _STACKED_ADAPTERS.get(key) if _caching else None
    if hit is not None and hit[1] == versions:
        for ref, t in zip(hit[0], adapter_params):
            if ref() is not t:
                break
        else:
            return hit[2]
    adapters = _adapters(casts)
    # one block_diag (a single op for the host, however many projections); a [out, 0] block stands for a
    # projection without adapter. With one scaling for all (peft's default) it is applied once to the whole.
    blocks = [
        p.lora_B if p.lora_A is not None else adapters.a_cat.new_empty((_weight_shape(p.weight)[0], 0)) for p in casts
    ]
    scalings = {p.scaling for p in casts if p.lora_A is not None}
    if len(scalings) == 1:
        b_blk = torch.block_diag(*blocks).mul_(scalings.pop())
    else:
        b_blk = torch.block_diag(*(b * p.scaling if p.lora_A is not None else b for b, p in zip(blocks, casts)))
    built = _StackedAdapters(adapters.a_cat, b_blk, adapters.slices)
    if _caching:
        _STACKED_ADAPTERS[key] = ([weakref.ref(t) for t in adapter_params], versions, built)
    return built


def _group_adapters(originals, casts, stacked, dtype: torch.dtype):
    """The adapter matrices of one group of projections: stacked (keyed by the originals) where its bases are
    stacked, else per projection."""
    return _stacked_adapters(originals, casts, dtype) if stacked is not None else _adapters(casts)


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


# -------------------------------------------------------------------------------- autograd functions


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
    projs = _unflatten(_cast_params(params, x.dtype), scalings)
    outs = [_weight_shape(p.weight)[0] for p in projs]
    y = None
    with no_autocast(x):
        adapters = _group_adapters(originals, projs, stacked, x.dtype)
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
    gate_p, up_p, down_p = projs = _unflatten(_cast_params(params, x.dtype), scalings)
    down_adapters = _adapters([down_p])
    width = _weight_shape(gate_p.weight)[0]
    with no_autocast(x):
        gu_adapters = _group_adapters(originals, [gate_p, up_p], stacked, x.dtype)
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


# ------------------------------------------------------------------------------- registered operators
# What torch.compile traces for dense bases: the autograd nodes' forward and hand-written backward, opaque to
# the compiler (the cast cache and the stacked adapters are Python-side state). Outputs that lie side by side
# in one buffer come out as that buffer (an operator's outputs may not alias each other); the traced wrapper
# splits it. The bases are stacked when their weights already lie as row blocks of one matrix (patching
# stacks them before anything compiles); grads come in the parameters' dtypes.


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
    cast = _unflatten(_cast_params(params, x.dtype), scalings)
    fwd = _Projected(
        None, None, xa if xa.shape[1] else None, _group_adapters(projs, cast, stacked, x.dtype), cast, projs
    )
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
    cast = _unflatten(_cast_params(params, x.dtype), scalings)
    adapters = (_group_adapters(projs[:2], cast[:2], stacked, x.dtype), _adapters(cast[2:]))
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


# --------------------------------------------------------------------------------------- public API


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
