"""Python's garbage collector while a model is patched: the objects alive at patch time are frozen.

A full collection walks every object the collector tracks. After importing torch, transformers and peft
that is about half a million of them: 0.3 s per full collection on an H100 host (0.9 s on a 2-core
box), paid in the middle of a step whenever the collector decides to. Gemma2-2B LoRA averaged 35 ms per
step of collection, and GC off trained 12% faster (15,260 -> 17,090 tok/s), since its host sets the pace.

`gc.freeze()` moves those objects to a permanent generation that collections skip, and does so again after
the first optimizer step: what that step leaves alive (compiled Triton kernels and their caches, optimizer
states) lives as long as the model. (A Gemma2 run whose first step compiled the kernels still paid one full
collection in eight steps, 33 ms per step on average; the second freeze is meant for that; its effect is not measured.)
Nothing is lost: collections of what training creates go on as before, and the last `release()` (the last restore) calls
`gc.unfreeze()`, so frozen objects that became garbage meanwhile are collected from then on. A process
that froze objects itself before patching keeps its own policy: fastplug then neither freezes nor unfreezes.
"""

from __future__ import annotations

import gc
import threading
from typing import Callable

from ..kernels import state

_lock = threading.Lock()
_holders = 0
_owns_freeze = False  # whether fastplug froze (and so unfreezes)
_armed = False  # whether the next optimizer step freezes once more (set by the first hold, cleared by the step)


def hold() -> Callable[[], None]:
    """Freeze the objects alive now, unless they already are; returns `release`, safe to call twice."""
    global _holders, _owns_freeze, _armed
    with _lock:
        if _holders == 0:
            _owns_freeze = gc.get_freeze_count() == 0
            if _owns_freeze:
                gc.freeze()
                _armed = True
                state.ensure_optimizer_hook()  # patch_model's state.acquire() installs it too
        _holders += 1
    released = False

    def release() -> None:
        nonlocal released
        global _holders, _armed
        with _lock:
            if released:
                return
            released = True
            _holders -= 1
            if _holders == 0 and _owns_freeze:
                _armed = False
                gc.unfreeze()

    return release


def _freeze_after_first_step() -> None:
    """After the first optimizer step of a hold: freeze what that step left alive (then nothing until the next
    first hold). Runs from the kernels' one optimizer hook (fastplug.kernels.state), removed by the last release."""
    global _armed
    if not _armed:
        return
    with _lock:
        if _armed and _holders and _owns_freeze:
            gc.freeze()
        _armed = False


state.on_optimizer_step("patch.host_gc.freeze_after_first_step", _freeze_after_first_step)
