"""FP8 block-scaled linear layers, in the format of DeepSeek-V3, Qwen3-FP8 and transformers' fine-grained FP8
checkpoints: weights in float8_e4m3fn with one fp32 scale per 128x128 block, activations quantized per token
in groups of 128 columns as they enter the GEMM.

Format. A weight W [N, K] is stored as W_q [N, K] (float8_e4m3fn) and S [ceil(N/b), ceil(K/b)] (fp32), with
W ~ W_q[n, k] * S[n // b, k // b]; transformers calls S `weight_scale_inv`. S = amax|block| / 448 maps each
block's largest magnitude to e4m3's largest value; the edge blocks of an N or K that is not a multiple of b
are partial. An activation x [..., K] is quantized the same way with one scale per (row, group of b columns).

GEMM. y = x W^T: one memory-bound kernel quantizes x, then cuBLAS's block-scaled GEMM where it exists (torch's
scaled_mm, CUDA 12.9+ on Hopper) and takes the shapes (see CUBLAS_ROWS), else a Triton GEMM that walks K one
block at a time (BLOCK_K = b): each step's fp8 product, summed by the tensor cores, is multiplied by its two scales
(of its rows of x, of its column block of W) and added to an fp32 accumulator. Applying the scales at every K block
is what the format needs, and it also bounds the reduced-precision accumulation of Hopper's fp8 tensor
cores to one block. The same kernel gives dY W (the input gradient) by reading W through swapped strides.

Paths. FP8 tensor cores need compute capability 8.9 (Ada, Hopper) or newer. There, and on CPU tensors under
the Triton interpreter, the kernels run; elsewhere (older GPUs, CPU without TRITON_INTERPRET) the weight is
dequantized and multiplied in the input's dtype; `fp8_path` says which and why (`python -m fastplug doctor`).

FP8Linear: forward through the FP8 GEMM; backward gives dX only (an FP8 base is frozen): through cuBLAS's
FP8 GEMM (dY quantized per token group too: 1.6x faster, less exact) where it runs, else through the weight
dequantized into a buffer shared by all layers (exact for the FP8 weight); dx_fp8 forces one or the other.

Model code holds an FP8 weight as an `fp8_parameter`: frozen integer-typed Parameters over the FP8 bytes and
the scales' bits (dtype conversions of the model leave them alone), which the fused LoRA blocks also read.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import nn

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton without host-side tensor descriptors: pointer loads only
    TensorDescriptor = None

from . import tuning
from ._utils import (
    cdiv,
    check_dtype,
    check_same_device,
    compute_dtype,
    keep_for_backward,
    kept_for_backward,
    kernel_path,
    no_autocast,
    rows_view,
    scratch,
    triton_available,
    use_triton,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_AMAX = 1e-12  # an all-zero block gets a tiny scale instead of 0 / 0
MIN_CAPABILITY = (8, 9)
_MATMUL_OPS = ("fp8_block_matmul", "fp8_linear")
FP8_OPS = ("quantize_weight_blockwise", "quantize_activation", "dequantize_blockwise", *_MATMUL_OPS)  # for doctor

_MAX = tl.constexpr(FP8_MAX)
_INV_MAX = tl.constexpr(1.0 / FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch of `_fp8_gemm` (BLOCK_K is always the scale block). tma: tensor-descriptor loads where the
    device and strides allow."""

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool

    @classmethod
    def from_dict(cls, d: dict) -> "Fp8GemmConfig":
        """From the kernel's own names (BLOCK_M=..., TMA=...), as scripts/fp8_gpu.py's sweep writes them."""
        return cls(d["BLOCK_M"], d["BLOCK_N"], d["GROUP_M"], d["num_warps"], d["num_stages"], d.get("TMA", False))

    def launch_args(self) -> dict:
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            GROUP_M=self.group_m,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


# scripts/fp8_gpu.py sweeps the alternatives: at 8192^3 the large-M launch beat 128x128, 8 warps, 4 stages
# without TMA (numbers: docs/benchmarks/kernels.md, "fp8").
GEMM_LARGE_M = Fp8GemmConfig(64, 128, 8, 4, 3, tma=True)
GEMM_SMALL_M = Fp8GemmConfig(64, 128, 8, 4, 4, tma=False)  # M <= 64
GEMM_INTERPRETER = Fp8GemmConfig(32, 32, 8, 1, 1, tma=False)


