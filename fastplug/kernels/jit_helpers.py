"""Small `@triton.jit` functions that several kernel modules call, under public names.

    dot(a, b, PRECISION)             tl.dot with the interpreter's workaround (decode, attention)
    dot_acc(a, b, acc, PRECISION)    the same, accumulating into `acc` (MoE grouped GEMMs)
    tanh(x, CLAMP=False)             tanh from exp, for softcaps (cross-entropy; decode with CLAMP)
    sigmoid_and_slope(z)             sigmoid(z) and its derivative, without overflow or cancellation
    erfc(z)                          erfc to fp32 relative accuracy in the tail
    gate_factor(x, ACT)              p(x) and p'(x) of a gated activation act(x) = x p(x) (GLU, decode, MoE)
    rms_weight(h, w, offset, dt, GEMMA_NORM)   normalised values times an RMSNorm's weight, rounded like
                                     transformers' module (decode: the GEMV's x, q/k norms, add_rms_norm)

PRECISION is "ieee", "tf32" (ignored for 16-bit operands) or "upcast": the interpreter's 16-bit tl.dot
returns garbage (Triton 3.9), so "upcast" multiplies fp32 copies of the operands; launchers pass "upcast"
when `_utils.interpreter_enabled()`. ACT indexes `activations.ACTIVATIONS`: 0 silu, 1 gelu_tanh, 2 gelu (erf).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b in fp32 (a [M, K], b [K, N])."""
    if PRECISION == "upcast":  # the interpreter's 16-bit dot is garbage: fp32 products
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b (acc fp32 [M, N])."""
    if PRECISION == "upcast":  # the interpreter's 16-bit dot is garbage: fp32 products
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def tanh(x, CLAMP: tl.constexpr = False):
    """tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 without NaN (libdevice's tanh does not run under the
    interpreter, and tl.math names differ between Triton versions). CLAMP: x clamped to [-20, 20] first (tanh(20)
    is 1 in fp32, so only the exp's overflow changes; a NaN x then gives 1 on a GPU, whose max/min drop NaN)."""
    if CLAMP:
        x = tl.minimum(tl.maximum(x, -20.0), 20.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def sigmoid_and_slope(z):
    """sigmoid(z) and its derivative sigmoid(z) (1 - sigmoid(z)), from exp(-|z|): no overflow, no cancellation."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    return tl.where(z >= 0, r, e * r), e * r * r


@triton.jit
def erfc(z):
    # Chebyshev-fitted erfc (Numerical Recipes' erfcc): fractional error < 1.2e-7 everywhere, so the tail
    # of Phi(x) at negative x keeps fp32 relative accuracy. Plain tl.exp: no libdevice name that differs
    # between triton versions.
    a = tl.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -1.26551223 + t * (
        1.00002368
        + t
        * (
            0.37409196
            + t
            * (
                0.09678418
                + t
                * (
                    -0.18628806
                    + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))
                )
            )
        )
    )
    r = t * tl.exp(-a * a + poly)
    return tl.where(z >= 0, r, 2.0 - r)


@triton.jit
def gate_factor(x, ACT: tl.constexpr):
    """p(x) and p'(x) with act(x) = x * p(x); a forward kernel drops p' (the compiler removes its maths).
    silu       p = sigmoid(x)
    gelu_tanh  p = sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)   (0.5 (1 + tanh u) == sigmoid(2u))
    gelu       p = Phi(x) = 0.5 erfc(-x / sqrt(2))"""
    if ACT == 0:  # silu
        p, dp = sigmoid_and_slope(x)
    elif ACT == 1:  # gelu_tanh: sigmoid(2u), 2u = 2 sqrt(2/pi) (x + 0.044715 x^3)
        p, slope = sigmoid_and_slope(1.5957691216057308 * (x + 0.044715 * x * x * x))
        dp = slope * 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * x * x)
    else:  # gelu (erf)
        p = 0.5 * erfc(-0.7071067811865476 * x)
        dp = 0.3989422804014327 * tl.exp(-0.5 * x * x)
    return p, dp


@triton.jit
def rms_weight(h, w, offset, dt, GEMMA_NORM: tl.constexpr):
    """h (fp32: x times its row's 1/rms) times the norm weight w (fp32), in dtype dt, rounded as transformers'
    RMSNorm rounds: Llama's (GEMMA_NORM False) rounds h to dt before the weight; Gemma's scales by (offset + w) in
    fp32 and rounds once."""
    if GEMMA_NORM:
        y = h * (offset + w)
    else:
        y = h.to(dt).to(tl.float32) * w
    return y.to(dt)
