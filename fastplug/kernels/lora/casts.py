"""The adapters' compute-dtype copies and their caches: each parameter's cast (`_CAST_CACHE`, refreshed for all
stale adapters at once by one foreach copy per shape) and the stacked adapters' matrices (`_STACKED_ADAPTERS`),
both valid for one generation: `invalidate_adapter_casts` starts the next (after each optimizer step, at each
forward of a patched model). Neither is used while a CUDA graph is captured (`adapters_cacheable`).

`_generation` is rebound here: other modules read it as `casts._generation`, never through
`from .casts import _generation` (a copy of the value at import). The functions that read it live here."""

from __future__ import annotations

import weakref

import torch

from .. import state
from ..fp8 import is_fp8
from ..quant import is_4bit
from .projections import _adapters, _StackedAdapters, _weight_shape


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


def adapters_cacheable(x: torch.Tensor) -> bool:
    """False while x's stream is being captured into a CUDA graph (fastplug's layer graphs, `torch.cuda.graph`,
    torch.compile's "reduce-overhead") or the call is traced by torch.compile: a replay or a compiled graph runs
    no Python, so a cached copy read by it would never be refreshed; the casts and stacks are then recorded into
    the graph and redone at each run."""
    return not (torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()))


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


def _cast_param(t: torch.Tensor | None, dtype: torch.dtype, cache: bool) -> torch.Tensor | None:
    if t is None or t.dtype == dtype:
        return t
    if cache:
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
    if not cache:
        return t.to(dtype)
    _refresh_casts(t, dtype)
    return _CAST_CACHE[id(t)].cast


def _cast_params(params, dtype: torch.dtype, cache: bool) -> list:
    """The parameters in the compute dtype, cast inside the autograd function rather than before it: a
    `.to` outside would add an autograd node per tensor per call (peft keeps adapters in fp32 next to a
    bf16 base by default), and its Python cost per step is what a LoRA step is short of. Backward returns
    grads in the compute dtype; autograd casts each to its parameter's dtype. cache: `adapters_cacheable`."""
    return [_cast_param(t, dtype, cache) for t in params]


# ------------------------------------------------------------------------------------ stacked adapters


# (ids of the adapters' parameters, dtype) -> (weakrefs to them, their versions, _StackedAdapters); emptied
# with each new generation (`invalidate_adapter_casts`), so it holds the current step's matrices and nothing
# older. The weakrefs tell a hit from a dead adapter's entry whose ids new parameters reuse (no generation
# passes between two calls of the fused ops outside a patched model).
_STACKED_ADAPTERS: dict[tuple, tuple] = state.register_cache("lora.stacked_adapters", {})


def _stacked_adapters(originals, casts, dtype: torch.dtype, cache: bool) -> _StackedAdapters:
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
    hit = _STACKED_ADAPTERS.get(key) if cache else None
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
    if cache:
        _STACKED_ADAPTERS[key] = ([weakref.ref(t) for t in adapter_params], versions, built)
    return built


def _group_adapters(originals, casts, stacked, dtype: torch.dtype, cache: bool):
    """The adapter matrices of one group of projections: stacked (keyed by the originals) where its bases are
    stacked, else per projection."""
    return _stacked_adapters(originals, casts, dtype, cache) if stacked is not None else _adapters(casts)