# ------------------------------------------------------------------------------------------- kernels


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even. Interpreter only: its fp32 -> fp8
    cast drops the carry when rounding up crosses a power of two (124.3 -> 64 with triton 3.9); the cast of a
    value already on the e4m3 grid is exact."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6, e4m3 subnormals keep 2^-6's spacing
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    return ((v / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23 rounds to an integer, ties to even


@triton.jit
def _quantize_blocks(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    C,
    stride_xr,
    stride_qr,
    stride_sr,
    stride_sc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUPS: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """GROUPS scale blocks of BLOCK_R x BLOCK_C, one above the other: each gets scale amax / 448 and its values
    x / scale in e4m3. Weights: BLOCK_R = BLOCK_C = b, GROUPS = 1; activations: BLOCK_R = 1, many rows."""
    rows = tl.program_id(0) * (GROUPS * BLOCK_R) + tl.arange(0, GROUPS * BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.reshape(tl.abs(x), (GROUPS, BLOCK_R, BLOCK_C)), axis=2), axis=1)
    # amax times the fp32 reciprocal of 448, as torch computes `amax / 448.0` on CUDA (a division by a scalar
    # is a multiplication by its reciprocal there): IEEE division differed from torch in the scale's last bit.
    scale = tl.maximum(amax, _MIN_AMAX) * _INV_MAX
    scales = tl.reshape(tl.broadcast_to(scale[:, None, None], (GROUPS, BLOCK_R, BLOCK_C)), (GROUPS * BLOCK_R, BLOCK_C))
    q = tl.minimum(tl.maximum(tl.div_rn(x, scales), -_MAX), _MAX)
    if INTERPRETER:
        q = _round_to_e4m3(q)
    tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    srow = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    tl.store(s_ptr + srow * stride_sr + tl.program_id(1) * stride_sc, scale, mask=srow < tl.cdiv(R, BLOCK_R))


@triton.jit
def _dequantize_blocks(
    q_ptr,
    s_ptr,
    out_ptr,
    R,
    C,
    stride_qr,
    stride_or,
    stride_sr,
    stride_sc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """out = q * scale of its block, over the tiling of `_quantize_blocks`."""
    rows = tl.program_id(0) * (GROUPS * BLOCK_R) + tl.arange(0, GROUPS * BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    srow = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    scale = tl.load(s_ptr + srow * stride_sr + tl.program_id(1) * stride_sc, mask=srow < tl.cdiv(R, BLOCK_R), other=0.0)
    scales = tl.reshape(tl.broadcast_to(scale[:, None, None], (GROUPS, BLOCK_R, BLOCK_C)), (GROUPS * BLOCK_R, BLOCK_C))
    rows = rows.to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], (q * scales).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # a new batch length compiles nothing
def _fp8_gemm(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_GRAD: tl.constexpr,
    TMA: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c[m, n] (+)= sum over K blocks j of (a[m, j-block] . b[j-block, n]) * as[m, j] * bs[j, n // BLOCK_K] (+ bias[n]).

    a is [M, K] fp8 with unit stride along K; b[k, n] sits at b_ptr + n * stride_bn + k * stride_bk: W [N, K]
    for x W^T, or (INPUT_GRAD) W [K, N] itself for dY W. BLOCK_K is the scale block of both operands.
    TMA: a_ptr and b_ptr are tensor descriptors (Hopper's bulk copies; zero fill past the edges) over a and
    the stored W, with blocks [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] (INPUT_GRAD: [BLOCK_K, BLOCK_N])."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles side by side share their columns of b in L2
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    # rows and columns past the edge wrap onto valid ones (no load masks); their results are not stored
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    if not TMA:
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None] * stride_bk
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // BLOCK_K) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.cdiv(K, BLOCK_K)):
        if TMA:
            a = a_ptr.load([pid_m * BLOCK_M, j * BLOCK_K])
            if INPUT_GRAD:
                b = b_ptr.load([j * BLOCK_K, pid_n * BLOCK_N])
            else:
                b = tl.trans(b_ptr.load([pid_n * BLOCK_N, j * BLOCK_K]))
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = rk < K - j * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + j * stride_ask)
        b_s = tl.load(bs_ptrs + j * stride_bsk)
        if INTERPRETER:  # fp32 products of the fp8 values (exact), as the tensor cores compute them
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * (a_s[:, None] * b_s[None, :])
        if not TMA:
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if ACCUMULATE:  # c += ...: read in the epilogue, rounded once
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _transpose_bytes(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst [C, R] = src [R, C]^T for one-byte elements (both contiguous), one tile a program."""
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rr < R)[:, None] & (rc < C)[None, :]
    tile = tl.load(src_ptr + rr.to(tl.int64)[:, None] * C + rc[None, :], mask=mask)
    tl.store(dst_ptr + rc.to(tl.int64)[None, :] * R + rr[:, None], tile, mask=mask)


# ------------------------------------------------------------------------------------- paths, checks


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _cuda_reason(device: torch.device) -> str | None:
    """Why FP8 kernels cannot run on this CUDA device (None: they can)."""
    if torch.version.hip is not None:
        return "ROCm: the kernels are written for NVIDIA's e4m3fn tensor cores"
    major, minor = _device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"capability {major}.{minor} < 8.9: no FP8 tensor cores"
    return None


def _kernels_run(t: torch.Tensor) -> bool:
    """True when the FP8 Triton kernels run on t's device (else: dequantize and multiply)."""
    return use_triton(t) and (t.device.type != "cuda" or _cuda_reason(t.device) is None)


def fp8_path(device: str | torch.device, op: str = "fp8_block_matmul") -> str:
    """Words for `fastplug doctor`: what the FP8 op `op` runs on this device, and why."""
    device = torch.device(device)
    if device.type == "cuda" and triton_available():
        reason = _cuda_reason(device)
        if reason is None and op not in _MATMUL_OPS:
            return "Triton (compiled for the GPU)"
        if reason is None:
            return (
                "cuBLAS block-scaled FP8 GEMM (torch scaled_mm) where K (and N for dX) are multiples of 512, "
                "else Triton's"
                if _cublas_blockwise(device)
                else "Triton FP8 block-scaled GEMM"
            )
    else:
        path = kernel_path(device)
        if path.startswith("Triton"):
            return path
        reason = path.removeprefix("torch reference (").removesuffix(")")
    return f"{'dequantize + matmul in the input dtype' if op in _MATMUL_OPS else 'torch reference'} ({reason})"


def _check_block(name: str, block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 32 or block > 256 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two in [32, 256] (128 for the usual checkpoints); got {block!r}")
    return block


def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise ValueError(f"{name} must be a tensor with at least one dimension")
    check_dtype(name, t)


def _check_fp8(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE:
        got = str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a float8_e4m3fn tensor; got {got}")


def _check_scale(name: str, scale, shape: tuple, what: str) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = str(scale.dtype).replace("torch.", "") if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{name} must be a float32 tensor (one scale per block); got {got}")
    if tuple(scale.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}); got {tuple(scale.shape)}")


def _check_weight(w_fp8, w_scale, block: int) -> tuple[int, int]:
    _check_fp8("w_fp8", w_fp8)
    if w_fp8.dim() != 2:
        raise ValueError(f"w_fp8 must be 2-D [out, in]; got shape {tuple(w_fp8.shape)}")
    N, K = w_fp8.shape
    _check_scale("w_scale", w_scale, (cdiv(N, block), cdiv(K, block)), f"{block}x{block} blocks of {N}x{K}")
    return N, K


def _block_pair(block) -> tuple[int, int]:
    """(rows, cols) of a scale block: b for b x b blocks, or a pair such as (1, 128) for per-token groups."""
    if isinstance(block, (tuple, list)) and len(block) == 2:
        rows = 1 if block[0] == 1 else _check_block("block[0]", block[0])
        return rows, _check_block("block[1]", block[1])
    b = _check_block("block", block)
    return b, b


# ------------------------------------------------------------------------------------ quantization


def _quantize_2d(x2: torch.Tensor, block_r: int, block_c: int, q: torch.Tensor, s: torch.Tensor) -> None:
    """Fills q (fp8, x2's shape) and s (fp32 [ceil(R/block_r), ceil(C/block_c)], any strides) from x2 (unit
    stride along columns)."""
    R, C = x2.shape
    if R == 0 or C == 0:
        return
    # activations: several rows a program (many programs on a GPU, few for the interpreter)
    groups = 1 if block_r > 1 else (32 if x2.is_cuda else 64)
    grid = (cdiv(cdiv(R, block_r), groups), cdiv(C, block_c))
    _quantize_blocks[grid](
        x2,
        q,
        s,
        R,
        C,
        x2.stride(0),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        GROUPS=groups,
        INTERPRETER=not x2.is_cuda,
        num_warps=8 if block_r > 1 else 4,
    )


def _quantize_reference_2d(x2: torch.Tensor, block_r: int, block_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = x2.shape
    gr, gc = cdiv(R, block_r), cdiv(C, block_c)
    padded = torch.nn.functional.pad(x2.float(), (0, gc * block_c - C, 0, gr * block_r - R))
    blocks = padded.view(gr, block_r, gc, block_c)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(MIN_AMAX) * (1.0 / FP8_MAX)  # the kernel's maths, on any device
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(gr * block_r, gc * block_c)[:R, :C].contiguous(), scale


def quantize_weight_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [N, K] float8_e4m3fn, scale [ceil(N/block), ceil(K/block)] fp32) of a weight w [N, K], with
    w ~ w_fp8 * scale of its block; scale = amax|block| / 448."""
    block = _check_block("block", block)
    _check_float("w", w)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in]; got shape {tuple(w.shape)}")
    if not _kernels_run(w):
        return quantize_weight_blockwise_reference(w, block)
    w2 = rows_view(w)
    N, K = w2.shape
    q = torch.empty((N, K), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((cdiv(N, block), cdiv(K, block)), dtype=torch.float32, device=w.device)
    _quantize_2d(w2, block, block, q, s)
    return q, s


def quantize_weight_blockwise_reference(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the same maths (the CPU path without the interpreter, and the tests' second opinion)."""
    return _quantize_reference_2d(w, block, block)


def quantize_activation(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 like x, scale [..., ceil(K/group)] fp32) of x [..., K]: one scale per row and group of `group`
    columns. The scale is a view of a [groups, rows] buffer, the layout the GEMMs read fastest."""
    group = _check_block("group", group)
    _check_float("x", x)
    if not _kernels_run(x):
        return quantize_activation_reference(x, group)
    q, s = _quantize_rows(rows_view(x), group)
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])


def _quantize_rows(x2: torch.Tensor, group: int, rows_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation of x2 [M, K] into buffers of M rounded up to rows_multiple rows (the rows past M:
    zeros with scale 1)."""
    M, K = x2.shape
    rows = cdiv(M, rows_multiple) * rows_multiple
    q = torch.empty((rows, K), dtype=FP8_DTYPE, device=x2.device)
    s = torch.empty((cdiv(K, group), rows), dtype=torch.float32, device=x2.device).t()
    _quantize_2d(x2, 1, group, q, s)
    if rows > M:
        q[M:].view(torch.uint8).zero_()
        s[M:].fill_(1.0)
    return q, s


def quantize_activation_reference(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    q, s = _quantize_reference_2d(x2, 1, group)
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])


def dequantize_blockwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    block=128,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q * its block's scale in `dtype` (or written into `out`, whose dtype wins). block: b for a weight's
    b x b blocks, or (rows, cols), e.g. (1, 128) for an activation quantized per token group."""
    block_r, block_c = _block_pair(block)
    _check_fp8("q", q)
    if q.dim() == 0:
        raise ValueError("q must have at least one dimension")
    q2 = rows_view(q)
    R, C = q2.shape
    blocks = (cdiv(R, block_r), cdiv(C, block_c))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != blocks[0] * blocks[1]:
        raise ValueError(
            f"scale must be a float32 tensor of {blocks[0]} x {blocks[1]} block scales for q of shape "
            f"{tuple(q.shape)} and block {(block_r, block_c)}"
        )
    check_same_device(q=q, scale=scale, out=out)
    s2 = scale.reshape(blocks)
    if out is None:
        check_dtype("dtype", torch.empty(0, dtype=dtype))
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    elif tuple(out.shape) != tuple(q.shape) or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out must be a contiguous tensor of shape {tuple(q.shape)} on {q.device}")
    else:
        check_dtype("out", out)
    if not _kernels_run(q):
        return out.copy_(dequantize_blockwise_reference(q, scale, (block_r, block_c), out.dtype))
    if out.numel():
        groups = 1 if block_r > 1 else (32 if q.is_cuda else 64)
        out2 = out.view(R, C)
        _dequantize_blocks[(cdiv(cdiv(R, block_r), groups), cdiv(C, block_c))](
            q2,
            s2,
            out2,
            R,
            C,
            q2.stride(0),
            out2.stride(0),
            s2.stride(0),
            s2.stride(1),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            GROUPS=groups,
            num_warps=8 if block_r > 1 else 4,
        )
    return out


def dequantize_blockwise_reference(
    q: torch.Tensor, scale: torch.Tensor, block=128, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    block_r, block_c = _block_pair(block)
    q2 = q.reshape(-1, q.shape[-1])
    R, C = q2.shape
    s2 = scale.reshape(cdiv(R, block_r), cdiv(C, block_c)).float()
    full = s2.repeat_interleave(block_r, 0)[:R].repeat_interleave(block_c, 1)[:, :C]
    return (q2.float() * full).to(dtype).view(q.shape)


# -------------------------------------------------------------------------------------------- GEMM


def fp8_gemm_config(M: int, device: torch.device) -> Fp8GemmConfig:
    """The launch of the block-scaled GEMM for M rows of activations."""
    if device.type != "cuda":
        return GEMM_INTERPRETER
    return GEMM_SMALL_M if M <= 64 else GEMM_LARGE_M


def _tma_ready(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Tensor descriptors: Hopper's TMA (capability 9.0+; the interpreter emulates them), 16-byte aligned rows."""
    if TensorDescriptor is None:
        return False
    if device.type == "cuda" and _device_capability(device) < (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in tensors)


def _gemm_2d(
    a,
    a_scale,
    w,
    w_scale,
    block: int,
    input_grad: bool,
    out: torch.Tensor,
    accumulate: bool,
    bias: torch.Tensor | None,
    config: Fp8GemmConfig | dict | None = None,
) -> torch.Tensor:
    """out (+)= a @ W^T (+ bias), or a @ W when input_grad; a [M, Ka] fp8, out [M, N] unit-stride columns."""
    M, N = out.shape
    K = a.shape[1]
    if M == 0 or N == 0:
        return out
    if input_grad:  # b[k, n] = W[k, n]; the scale of b's block (k, n) is S[k // b, n // b]
        strides = (w.stride(1), w.stride(0), w_scale.stride(1), w_scale.stride(0))
    else:  # b[k, n] = W[n, k]
        strides = (w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1))
    if config is None:
        config = tuning.pick("fp8_gemm", fp8_gemm_config, M, a.device)
    elif isinstance(config, dict):
        config = Fp8GemmConfig.from_dict(config)
    tma = config.tma and _tma_ready(a.device, a, w)
    stride_am = a.stride(0)
    if tma:
        a = TensorDescriptor.from_tensor(a, [config.block_m, block])
        w = TensorDescriptor.from_tensor(w, [block, config.block_n] if input_grad else [config.block_n, block])
    grid = (cdiv(M, config.block_m) * cdiv(N, config.block_n),)
    _fp8_gemm[grid](
        a,
        a_scale,
        w,
        w_scale,
        out,
        bias if bias is not None else out,
        M,
        N,
        K,
        stride_am,
        a_scale.stride(0),
        a_scale.stride(1),
        *strides,
        out.stride(0),
        HAS_BIAS=bias is not None,
        ACCUMULATE=accumulate,
        EVEN_K=K % block == 0,
        INPUT_GRAD=input_grad,
        TMA=tma,
        INTERPRETER=not out.is_cuda,
        BLOCK_K=block,
        **config.launch_args(),
    )
    return out


# cuBLAS's block-scaled FP8 GEMM (CUDA 12.9+, through torch.nn.functional.scaled_mm: activations in 1x128
# groups, the weight in 128x128 blocks, the scales applied in the main loop) beats the Triton kernel by ~1.5x
# even with the activation quantized per call (`python scripts/fp8_gpu.py`; docs/benchmarks/kernels.md, "fp8,
# cuBLAS path"). cuBLAS wants both operands K-contiguous, so dY W reads a
# transposed copy of the FP8 weight, made per call in a shared buffer. Where it takes the shapes (K, and N
# for dY W, multiples of 512: whole groups of four scale blocks, which cuBLAS reads as 16-byte vectors; the
# rows padded to a multiple of CUBLAS_ROWS) it runs instead of the Triton GEMM.
CUBLAS_ROWS = 16  # cuBLAS refused M = 5 and M = 8190 (CUBLAS_STATUS_NOT_SUPPORTED), so rows are padded


def _cublas_takes(x2: torch.Tensor, block: int, contracted: int, other: int, input_grad: bool) -> bool:
    """True when cuBLAS's block-scaled GEMM runs x2 [M, contracted] against a weight with `other` features."""
    return (
        block == 128
        and x2.is_cuda
        and x2.dtype == torch.bfloat16  # fp16 and fp32: not tried on a GPU yet
        and contracted % 512 == 0
        and (other % 512 == 0 if input_grad else other % 128 == 0)
        and _cublas_blockwise(x2.device)
    )


@functools.cache
def _cublas_blockwise_on(index: int) -> bool:
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    if (
        scaled_mm is None
        or not hasattr(torch.nn.functional, "ScalingType")
        or torch.version.hip is not None
        or not torch.cuda.is_available()
    ):
        return False
    device = torch.device("cuda", index)
    if _cuda_reason(device) is not None:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(CUBLAS_ROWS, 512, device=device, generator=gen).bfloat16()
    w = torch.randn(256, 512, device=device, generator=gen).bfloat16()
    try:  # a build or device without the kernel raises; a wrong layout would give wrong numbers
        wq, ws = quantize_weight_blockwise(w)
        y = _cublas_mm(_quantize_rows(x, 128, CUBLAS_ROWS), wq, ws, False, x.dtype)
        ref = fp8_block_matmul_reference(x, wq, ws).float()
        return bool(((y.float() - ref).norm() / ref.norm()) < 1e-2)
    except (RuntimeError, ValueError, TypeError):
        return False


def _cublas_blockwise(device: torch.device) -> bool:
    """Whether torch's scaled_mm runs cuBLAS's block-scaled FP8 GEMM on this device: tried once per device on
    a small product against the reference maths."""
    return _cublas_blockwise_on(device.index if device.index is not None else torch.cuda.current_device())


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """W^T [K, N] of an FP8 weight W [N, K], in the shared buffer of its dtype (use at once)."""
    N, K = w.shape
    out = scratch((K, N), FP8_DTYPE, w.device)
    _transpose_bytes[(cdiv(N, 64), cdiv(K, 64))](
        w.view(torch.uint8), out.view(torch.uint8), N, K, BLOCK_R=64, BLOCK_C=64, num_warps=4
    )
    return out


def _cublas_mm(aq: tuple, w: torch.Tensor, w_scale: torch.Tensor, input_grad: bool, dtype) -> torch.Tensor:
    """a W^T (or a W) by cuBLAS for aq = (a, a_scale) from `_quantize_rows` (rows padded, scales row-minor):
    [padded rows, out features] in dtype."""
    F = torch.nn.functional
    a, a_scale = aq
    if input_grad:  # b = W [N, K] read K-contiguous: the transposed copy; its scales [N/128, K/128] row-minor
        b, b_scale = _transposed(w).t(), w_scale.t().contiguous().t()
    else:  # b = W^T [K, N], K-contiguous as stored; scales [K/128, N/128] row-minor as stored
        b, b_scale = w.t(), w_scale.t()
    return F.scaled_mm(
        a, b, a_scale, F.ScalingType.BlockWise1x128, b_scale, F.ScalingType.BlockWise128x128, output_dtype=dtype
    )


def _fp8_product(
    aq: tuple, m: int, w, w_scale, block: int, input_grad: bool, dtype, cublas: bool, *, bias=None, out=None
) -> torch.Tensor:
    """a W^T (or a W) (+ bias) for aq = (a, a_scale) from `_quantize_rows` (its first m rows; more when padded),
    in dtype or added into `out`: by cuBLAS's block-scaled GEMM (`cublas`, where `_cublas_takes`), else by the
    Triton GEMM."""
    if cublas:
        y = _cublas_mm(aq, w, w_scale, input_grad, dtype)[:m]
        if bias is not None:
            y = y.add_(bias.to(y.dtype))
        return y if out is None else out.add_(y)
    accumulate = out is not None
    if out is None:
        out = torch.empty((m, w.shape[1] if input_grad else w.shape[0]), dtype=dtype, device=aq[0].device)
    return _gemm_2d(aq[0][:m], aq[1][:m], w, w_scale, block, input_grad, out, accumulate, bias)


def _quantize_operand(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2's FP8 form for `_fp8_product`: rows padded to CUBLAS_ROWS on a device where cuBLAS's kernel runs."""
    padded = x2.is_cuda and block == 128 and _cublas_blockwise(x2.device)
    return _quantize_rows(x2, block, CUBLAS_ROWS if padded else 1)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block: int = 128,
    input_grad: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Fp8GemmConfig | dict | None = None,
) -> torch.Tensor:
    """The block-scaled GEMM on operands already in FP8: a [..., Ka] with a_scale [..., ceil(Ka/block)] (from
    `quantize_activation`), w [N, K] with w_scale [ceil(N/block), ceil(K/block)].

    y = a W^T (Ka = K), or with input_grad=True y = a W (Ka = N: dY W, the input gradient of x W^T), plus
    bias; in out_dtype, or added into `out` when given (a contiguous [..., out features] tensor).
    `config` (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) overrides the default launch (tuning sweeps).
    Needs the FP8 kernels (`fp8_path`); there is no fallback at this level.
    """
    block = _check_block("block", block)
    _check_fp8("a", a)
    N_w, K_w = _check_weight(w, w_scale, block)
    k_in, n_out = (N_w, K_w) if input_grad else (K_w, N_w)
    if a.dim() == 0 or a.shape[-1] != k_in:
        raise ValueError(
            f"a must have shape [..., {k_in}] for w of shape {(N_w, K_w)} (input_grad={input_grad}); "
            f"got {tuple(a.shape)}"
        )
    lead = tuple(a.shape[:-1])
    _check_scale("a_scale", a_scale, (*lead, cdiv(k_in, block)), f"one per row and group of {block}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n_out,)):
        raise ValueError(f"bias must have shape ({n_out},)")
    check_same_device(a=a, a_scale=a_scale, w=w, w_scale=w_scale, bias=bias, out=out)
    if not _kernels_run(a):
        raise ValueError(f"fp8_gemm needs the FP8 kernels; on {a.device}: {fp8_path(a.device)}")
    a2 = rows_view(a)
    s2 = a_scale.reshape(a2.shape[0], -1)
    if out is None:
        check_dtype("out_dtype", torch.empty(0, dtype=out_dtype))
        result = torch.empty((a2.shape[0], n_out), dtype=out_dtype, device=a.device)
        return _gemm_2d(a2, s2, w, w_scale, block, input_grad, result, False, bias, config).view(*lead, n_out)
    if tuple(out.shape) != (*lead, n_out) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {(*lead, n_out)}; got {tuple(out.shape)}")
    check_dtype("out", out)
    _gemm_2d(a2, s2, w, w_scale, block, input_grad, out.view(a2.shape[0], n_out), True, bias, config)
    return out


def _dense_weight(w, w_scale, block: int, dtype: torch.dtype) -> torch.Tensor:
    """W dequantized into the buffer shared by all layers: valid until the next dequantization, use at once."""
    return dequantize_blockwise(w, w_scale, block, out=scratch(tuple(w.shape), dtype, w.device))


def _project(x2, w, w_scale, block: int, *, bias=None, out=None, quantized: dict | None = None) -> torch.Tensor:
    """x2 @ W^T (+ bias) for x2 [M, K] in a float dtype, added into `out` when given. `quantized` caches x2's
    FP8 form per group size, for projections that share their input (q/k/v, gate/up)."""
    if not _kernels_run(x2):
        dense = _dense_weight(w, w_scale, block, x2.dtype).t()
        if out is None:
            return x2 @ dense if bias is None else torch.addmm(bias.to(x2.dtype), x2, dense)
        out.addmm_(x2, dense)
        return out if bias is None else out.add_(bias)
    xq = None if quantized is None else quantized.get(block)
    if xq is None:
        xq = _quantize_operand(x2, block)
        if quantized is not None:
            quantized[block] = xq
    cublas = _cublas_takes(x2, block, w.shape[1], w.shape[0], False)
    return _fp8_product(xq, x2.shape[0], w, w_scale, block, False, x2.dtype, cublas, bias=bias, out=out)


def _project_grad(dy2, w, w_scale, block: int, *, out=None, fp8: bool | None = None) -> torch.Tensor:
    """dy2 @ W (the input gradient of x W^T) for dy2 [M, N], added into `out` when given: through the weight
    dequantized in dy2's dtype, or with fp8=True (and the kernels available) through an FP8 GEMM, dy2 quantized
    per token group. fp8=None: FP8 where cuBLAS's kernel takes the shapes (faster than the dequantized
    weight), else the dequantized weight (faster than the Triton GEMM reading W transposed); numbers in
    docs/benchmarks/kernels.md ("fp8, cuBLAS path", `python scripts/fp8_gpu.py`)."""
    kernels = _kernels_run(dy2)
    cublas = kernels and _cublas_takes(dy2, block, w.shape[0], w.shape[1], True)
    if fp8 is False or not kernels or (fp8 is None and not cublas):
        dense = _dense_weight(w, w_scale, block, dy2.dtype)
        return dy2 @ dense if out is None else out.addmm_(dy2, dense)
    return _fp8_product(
        _quantize_operand(dy2, block), dy2.shape[0], w, w_scale, block, True, dy2.dtype, cublas, out=out
    )


def fp8_block_matmul(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, *, x_group: int = 128
) -> torch.Tensor:
    """y = x W^T for x [..., K] (bf16, fp16 or fp32; y in x's dtype) and a block-quantized weight (w_fp8 [N, K],
    w_scale [ceil(N/x_group), ceil(K/x_group)]): x is quantized per token and group of x_group columns, the
    scales are applied per K block in fp32. Without the FP8 kernels (`fp8_path`): x @ dequantized(W)^T."""
    block = _check_block("x_group", x_group)
    _check_float("x", x)
    N, K = _check_weight(w_fp8, w_scale, block)
    if x.shape[-1] != K:
        raise ValueError(f"x must have shape [..., {K}] to match w_fp8 {(N, K)}; got {tuple(x.shape)}")
    check_same_device(x=x, w_fp8=w_fp8, w_scale=w_scale)
    return _project(rows_view(x), w_fp8, w_scale, block).view(*x.shape[:-1], N)


def fp8_block_matmul_reference(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, *, x_group: int = 128
) -> torch.Tensor:
    """Plain torch, the kernel's maths: x quantized per token group, both operands dequantized in fp32."""
    xq, xs = quantize_activation_reference(x, x_group)
    xd = dequantize_blockwise_reference(xq, xs, (1, x_group), torch.float32)
    wd = dequantize_blockwise_reference(w_fp8, w_scale, x_group, torch.float32)
    return (xd @ wd.t()).to(x.dtype)


# ---------------------------------------------------------------------------------------- autograd


def _linear_forward(x, weight, scale, bias, block):
    x2 = rows_view(x)
    return _project(x2, weight, scale, block, bias=bias).view(*x.shape[:-1], weight.shape[0])


def _linear_input_grad(dy, weight, scale, block, dx_fp8):
    dy2 = rows_view(dy)
    return _project_grad(dy2, weight, scale, block, fp8=dx_fp8).view(*dy.shape[:-1], weight.shape[1])


class FP8Linear(torch.autograd.Function):
    """y = x W^T + b with W in FP8 blocks: forward through the FP8 GEMM, backward dX (and db); W is frozen."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, block, dx_fp8):
        with no_autocast(x):
            y = _linear_forward(x, weight, scale, bias, block)
        keep_for_backward(ctx, (weight, scale))
        ctx.block, ctx.dx_fp8 = block, dx_fp8
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, scale = kept_for_backward(ctx)
        with no_autocast(dy):
            dx = _linear_input_grad(dy, weight, scale, ctx.block, ctx.dx_fp8) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return dx, None, None, db, None, None


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: int = 128,
    dx_fp8: bool | None = None,
) -> torch.Tensor:
    """x W^T + bias for a frozen block-quantized W, differentiable in x (and bias): forward through the FP8
    GEMM; dX through the dequantized weight (dx_fp8=False), through an FP8 GEMM with dY quantized per token
    group (True), or (None) FP8 where cuBLAS's block-scaled kernel takes the shapes, else dequantized."""
    block = _check_block("block", block)
    _check_float("x", x)
    N, K = _check_weight(w_fp8, w_scale, block)
    if x.shape[-1] != K:
        raise ValueError(f"x must have shape [..., {K}] to match w_fp8 {(N, K)}; got {tuple(x.shape)}")
    if w_fp8.requires_grad:
        raise ValueError("w_fp8 requires grad; FP8 weights are frozen (train adapters on top of them)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)):
        raise ValueError(f"bias must have shape ({N},)")
    check_same_device(x=x, w_fp8=w_fp8, w_scale=w_scale, bias=bias)
    dtype = compute_dtype(x)
    x = x if x.dtype == dtype else x.to(dtype)
    if torch.compiler.is_compiling():
        return _fp8_linear_op(x, w_fp8, w_scale, bias, block, dx_fp8)
    return FP8Linear.apply(x, w_fp8, w_scale, bias, block, dx_fp8)


# -------------------------------------------------------------------------- weights that carry scales


def fp8_parameter(w_fp8: torch.Tensor, w_scale: torch.Tensor, block: int) -> nn.Parameter:
    """The form in which model code holds an FP8 weight and hands it to the fused LoRA blocks: a frozen
    Parameter over w_fp8's bytes (uint8) that carries its block (`fp8_block`) and its scales (`fp8_scale`, a
    frozen Parameter over the fp32 scales' bits, int32), both sharing the storage of the tensors given.

    Integer storage, so that `model.to(dtype)` (Lightning's "bf16-true" precision, say) leaves both alone,
    while `model.to(device)` moves them in place once the scale is registered on the module next to the
    weight. `fp8_weight` gives the two back as float8_e4m3fn and float32."""
    _check_weight(w_fp8, w_scale, _check_block("block", block))
    param = nn.Parameter(w_fp8.detach().view(torch.uint8), requires_grad=False)
    param.fp8_scale = nn.Parameter(w_scale.detach().view(torch.int32), requires_grad=False)
    param.fp8_block = block
    return param


def is_fp8(weight) -> bool:
    """True for a weight made by `fp8_parameter`."""
    return isinstance(weight, torch.Tensor) and getattr(weight, "fp8_block", None) is not None


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, w_scale) of an `fp8_parameter`, as float8_e4m3fn and float32 views."""
    return weight.view(FP8_DTYPE), weight.fp8_scale.view(torch.float32)


def fp8_project(x2, weight, *, bias=None, out=None, quantized: dict | None = None) -> torch.Tensor:
    """x2 [M, K] @ W^T (+ bias) for an `fp8_parameter` W, added into `out` when given; `quantized` (a dict per
    input) shares x2's quantization between the projections that read it."""
    return _project(x2, *fp8_weight(weight), weight.fp8_block, bias=bias, out=out, quantized=quantized)


def fp8_project_grad(dy2, weight, *, out=None) -> torch.Tensor:
    """dy2 [M, N] @ W for an `fp8_parameter` W (through the dequantized weight), added into `out` when given."""
    return _project_grad(dy2, *fp8_weight(weight), weight.fp8_block, out=out)


# ------------------------------------------------------------------------------- registered operators
# What torch.compile traces; eager calls keep the autograd Function (less host time per call).


@torch.library.custom_op(
    "fastplug::fp8_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor scale, Tensor? bias, int block, bool? dx_fp8) -> Tensor",
)
def _fp8_linear_op(x, weight, scale, bias, block, dx_fp8):
    return _linear_forward(x, weight, scale, bias, block)


@_fp8_linear_op.register_fake
def _(x, weight, scale, bias, block, dx_fp8):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(
    "fastplug::fp8_linear_input_grad",
    mutates_args=(),
    schema="(Tensor dy, Tensor weight, Tensor scale, int block, bool? dx_fp8) -> Tensor",
)
def _fp8_input_grad_op(dy, weight, scale, block, dx_fp8):
    return _linear_input_grad(dy, weight, scale, block, dx_fp8)


@_fp8_input_grad_op.register_fake
def _(dy, weight, scale, block, dx_fp8):
    return dy.new_empty((*dy.shape[:-1], weight.shape[1]))


def _setup_fp8_linear(ctx, inputs, output):
    _, weight, scale, _, block, dx_fp8 = inputs
    ctx.save_for_backward(weight, scale)
    ctx.block, ctx.dx_fp8 = block, dx_fp8


def _fp8_linear_backward(ctx, dy):
    weight, scale = ctx.saved_tensors
    dx = _fp8_input_grad_op(dy, weight, scale, ctx.block, ctx.dx_fp8) if ctx.needs_input_grad[0] else None
    db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
    return dx, None, None, db, None, None


_fp8_linear_op.register_autograd(_fp8_linear_backward, setup_context=_setup_fp8_linear)
