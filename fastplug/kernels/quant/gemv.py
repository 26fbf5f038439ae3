"""`gemv_4bit`: the decode-time product x W^T of a few rows of x and a 4-bit weight, read straight from the packed
bytes by the decode GEMV (`kernels.decode.gemv`, the one GEMV kernel) on this one weight. Products and sums in
fp32.
"""

from __future__ import annotations

import torch

from .._utils import check_dtype, rows_view, use_triton
from .dequant import dequantize_4bit, dequantize_4bit_reference
from .formats import _unpacked
from .gemv_tile import GEMV_MAX_ROWS, GemvConfig


def gemv_4bit(x: torch.Tensor, weight, config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., in] @ W^T for a 4-bit weight W [out, in], straight from the packed bytes: at most GEMV_MAX_ROWS
    rows of x (more take one dequantization and a matmul). Compiled on CUDA, the word-wise loop reads the weight
    where it can (K a multiple of 8, blocksize >= 8, the bytes at a word boundary): products of the unrounded
    weight in fp32, a split of K over more programs where few row blocks would leave SMs idle. Elsewhere one row
    takes the decoded 4-bit tiles and more rows the weight dequantized (to x's dtype) and read dense. The result
    in x's dtype. `config`: the word-wise loop's tile (`gemv_config`); it asks for the loop."""
    from ..decode.gemv import gemv  # the decode GEMV imports this package's formats and loop

    u = _unpacked(weight)
    p = u.packed
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != p.shape[1]:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape [..., {p.shape[1]}] to match weight {p.shape}; got {got}")
    check_dtype("x", x)
    if x.device != p.data.device:
        raise ValueError(f"x must be on {p.data.device} like weight; got {x.device}")
    x2 = rows_view(x)
    M, N = x2.shape[0], p.shape[0]
    if M == 0:
        return x2.new_empty((0, N)).view(*x.shape[:-1], N)
    if M > GEMV_MAX_ROWS or not use_triton(x2):
        return (x2 @ dequantize_4bit(weight, dtype=x.dtype).t()).view(*x.shape[:-1], N)
    return gemv(x2, [weight], words_tile=config).view(*x.shape[:-1], N)


def gemv_4bit_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """Plain torch: x @ dequantized(W)^T with fp32 accumulation, in x's dtype."""
    w = dequantize_4bit_reference(weight, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)
