"""The `@triton.jit` helpers the forward and both backward kernels share: which keys a query row sees, the
block split of a row's keys (or a key's rows), how a tile is read, and the (softcapped) scores.

Which keys a query row sees is one rule, `_row_bounds` (`_key_bounds` solves it for the row, for the dK/dV
kernel): query i (causal: at position p = i + S - T, bottom-right aligned like flash-attn, so a decode step with a
cache sees every cached key; else p = i) sees keys first(i)..last(i):
  causal:              j <= p; with sliding_window W: p - W < j <= p (transformers' `sliding_window_overlay`
                       on top of `causal_mask_function`, masking_utils of transformers 5.17 to 5.23; Mistral,
                       Qwen2/3, Gemma2/3 and Mixtral all build their sliding masks from it);
  not causal + window: |p - j| <= W (transformers' `sliding_window_bidirectional_overlay`);
  packed rows:         also doc_start(i) <= j < doc_end(i), the document of token i.
Both bounds grow with i, so the keys of a query block split into blocks every row sees in full (no mask
work), edge blocks (masked) and blocks nobody sees (never loaded): the same split serves causal, window and
document boundaries. Backward mirrors it per key block (rows that see the key form an interval too).

Tiles are read through TMA descriptors where AttentionTables.tma says they measured faster and the strides allow
(unit stride along the head dim, 16-byte aligned rows; rows past the end and the padded head dim come back as
zeros; `config._use_tma`), else through masked pointer loads (`_rows_of`, `_tile`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_bounds(rows, T, S, window, START, END, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """First and last key (inclusive) each query row sees; START/END point at this batch row's doc bounds."""
    pos = rows
    if CAUSAL:
        pos = rows + (S - T)
    first = tl.zeros_like(rows)
    last = tl.zeros_like(rows) + (S - 1)
    if CAUSAL:
        last = tl.minimum(last, pos)
        if HAS_WINDOW:
            first = tl.maximum(first, pos - window + 1)
    elif HAS_WINDOW:
        first = tl.maximum(first, pos - window)
        last = tl.minimum(last, pos + window)
    if VARLEN:
        valid = rows < T
        first = tl.maximum(first, tl.load(START + rows, mask=valid, other=0))
        last = tl.minimum(last, tl.load(END + rows, mask=valid, other=0) - 1)
    return first, last


@triton.jit
def _key_bounds(cols, T, S, window, START, END, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """First and last query row (inclusive) that sees each key: `_row_bounds` solved for the row."""
    shift = 0
    if CAUSAL:
        shift = S - T
    first = tl.zeros_like(cols)
    last = tl.zeros_like(cols) + (T - 1)
    if CAUSAL:
        first = tl.maximum(first, cols - shift)
        if HAS_WINDOW:
            last = tl.minimum(last, cols - shift + window - 1)
    elif HAS_WINDOW:
        first = tl.maximum(first, cols - shift - window)
        last = tl.minimum(last, cols - shift + window)
    if VARLEN:  # q and k share the packing (T == S)
        valid = cols < S
        first = tl.maximum(first, tl.load(START + cols, mask=valid, other=0))
        last = tl.minimum(last, tl.load(END + cols, mask=valid, other=0) - 1)
    return first, last


@triton.jit
def _block_split(first, last, valid, n_max, BLOCK: tl.constexpr):
    """Given per-row [first, last] ranges over the other axis, the block-aligned loop limits a <= b <= c <= e:
    [a, b) and [c, e) need masking, every row sees all of [b, c)."""
    lo_need = tl.min(tl.where(valid, first, n_max), axis=0)
    hi_need = tl.max(tl.where(valid, last, -1), axis=0) + 1
    lo_full = tl.max(tl.where(valid, first, 0), axis=0)
    hi_full = tl.min(tl.where(valid, last, n_max), axis=0) + 1
    a = (lo_need // BLOCK) * BLOCK
    e = tl.maximum(hi_need, a)
    b = tl.minimum(tl.maximum((lo_full + BLOCK - 1) // BLOCK * BLOCK, a), e)
    c = tl.minimum(tl.maximum((hi_full // BLOCK) * BLOCK, b), e)
    return a, b, c, e


@triton.jit
def _rows_of(X, n, head_dim, stride_n, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """What `_tile` reads a (n, head_dim) matrix through: a TMA descriptor (rows past n and columns past head_dim
    come back as zeros) or the pointer itself."""
    if TMA:  # one return: the compiler wants one type out of a function, whichever branch the constexpr takes
        rows = tl.make_tensor_descriptor(X, shape=[n, head_dim], strides=[stride_n, 1], block_shape=[BLOCK, BLOCK_D])
    else:
        rows = X
    return rows


@triton.jit
def _tile(X, start, n, stride_n, stride_d, d, d_mask, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """Rows start..start+BLOCK of a (n, head_dim) matrix, zeros outside it."""
    if TMA:
        tile = X.load([start, 0])
    else:
        idx = start + tl.arange(0, BLOCK)
        tile = tl.load(
            X + idx[:, None] * stride_n + d[None, :] * stride_d, mask=(idx < n)[:, None] & d_mask[None, :], other=0.0
        )
    return tile


@triton.jit
def _scores(qk, qk_scale, cap_scale, HAS_SOFTCAP: tl.constexpr):
    """Scores in base-2 units, and tanh of the softcap (for backward's chain rule; qk itself otherwise)."""
    if HAS_SOFTCAP:
        # tanh from exp: no tanh in tl (libdevice's does not run under the interpreter); exact enough in fp32.
        # tanh(20) is 1 in fp32: the clamp only keeps exp finite.
        u = qk * qk_scale
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(u, 20.0)) + 1.0)
        return t * cap_scale, t
    return qk * qk_scale, qk
