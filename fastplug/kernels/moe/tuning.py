"""Launch configurations of the grouped GEMM kernels: autotuned per (device, dtype, N, K, experts, row
bucket, variant) and cached on disk, so the second process starts tuned. A config is block sizes, warps,
stages and the launch path ("ptr", "tma", "torch", "split": see grouped_gemm's docstring); the variant
names what the launch fuses (gathered rows, scattered rows, routing weights, LoRA, whether gu is stored)
and whether torch._grouped_mm may run it.

- Candidates are pruned before any is compiled: those whose pipelined tiles do not fit the device's shared
  memory (read from the device) and those with blocks far larger than the shape.
- Each candidate is timed for 100 ms (median): fewer repeats let the winners move between runs
  (docs/benchmarks/kernels.md, "MoE").
- The winners live in one JSON file, `$FASTPLUG_MOE_TUNE_CACHE` or `<user cache dir>/fastplug/moe_tuning.json`,
  under the key "<device name>|triton <version>": another GPU or another Triton never reads them.
- `FASTPLUG_MOE_AUTOTUNE=0` (or `set_autotune(False)`) turns tuning off: every launch takes the default
  config and the cache is neither read nor written.
- Under CUDA graph capture or torch.compile tracing nothing is timed: the cached or default config is used.
- A row bucket within a factor of four of a tuned one, or smaller than one, takes that one's config instead of
  being timed (`_neighbour`): on variable-length batches a new length would otherwise stall its training step
  for seconds.

This module knows the candidates and the cache, never the kernels: grouped_gemm imports it, and times
candidates through the `run` callable it passes (`grouped_gemm.sweep` times them all for the bench).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import triton

from .._utils import interpreter_enabled, next_power_of_2

KINDS = ("fwd", "dw", "glu")
IMPLS = ("ptr", "tma", "torch", "split")

# kind -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, impl). For dw, BLOCK_M is the reduction step
# over an expert's rows and BLOCK_N x BLOCK_K the tile of dW it owns. impl: "ptr" loads every tile through
# pointers; "tma" loads the weight tiles (and the rows, where they are not gathered) with tensor
# descriptors, Hopper's bulk copies (falls back to pointers where strides do not allow it); "torch" runs
# torch._grouped_mm (CUTLASS on Hopper) on gathered rows, then scales and scatters them in one pass.
_TORCH = (0, 0, 0, 0, 0, "torch")
_SPLIT = (0, 0, 0, 0, 0, "split")  # glu only: the tuned gate_up GEMM, then the activation as its own pass
_BLOCKLESS = ("torch", "split")  # impls whose tiles are not ours: never pruned by size
CANDIDATES = {
    "fwd": [
        (128, 128, 64, 8, 3, "ptr"),
        (128, 256, 64, 8, 3, "ptr"),
        (128, 128, 64, 4, 4, "ptr"),
        (64, 128, 64, 4, 4, "ptr"),
        (128, 256, 64, 8, 3, "tma"),
        (128, 256, 64, 8, 4, "tma"),
        (128, 128, 64, 8, 4, "tma"),
        (128, 128, 64, 4, 4, "tma"),
        (64, 256, 64, 4, 3, "tma"),
        _TORCH,
        # narrow outputs: the rank-r LoRA products
        (128, 16, 128, 4, 3, "ptr"),
        (64, 32, 128, 4, 4, "ptr"),
    ],
    "dw": [
        (64, 128, 128, 8, 3, "ptr"),
        (32, 128, 128, 8, 4, "ptr"),
        (64, 256, 128, 8, 3, "ptr"),
        (64, 128, 64, 4, 4, "ptr"),
        (64, 128, 128, 8, 3, "tma"),
        (64, 128, 128, 8, 4, "tma"),
        (64, 256, 128, 8, 3, "tma"),
        (128, 128, 128, 8, 3, "tma"),
        (64, 128, 64, 4, 4, "tma"),
        _TORCH,
        # one narrow side: dA [r, in] and dB [out, r] of LoRA
        (64, 16, 128, 4, 4, "ptr"),
        (64, 128, 16, 4, 4, "ptr"),
        (128, 32, 128, 4, 3, "ptr"),
        (128, 128, 32, 8, 3, "ptr"),
    ],
    # the gate_up GEMM with the activation in its epilogue: two [BLOCK_M, BLOCK_N] accumulators (gate, up)
    # (measured on Mixtral launches, `python scripts/moe_gpu.py --only mixtral`: the epilogue's three stores are
    # not hidden behind a second program on the SM at 1 CTA/SM, so small-footprint tiles and the unfused pair are
    # candidates too)
    "glu": [
        (128, 128, 64, 8, 3, "ptr"),
        (128, 64, 64, 4, 3, "ptr"),
        (128, 128, 64, 8, 3, "tma"),
        (128, 128, 64, 8, 4, "tma"),
        (64, 128, 64, 4, 4, "tma"),
        (128, 64, 64, 4, 3, "tma"),
        _SPLIT,
    ],
}
DEFAULTS = {"fwd": (128, 128, 64, 8, 3, "ptr"), "dw": (64, 128, 128, 8, 3, "ptr"), "glu": (128, 64, 64, 4, 4, "ptr")}
# Small tiles: the interpreter walks every program in Python, and the CPU tests' experts have a few rows.
_INTERPRETER = (32, 64, 64, 1, 1, "ptr")

_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "impl")
_lock = threading.RLock()  # reentrant: the glu "split" candidate tunes the fwd GEMM inside its own timing
_memory: dict[str, dict] = {}  # key -> config, this process
_borrowed: set[str] = set()  # keys whose config came from a neighbouring bucket (`_neighbour`), not timed
TIMINGS: dict[str, list[tuple[float | None, dict]]] = {}  # key -> (ms or None, config) of each candidate timed
# key -> calls that took the untimed default because they could not time (inside a CUDA graph capture, or while
# compiling): a graph captured then keeps that config (the layer graphs capture such a shape again, eagerly timed)
UNTIMED: Counter = Counter()
_disk: dict | None = None  # the file's section for this device and Triton, loaded once
_enabled_override: bool | None = None


def as_config(values: tuple) -> dict:
    return dict(zip(_FIELDS, values))


def set_autotune(enabled: bool | None) -> None:
    """True/False overrides FASTPLUG_MOE_AUTOTUNE for this process; None goes back to the variable."""
    global _enabled_override
    _enabled_override = enabled


def autotune_enabled() -> bool:
    if _enabled_override is not None:
        return _enabled_override
    return os.environ.get("FASTPLUG_MOE_AUTOTUNE", "1").lower() not in ("0", "false", "no", "off")


def cache_path() -> Path:
    explicit = os.environ.get("FASTPLUG_MOE_TUNE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastplug" / "moe_tuning.json"


def device_key(device: torch.device) -> str:
    return f"{torch.cuda.get_device_name(device)}|triton {triton.__version__}"


def shape_key(kind: str, dtype: torch.dtype, N: int, K: int, E: int, M: int, variant: str = "") -> str:
    """Rows are bucketed by the next power of two: one tuning serves every batch of a similar size.
    `variant` names the launch's fused extras (gather, scatter, weights, LoRA; whether torch may run)."""
    key = f"{kind}|{str(dtype).replace('torch.', '')}|N{N}|K{K}|E{E}|M{next_power_of_2(M)}"
    return f"{key}|{variant}" if variant else key


