"""Shared helpers of the kernel modules: which path a tensor takes, and input checks that raise clear errors."""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

from . import state

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install on an unsupported platform
        return False
    return True


_TRITON = _import_triton()  # a constant, not a cached call: torch.compile traces `use_triton`


def triton_available() -> bool:
    return _TRITON


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors (slowly): the CPU tests use it."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernels can run on these tensors; otherwise the op takes its torch reference."""
    if not triton_available():
        return False
    devices = {t.device.type for t in tensors if t is not None}
    if devices == {"cuda"}:
        return True
    return devices == {"cpu"} and interpreter_enabled()


def kernel_path(device: str | torch.device) -> str:
    """Words for `fastplug doctor` and the logs: what path ops take on this device."""
    device = torch.device(device)
    if not triton_available():
        return "torch reference (triton is not installed)"
    if device.type == "cuda":
        return "Triton (compiled for the GPU)"
    if device.type == "cpu" and interpreter_enabled():
        return "Triton interpreter (TRITON_INTERPRET=1, slow; for tests)"
    return f"torch reference (no Triton on {device.type})"


def check_dtype(name: str, t: torch.Tensor, allowed=SUPPORTED_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def check_shape(name: str, t: torch.Tensor, expected: tuple, what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}; got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    present = {k: v.device for k, v in tensors.items() if v is not None}
    if len(set(present.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in present.items())
        raise ValueError(f"tensors must be on one device; got {listing}")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, the unit of persistent grids; 1 elsewhere (the
    interpreter then walks several rows or tiles per program, which the CPU tests want)."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b). Plain Python: triton.cdiv is a constexpr_function now, whose call from the host costs
    microseconds of argument unwrapping; launchers call these several times per launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); plain Python, like `cdiv`."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_PROMOTED: dict[tuple, torch.dtype] = state.register_cache("utils.promoted", {})


def promote_types(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch.promote_types, memoised: it is a dispatcher call, and the ops call it on every use."""
    promoted = _PROMOTED.get((a, b))
    if promoted is None:
        promoted = _PROMOTED[a, b] = torch.promote_types(a, b)
    return promoted


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Under autocast a projection runs in the autocast dtype, as nn.Linear would; otherwise in x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# One buffer per (device, dtype), grown to the largest request: layers dequantize their frozen base weight into
# it just before the matmul that reads it, so a model holds one dense weight at a time, not one per layer.
_SCRATCH: dict[tuple, torch.Tensor] = state.register_cache("utils.scratch", {})


def scratch(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous `shape` view of the shared buffer of `device` and `dtype`. Valid until the next request for
    that device and dtype: use it at once (kernels of one stream run in order), never keep it."""
    numel = math.prod(shape)
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


_NO_CONTEXT = contextlib.nullcontext()


def no_autocast(x: torch.Tensor):
    """A context in which autocast leaves the matmuls on x's device alone: kernels cast their inputs to one
    dtype up front, and autocast must not re-cast them. Where autocast is off (the common case) a no-op
    context: entering torch.autocast(enabled=False) costs host time twice per fused node and pass
    (`python scripts/host_overhead.py`; docs/benchmarks/kernels.md, "host and memory notes")."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return _NO_CONTEXT


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last dim] tensor with unit stride in the last dim (copies only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def keep_for_backward(ctx, tensors) -> None:
    """Keep tensors that live through the step anyway (parameters, the rotary cos/sin tables) on ctx instead
    of save_for_backward: under checkpointing every saved tensor costs a pack hook in forward, another in
    the recompute and an unpack hook. What save_for_backward would still give, a check that nothing wrote
    them in place before backward, is done by `kept_for_backward`. Never for an output of the function:
    its grad_fn is this very node, a reference cycle that keeps the graph alive."""
    ctx.kept = tensors
    ctx.kept_versions = [None if t is None else t._version for t in tensors]


def kept_for_backward(ctx) -> list:
    for t, version in zip(ctx.kept, ctx.kept_versions):
        if t is not None and t._version != version:
            raise RuntimeError(
                "a tensor kept for backward was modified by an inplace operation between forward and backward"
            )
    return ctx.kept


def made_by_autograd(t: torch.Tensor) -> bool:
    """Whether an op that was asked to reuse t's buffer may overwrite it: t is an autograd op's output or a
    view of one. Never a leaf (a parameter's or a caller's data would become something else) or a view of
    one, nor a tensor autograd does not track."""
    return t.grad_fn is not None and (t._base is None or t._base.grad_fn is not None)
