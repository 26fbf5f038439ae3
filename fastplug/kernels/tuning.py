"""How a kernel's launch settings are chosen, and the one hook that changes them.

Every kernel family has a frozen config dataclass (block sizes, warps, stages, tiles) that its launchers take
as an argument, built by one heuristic function from the problem's shape and dtype:

    kernel name    config           heuristic
    "norm"         NormConfig       norms.norm_config(n_cols, dtype, *, backward, center)
    "causal_conv"  ConvConfig       causal_conv.conv_config(n_cols, *, backward)
    "gated_delta_scan" ScanConfig   delta_rule.scan_config(dk, dv)
    "glu"          GluConfig        activations.glu_config(n_rows, n_cols, dtype, *, contiguous)
    "rope"         RopeConfig       rope.rope_config(n_heads_q, n_heads_k, tokens, rot_dim, dtype)
    "attention"    AttentionConfig  attention.attention_config(kernel, block_d, device)
    "fp8_gemm"     Fp8GemmConfig    fp8.fp8_gemm_config(M, device)
    "gemv_4bit"    GemvConfig       quant.gemv_config(m, n, k, blocksize, device)  (the 4-bit word-wise loop's tile)
    "decode_gemv"  DecodeGemvConfig decode.decode_gemv_config(m, n, k, glu, itemsize)
    MoE grouped GEMMs: measured per shape by the MoE's disk-cached autotuner (fastplug/kernels/moe/tuning.py),
    the one kernel family where tuning per shape paid; no other kernel has an autotuner.

The heuristics' defaults are what runs. Scripts that measure other settings do not reassign module globals;
they override a kernel's config here, for a block or until `clear`:

    with tuning.override("norm", functools.partial(norms.norm_config, constants=other_constants)):
        ...   # every norm launch in the block builds its config from other_constants
    tuning.override("fp8_gemm", fp8.Fp8GemmConfig(64, 128, 8, 4, 3, tma=True))   # from now on, every launch
    tuning.clear("fp8_gemm")

An override is either a config (every launch of that kernel takes it) or a callable with the heuristic's
signature (called instead of the heuristic).
"""

from __future__ import annotations

from typing import Any, Callable

_MISSING = object()
_overrides: dict[str, Any] = {}


class override:
    """Use `config` (a config object, or a callable standing in for the heuristic) for every launch of `kernel`.
    Takes effect at once; as a context manager the previous setting comes back at exit (or at `undo()`)."""

    def __init__(self, kernel: str, config: Any):
        if config is None:
            raise ValueError("config must be a config object or a callable; use tuning.clear(kernel) to drop one")
        self.kernel = kernel
        self._previous = _overrides.get(kernel, _MISSING)
        _overrides[kernel] = config

    def undo(self) -> None:
        if self._previous is _MISSING:
            _overrides.pop(self.kernel, None)
        else:
            _overrides[self.kernel] = self._previous

    def __enter__(self) -> "override":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def clear(kernel: str | None = None) -> None:
    """Drop the override of `kernel` (of every kernel when None): the heuristics decide again."""
    if kernel is None:
        _overrides.clear()
    else:
        _overrides.pop(kernel, None)


def overridden(kernel: str) -> Any:
    """The override of `kernel`, or None."""
    return _overrides.get(kernel)


def pick(kernel: str, heuristic: Callable[..., Any], *args, **kwargs) -> Any:
    """The config a launch of `kernel` takes: its override if one is set, else heuristic(*args, **kwargs)."""
    chosen = _overrides.get(kernel) if _overrides else None
    if chosen is None:
        return heuristic(*args, **kwargs)
    return chosen(*args, **kwargs) if callable(chosen) else chosen