def shared_memory_limit(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory_bytes(kind: str, cfg: dict, dtype: torch.dtype) -> int:
    """Pipelined operand tiles of one program: num_stages copies of both tiles of a K (or M) step."""
    if cfg["impl"] in _BLOCKLESS:
        return 0  # not ours to count (CUTLASS picks its own tiles; split: the fwd kernel's own tuning)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    per_stage = {"fwd": bm * bk + bk * bn, "glu": bm * bk + 2 * bk * bn, "dw": bn * bm + bm * bk}[kind]
    return cfg["num_stages"] * per_stage * torch.empty((), dtype=dtype).element_size()


def candidates(
    kind: str, dtype: torch.dtype, N: int, K: int, E: int, M: int, smem_limit: int, impls=IMPLS
) -> list[dict]:
    """The configs worth timing for this shape: they fit shared memory and their blocks fit the shape;
    `impls` leaves out the paths the launch cannot take (torch._grouped_mm: bf16 without LoRA)."""
    rows_per_expert = max(1, M // max(E, 1))
    fits = []
    for values in CANDIDATES[kind]:
        cfg = as_config(values)
        if cfg["impl"] not in impls:
            continue
        if cfg["impl"] in _BLOCKLESS:
            fits.append(cfg)
            continue
        if shared_memory_bytes(kind, cfg, dtype) > smem_limit:
            continue
        too_big = cfg["BLOCK_N"] > max(16, next_power_of_2(N)) or cfg["BLOCK_K"] > max(16, next_power_of_2(K))
        if kind != "dw":
            too_big |= cfg["BLOCK_M"] > max(16, next_power_of_2(rows_per_expert))
        # narrow tiles only where a side is narrow (they lose elsewhere; no point compiling them)
        too_small = (cfg["BLOCK_N"] < 64 and N >= 128) or (kind == "dw" and cfg["BLOCK_K"] < 64 and K >= 128)
        if not (too_big or too_small):
            fits.append(cfg)
    if not any(
        c["impl"] not in _BLOCKLESS for c in fits
    ):  # tiny shapes: the smallest Triton config that fits the device
        fits += sorted(
            (
                as_config(v)
                for v in CANDIDATES[kind]
                if v[5] == "ptr" and shared_memory_bytes(kind, as_config(v), dtype) <= smem_limit
            ),
            key=lambda c: c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"],
        )[:1]
    return fits


def _load_disk(device: torch.device) -> dict:
    global _disk
    if _disk is None:
        try:
            data = json.loads(cache_path().read_text())
            section = data.get(device_key(device), {}) if isinstance(data, dict) else {}
            _disk = {k: v for k, v in section.items() if isinstance(v, dict) and set(v) == set(_FIELDS)}
        except (OSError, ValueError):
            _disk = {}
    return _disk


def _save_disk(device: torch.device, key: str, cfg: dict) -> None:
    """Merge one entry into the file (other devices' sections are kept); written atomically."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data.setdefault(device_key(device), {})[key] = cfg
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".moe_tuning.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: tuning still holds for this process


def reset_cache_state() -> None:
    """Forget what this process tuned or read (tests, and after changing FASTPLUG_MOE_TUNE_CACHE)."""
    global _disk
    with _lock:
        _memory.clear()
        _borrowed.clear()
        _disk = None


def _may_time(device: torch.device) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not torch.cuda.is_current_stream_capturing()


def time_config(run: Callable[[dict], None], cfg: dict) -> float | None:
    """Median ms of run(cfg), or None when the config does not compile or launch on this device (a
    descriptor the strides do not allow, a backend that refuses the shape)."""
    try:
        run(cfg)
        # 100 ms of repeats: fewer moved the winners between two runs of one tuning (docs/benchmarks/kernels.md)
        return triton.testing.do_bench(lambda: run(cfg), warmup=20, rep=100, return_mode="median")
    except (
        triton.runtime.errors.OutOfResources,
        triton.CompilationError,
        RuntimeError,
        AssertionError,
        ValueError,
        NotImplementedError,
    ):
        return None


def _neighbour(kind: str, dtype: torch.dtype, N: int, K: int, E: int, M: int, variant: str, device) -> dict | None:
    """The config timed for the same launch at another row bucket: the nearest within a factor of four of M's, else
    the nearest larger one at any distance; None if there is neither. Timing a new bucket stalls a training step
    for seconds (every candidate of every launch of the MoE block), and on variable-length batches each new length
    can bring one. A neighbour's winner compiled and ran at nearly these rows; a larger bucket's serves a much
    smaller one well enough (its launches are short), but a much larger bucket is timed. Kept in memory only: the
    disk keeps what was timed, and a borrowed config is never lent on (no chains across buckets)."""
    bucket = next_power_of_2(M)
    disk = _load_disk(device)

    def timed(rows: int) -> dict | None:
        key = shape_key(kind, dtype, N, K, E, rows, variant)
        return disk.get(key) or (_memory.get(key) if key not in _borrowed else None)

    near = [rows for factor in (2, 4) for rows in (bucket // factor, bucket * factor) if rows >= 1]
    larger = (bucket << shift for shift in range(3, 41))  # row buckets are powers of two
    return next((cfg for cfg in map(timed, [*near, *larger]) if cfg is not None), None)


def config_for(
    kind: str,
    dtype: torch.dtype,
    N: int,
    K: int,
    E: int,
    M: int,
    device: torch.device,
    run: Callable[[dict], None] | None = None,
    variant: str = "",
) -> dict:
    """The launch config for this shape: memory, then the disk cache, then a neighbouring bucket's (`_neighbour`),
    then (if allowed) timing every candidate with `run(config)`, which must launch the kernel without side
    effects the caller keeps.
    A "t" in `variant` says torch._grouped_mm may run this launch (it is a candidate only then)."""
    if device.type != "cuda":
        return as_config(_INTERPRETER) if interpreter_enabled() else as_config(DEFAULTS[kind])
    if not autotune_enabled():
        return as_config(DEFAULTS[kind])
    key = shape_key(kind, dtype, N, K, E, M, variant)
    impls = IMPLS if "t" in variant else tuple(i for i in IMPLS if i != "torch")
    cfg = _memory.get(key)
    if cfg is not None:
        return cfg
    with _lock:
        cfg = _memory.get(key) or _load_disk(device).get(key)
        if cfg is None:
            cfg = _neighbour(kind, dtype, N, K, E, M, variant, device)
            if cfg is not None:
                _borrowed.add(key)
        if cfg is None and run is not None and _may_time(device):
            timed = [
                (time_config(run, c), c)
                for c in candidates(kind, dtype, N, K, E, M, shared_memory_limit(device), impls)
            ]
            TIMINGS[key] = timed
            timed = [(ms, c) for ms, c in timed if ms is not None]
            if timed:
                cfg = min(timed, key=lambda t: t[0])[1]
                _save_disk(device, key, cfg)
        if cfg is None:
            if run is not None:
                UNTIMED[key] += 1
            return as_config(DEFAULTS[kind])  # not remembered: a later eager call may still tune
        _memory[key] = cfg
        return cfg
