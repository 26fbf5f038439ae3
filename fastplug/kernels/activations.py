"""Gated activations of LLM MLPs: h = act(gate) * up, with act one of silu (SwiGLU), tanh-gelu or erf-gelu (GeGLU).

One forward and one backward kernel, specialised by a constexpr activation index. Both tile [rows, cols] of
the 2-D views of gate/up with their own row strides, so the halves of a fused [..., 2I] gate_up tensor need no
copy. The backward recomputes the activation from gate and up (nothing else is saved) and can optionally
recompute h too, writing its results into the caller's buffers (used by the fused LoRA MLP).

Every activation is written as act(x) = x * p(x), so act'(x) = p(x) + x * p'(x):
    silu       p = sigmoid(x)
    gelu_tanh  p = sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)   (0.5 (1 + tanh u) == sigmoid(2u))
    gelu       p = Phi(x) = 0.5 erfc(-x / sqrt(2))
The sigmoid and erfc forms avoid the cancellation of 1 + tanh / 1 + erf at negative x.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from . import tuning
from ._utils import (
    cdiv,
    check_dtype,
    check_same_device,
    check_shape,
    made_by_autograd,
    next_power_of_2,
    rows_view,
    use_triton,
)
from .jit_helpers import gate_factor

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_GELU_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}


@dataclasses.dataclass(frozen=True)
class GluConstants:
    """The constants `glu_config` builds a launch from (the defaults are what runs; scripts/tune_kernels.py
    measures others through `tuning.override("glu", functools.partial(glu_config, constants=...))`).

    2-D: a program covers BLOCK_ROWS x BLOCK_COLS elements, BLOCK_COLS a power of two up to max_block_cols
    (2048 divides the usual intermediate sizes 11008, 14336, 18944 ... into whole blocks). flat: when every
    tensor is contiguous, a program covers tile_elements consecutive elements instead (no row masks)."""

    max_block_cols: int = 2048
    # flat 8192-element tiles, 16 warps: the fastest fwd+bwd of scripts/tune_kernels.py --ops swiglu
    # (docs/benchmarks/kernels.md, "gated activations")
    tile_elements: int = 8192
    num_warps: int = 16
    flat: bool = True


GLU_CONSTANTS = GluConstants()


@dataclasses.dataclass(frozen=True)
class GluConfig:
    """One launch of `_glu_fwd` / `_glu_bwd`: flat tiles of block_cols elements, or block_rows x block_cols."""

    flat: bool
    block_rows: int
    block_cols: int
    num_warps: int


def glu_config(
    n_rows: int,
    n_cols: int,
    dtype: torch.dtype | None = None,
    *,
    contiguous: bool,
    constants: GluConstants | None = None,
) -> GluConfig:
    """The launch for [n_rows, n_cols] views; `contiguous`: every tensor of the launch has row stride n_cols."""
    tune = constants or GLU_CONSTANTS
    if tune.flat and contiguous:
        return GluConfig(True, 1, min(next_power_of_2(n_rows * n_cols), tune.tile_elements), tune.num_warps)
    block_cols = min(next_power_of_2(n_cols), tune.max_block_cols)
    return GluConfig(False, max(1, tune.tile_elements // block_cols), block_cols, tune.num_warps)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile(pid_r, pid_c, n_rows, n_cols, FLAT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """rows [R, 1], cols [1, C] and mask of this program's tile; element (r, c) is at ptr + r * stride + c.
    FLAT (contiguous tensors seen as one row of n_cols = numel): rows is 0, cols a run of the flat index."""
    if FLAT:
        rows = tl.zeros([1, 1], dtype=tl.int64)
        cols = (pid_r.to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS))[None, :]
        mask = cols < n_cols
    else:
        rows = (pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
        cols = (pid_c * BLOCK_COLS + tl.arange(0, BLOCK_COLS))[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
    return rows, cols, mask


@triton.jit(do_not_specialize=["n_rows"])  # a new batch length compiles nothing
def _glu_fwd(
    gate_ptr,
    up_ptr,
    h_ptr,
    n_rows,
    n_cols,
    stride_gate,
    stride_up,
    stride_h,
    ACT: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, FLAT, BLOCK_ROWS, BLOCK_COLS)
    x = tl.load(gate_ptr + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    p, _ = gate_factor(x, ACT)
    tl.store(h_ptr + rows * stride_h + cols, (x * p * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])  # a new batch length compiles nothing
def _glu_bwd(
    grad_h_ptr,
    gate_ptr,
    up_ptr,
    h_ptr,
    dgate_ptr,
    dup_ptr,
    n_rows,
    n_cols,
    stride_grad_h,
    stride_gate,
    stride_up,
    stride_h,
    stride_dgate,
    stride_dup,
    ACT: tl.constexpr,
    STORE_H: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # The output pointers may alias the inputs (inplace=True): every element is loaded before this same
    # program stores to it, and programs touch disjoint tiles.
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, FLAT, BLOCK_ROWS, BLOCK_COLS)
    g = tl.load(grad_h_ptr + rows * stride_grad_h + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(gate_ptr + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    p, dp = gate_factor(x, ACT)
    act = x * p
    if STORE_H:
        tl.store(h_ptr + rows * stride_h + cols, (act * u).to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + rows * stride_dgate + cols, (g * u * (p + x * dp)).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * stride_dup + cols, (g * act).to(dup_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- launchers
def _activation_index(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    return ACTIVATIONS.index(activation)


def _check_gate_up(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_dtype("gate", gate)
    check_dtype("up", up)
    if up.dtype != gate.dtype:
        raise ValueError(f"up must have gate's dtype {gate.dtype}; got {up.dtype}")
    check_shape("up", up, gate.shape, "the shape of gate")
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dimension")
    check_same_device(gate=gate, up=up)


def _launch_shape(*views: torch.Tensor, config: GluConfig | None = None) -> tuple[dict, tuple[int, int], int]:
    """(kernel size args and constexprs, grid, num_warps) for the 2-D views."""
    n_rows, n_cols = views[0].shape
    cfg = config or tuning.pick(
        "glu", glu_config, n_rows, n_cols, views[0].dtype, contiguous=all(v.stride(0) == n_cols for v in views)
    )
    if cfg.flat:
        numel = n_rows * n_cols
        args = dict(n_rows=1, n_cols=numel, FLAT=True, BLOCK_ROWS=1, BLOCK_COLS=cfg.block_cols)
        return args, (cdiv(numel, cfg.block_cols), 1), cfg.num_warps
    args = dict(n_rows=n_rows, n_cols=n_cols, FLAT=False, BLOCK_ROWS=cfg.block_rows, BLOCK_COLS=cfg.block_cols)
    return args, (cdiv(n_rows, cfg.block_rows), cdiv(n_cols, cfg.block_cols)), cfg.num_warps


def _glu_forward_triton(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    gate2, up2 = rows_view(gate), rows_view(up)
    n_rows, n_cols = gate2.shape
    h = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if h.numel():
        args, grid, warps = _launch_shape(gate2, up2, h)
        _glu_fwd[grid](
            gate2,
            up2,
            h,
            stride_gate=gate2.stride(0),
            stride_up=up2.stride(0),
            stride_h=h.stride(0),
            ACT=act,
            num_warps=warps,
            **args,
        )
    return h.view(gate.shape)


def _glu_backward_triton(grad_h, gate, up, act: int, recompute_h: bool, out):
    grad2, gate2, up2 = rows_view(grad_h), rows_view(gate), rows_view(up)
    if out is not None:
        # Write through 2-D views of the given buffers; a view that had to be copied is copied back.
        h2, dgate2, dup2 = (rows_view(out[0]) if recompute_h else None), rows_view(out[1]), rows_view(out[2])
    else:
        h2 = torch.empty_like(gate2, memory_format=torch.contiguous_format) if recompute_h else None
        dgate2 = torch.empty_like(gate2, memory_format=torch.contiguous_format)
        dup2 = torch.empty_like(up2, memory_format=torch.contiguous_format)
    if gate2.numel():
        h_arg = h2 if recompute_h else dgate2  # never written when STORE_H is False
        args, grid, warps = _launch_shape(grad2, gate2, up2, h_arg, dgate2, dup2)
        _glu_bwd[grid](
            grad2,
            gate2,
            up2,
            h_arg,
            dgate2,
            dup2,
            stride_grad_h=grad2.stride(0),
            stride_gate=gate2.stride(0),
            stride_up=up2.stride(0),
            stride_h=h_arg.stride(0),
            stride_dgate=dgate2.stride(0),
            stride_dup=dup2.stride(0),
            ACT=act,
            STORE_H=recompute_h,
            num_warps=warps,
            **args,
        )
    if out is not None:
        for buffer, view in zip(out, (h2, dgate2, dup2)):
            if view is not None and view.data_ptr() != buffer.data_ptr():
                buffer.copy_(view.view(buffer.shape))
        return (out[0] if recompute_h else None), out[1], out[2]
    return (h2.view(gate.shape) if recompute_h else None), dgate2.view(gate.shape), dup2.view(up.shape)


# ------------------------------------------------------------------------------------------ torch path
def gate_factor_torch(x: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x) and p'(x) in x's (float) dtype, the same maths as the kernel."""
    if activation == "silu":
        p = torch.sigmoid(x)
        return p, p * (1 - p)
    if activation == "gelu_tanh":
        c = 2 * _SQRT_2_OVER_PI
        p = torch.sigmoid(c * (x + 0.044715 * x**3))
        return p, p * (1 - p) * c * (1 + 3 * 0.044715 * x * x)
    p = 0.5 * torch.special.erfc(-_INV_SQRT_2 * x)
    return p, _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


