"""Every piece of process-wide state the kernels keep, in one registry.

The kernels cache what is costly to rebuild per call (adapter casts, unpacked 4-bit weights, pointer tables,
scratch buffers, launch checks) and need to hear of optimizer steps (cached adapter casts go stale when an
optimizer writes the parameters behind autograd's back). Both are declared here, not hidden in the modules:

- `register_cache(name, cache)`: a dict (or anything with `clear()`, or an `functools.cache`d function) that
  the kernels may fill. `clear_caches()` empties every one; `cached_tensors()` counts the tensors they hold.
- `on_optimizer_step(name, fn)`: `fn()` runs after every `torch.optim.Optimizer.step` while the hook is
  installed. One global torch hook serves every callback, and this module owns it.
- `acquire()` / `release()`: ref-counted. The first acquire installs the optimizer hook; the last release
  removes it and empties every cache. `patch_model` acquires, its handle's `restore()` releases.

The functional ops also work without a patch: a fused LoRA call installs the hook on first use
(`ensure_optimizer_hook`), as the ops always did; a later last `release()` removes it again.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_lock = threading.RLock()
_caches: dict[str, Any] = {}
_step_callbacks: dict[str, Callable[[], None]] = {}
_holders = 0
_hook_handle = None  # torch's RemovableHandle of the one global optimizer post-step hook
_optimizer_steps = 0


def register_cache(name: str, cache):
    """Declare a kernel-side cache (returned unchanged, so `_X = state.register_cache("mod.x", {})` reads well)."""
    if not (hasattr(cache, "clear") or hasattr(cache, "cache_clear")):
        raise ValueError(f"cache {name!r} must have clear() or cache_clear(); got {type(cache).__name__}")
    _caches[name] = cache
    return cache


def caches() -> dict[str, Any]:
    """name -> cache, every registered cache (a copy of the registry)."""
    return dict(_caches)


def clear_caches() -> None:
    for cache in list(_caches.values()):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
        else:
            cache.clear()


def _tensors_in(obj, seen: set, depth: int = 0) -> int:
    if depth > 6 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors_in(k, seen, depth + 1) + _tensors_in(v, seen, depth + 1) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_tensors_in(v, seen, depth + 1) for v in obj)
    slots = getattr(type(obj), "__slots__", ())
    fields = [getattr(obj, s, None) for s in slots] + list(getattr(obj, "__dict__", {}).values())
    return sum(_tensors_in(v, seen, depth + 1) for v in fields)


def cached_tensors() -> dict[str, int]:
    """name -> number of tensors a cache holds (entries only; an lru-cached function counts its entries)."""
    out = {}
    for name, cache in _caches.items():
        if hasattr(cache, "cache_info"):
            out[name] = cache.cache_info().currsize
        else:
            out[name] = _tensors_in(dict(cache) if isinstance(cache, dict) else cache, set())
    return out


def on_optimizer_step(name: str, fn: Callable[[], None]) -> None:
    """Run fn() after every optimizer step while the hook is installed (kept across acquire/release)."""
    _step_callbacks[name] = fn


def optimizer_steps() -> int:
    """Optimizer steps seen while the hook was installed (the counter adapters and checkpointing read)."""
    return _optimizer_steps


def _after_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    for fn in list(_step_callbacks.values()):
        fn()


def ensure_optimizer_hook() -> None:
    """Install the one optimizer post-step hook if it is not installed (idempotent)."""
    global _hook_handle
    if _hook_handle is None:
        with _lock:
            if _hook_handle is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                _hook_handle = register_optimizer_step_post_hook(_after_step)


def hook_installed() -> bool:
    return _hook_handle is not None


def _remove_optimizer_hook() -> None:
    global _hook_handle
    if _hook_handle is not None:
        _hook_handle.remove()
        _hook_handle = None


def acquire() -> None:
    """One more user of the kernels' state (patch_model): installs the optimizer hook on the first."""
    global _holders
    with _lock:
        _holders += 1
        ensure_optimizer_hook()


def release() -> None:
    """One user fewer (restore()); the last removes the optimizer hook and empties every cache. A release
    without a matching acquire is an error: it would drop state another patched model still uses."""
    global _holders
    with _lock:
        if _holders <= 0:
            raise RuntimeError("fastplug.kernels.state.release() without a matching acquire()")
        _holders -= 1
        if _holders == 0:
            _remove_optimizer_hook()
            clear_caches()


def holders() -> int:
    return _holders


def reset() -> None:
    """Back to nothing held, no hook, every cache empty, whatever the count (tests)."""
    global _holders
    with _lock:
        _holders = 0
        _remove_optimizer_hook()
        clear_caches()