def _glu_backward_torch(grad_h, gate, up, activation: str, recompute_h: bool, out):
    x, u, g = gate.float(), up.float(), grad_h.float()
    p, dp = gate_factor_torch(x, activation)
    act = x * p
    h = act * u if recompute_h else None
    dgate, dup = g * u * (p + x * dp), g * act
    if out is not None:
        if recompute_h:
            out[0].copy_(h)
        out[1].copy_(dgate)
        out[2].copy_(dup)
        return (out[0] if recompute_h else None), out[1], out[2]
    return (h.to(gate.dtype) if recompute_h else None), dgate.to(gate.dtype), dup.to(up.dtype)


# ------------------------------------------------------------------------------------------ low level API
def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """h = act(gate) * up in gate's dtype (fp32 maths); no autograd. gate/up [..., I], same shape and dtype."""
    act = _activation_index(activation)
    _check_gate_up(gate, up)
    if use_triton(gate, up):
        return _glu_forward_triton(gate, up, act)
    x = gate.float()
    return (x * gate_factor_torch(x, activation)[0] * up.float()).to(gate.dtype)


def glu_backward(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    recompute_h: bool = False,
    inplace: bool = False,
    out: tuple | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(h or None, dgate, dup) for h = act(gate) * up, recomputing the activation from gate and up.

    recompute_h also returns h (the fused LoRA MLP needs it for down_proj's weight gradient).
    out = (buffer for h or None, for dgate, for dup), gate's shape: written instead of new buffers.
    inplace=True is out=(grad_h, gate, up): h into grad_h's buffer, dgate into gate's and dup into up's; only
    for buffers the caller owns and will not read again.
    """
    act = _activation_index(activation)
    _check_gate_up(gate, up)
    check_dtype("grad_h", grad_h)
    check_shape("grad_h", grad_h, gate.shape, "the shape of gate")
    check_same_device(grad_h=grad_h, gate=gate, up=up)
    if inplace:
        out = (grad_h if recompute_h else None, gate, up)
    elif out is not None:
        for name, buffer in zip(("out[0]", "out[1]", "out[2]"), out):
            if buffer is not None:
                check_shape(name, buffer, gate.shape, "the shape of gate")
        if recompute_h and out[0] is None:
            raise ValueError("recompute_h needs a buffer for h in out[0]")
    if use_triton(grad_h, gate, up):
        return _glu_backward_triton(grad_h, gate, up, act, recompute_h, out)
    return _glu_backward_torch(grad_h, gate, up, activation, recompute_h, out)


# ---------------------------------------------------------------------------------------------- autograd
class GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, reuse_inputs):
        ctx.activation, ctx.reuse_inputs = activation, reuse_inputs
        ctx.save_for_backward(gate, up)
        return glu_forward(gate, up, activation)

    @staticmethod
    def backward(ctx, grad_h):
        gate, up = ctx.saved_tensors
        _, dgate, dup = glu_backward(grad_h, gate, up, ctx.activation, inplace=ctx.reuse_inputs)
        if ctx.reuse_inputs:  # kernel writes bypass autograd: any other saver of gate or up must now fail loudly
            increment_version((gate, up))
        return dgate, dup, None, None


def _reusable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether backward may overwrite gate and up with their gradients: both made by autograd ops (a leaf's
    data, or a view of it, must never become its own gradient), in storages of their own."""
    return (
        made_by_autograd(gate)
        and made_by_autograd(up)
        and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
    )


def _gated_activation(gate, up, activation: str, reuse_inputs: bool):
    if torch.compiler.is_compiling():
        return _glu_op(gate, up, activation)
    return GatedActivation.apply(gate, up, activation, reuse_inputs and _reusable(gate, up))


# ------------------------------------------------------------------------------------------- public API
def swiglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """silu(gate) * up (Llama, Mistral, Qwen MLPs); gate/up [..., I].

    reuse_inputs=True: backward writes dgate and dup into gate's and up's buffers instead of new ones (two
    [..., I] buffers less at the peak), for gate and up that nothing reads after this op's backward, such as
    the fresh projection outputs of an MLP. Ignored for leaves, views of leaves and gate/up sharing a storage;
    an autograd node that saved them too raises at its backward instead of reading gradients."""
    _check_gate_up(gate, up)
    if not use_triton(gate, up):
        return swiglu_reference(gate, up)
    return _gated_activation(gate, up, "silu", reuse_inputs)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, reuse_inputs: bool = False
) -> torch.Tensor:
    """gelu(gate) * up; approximate="tanh" is gelu_pytorch_tanh (Gemma), "none" the exact erf gelu.
    reuse_inputs: as in `swiglu`."""
    if approximate not in _GELU_APPROXIMATE:
        raise ValueError(f"approximate must be one of {tuple(_GELU_APPROXIMATE)}; got {approximate!r}")
    _check_gate_up(gate, up)
    if not use_triton(gate, up):
        return geglu_reference(gate, up, approximate)
    return _gated_activation(gate, up, _GELU_APPROXIMATE[approximate], reuse_inputs)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(gate, approximate=approximate) * up


# ------------------------------------------------------------------------------- registered operators
# What torch.compile traces; eager calls keep the autograd Function (less host time per call).
@torch.library.custom_op("fastplug::glu", mutates_args=(), schema="(Tensor gate, Tensor up, str activation) -> Tensor")
def _glu_op(gate, up, activation):
    return glu_forward(gate, up, activation)


@_glu_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op(
    "fastplug::glu_backward",
    mutates_args=(),
    schema="(Tensor grad_h, Tensor gate, Tensor up, str activation) -> (Tensor, Tensor)",
)
def _glu_backward_op(grad_h, gate, up, activation):
    _, dgate, dup = glu_backward(grad_h, gate, up, activation)
    return dgate, dup


@_glu_backward_op.register_fake
def _(grad_h, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_glu(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _glu_op_backward(ctx, grad_h):
    gate, up = ctx.saved_tensors
    dgate, dup = _glu_backward_op(grad_h, gate, up, ctx.activation)
    return dgate, dup, None


_glu_op.register_autograd(_glu_op_backward, setup_context=_setup_glu)
