"""Decode attention: one new token per row over a static KV cache [B, Hkv, L, D], GQA-aware (a program serves the
query heads of one key/value head), split over the cache (flash-decoding) with `_attention_combine_kernel` merging
the splits. q/k RMSNorm (Qwen3, Gemma3), RoPE at each row's position (from cos/sin tables), the write of the new
key/value into the cache column `slot`, softcap and sliding windows are in the same kernel. The loop stops at the
device-side `slot`: a captured graph reads only the filled part of the cache. A windowed layer's cache may be a ring
of its last `window` columns (`ring=True`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._utils import cdiv, check_dtype, next_power_of_2, use_triton
from ..jit_helpers import dot, rms_weight, tanh
from .config import precision, rows_of


# ------------------------------------------------------------------------------------------- arguments
class Rope(NamedTuple):
    """The RoPE tables [positions, D] (one layout) and each row's position [B]."""

    cos: torch.Tensor
    sin: torch.Tensor
    stride: int
    pos: torch.Tensor


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before RoPE: weights [D], eps, offset (unread without HAS_QK_NORM)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    offset: float


class KVCache(NamedTuple):
    """The caches [B, Hkv, L, D] (one layout, contiguous along D) and their strides."""

    k: torch.Tensor
    v: torch.Tensor
    stride_b: int
    stride_h: int
    stride_l: int


class Partials(NamedTuple):
    """The split programs' results, fp32, rows [B, H, SPLITS]: o [rows, D] unnormalised, ml [rows, 2] (max, sum)."""

    o: torch.Tensor
    ml: torch.Tensor


class Dims(NamedTuple):
    H: int  # query heads
    HKV: int  # key/value heads
    G: int  # query heads a key/value head (H // HKV)
    D: int  # head dim
    L: int  # cache columns


class Scores(NamedTuple):
    window: int  # sliding window (read with WINDOW)
    scaling: float
    softcap: float  # (read with SOFTCAP)


class AttnFlags(NamedTuple):
    """Constexpr: what a launch applies."""

    HAS_QK_NORM: bool
    GEMMA_NORM: bool  # the q/k norms' offset is not 0
    SOFTCAP: bool
    WINDOW: bool  # mask to the last `window` columns (not with RING: a ring is the window)
    RING: bool  # the cache holds absolute column c at c % L


class AttnTile(NamedTuple):
    """Constexpr: the split of the cache and the blocks."""

    CHUNK: int  # cache columns a split
    SPLITS: int
    PRECISION: str
    BLOCK_G: int  # query heads of a key/value head, padded
    BLOCK_H: int  # half a head, padded
    BLOCK_S: int  # cache columns a step


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _rope_half(x1, x2, c1, c2, s1, s2):
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _head_norm(x1, x2, w_ptr, half, h_mask, norm, D, dt, GEMMA_NORM: tl.constexpr):
    """RMSNorm over a head's D values held as two halves (rows: heads), rounded like the module; norm: `QKNorm`."""
    w1 = tl.load(w_ptr + half, mask=h_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + D // 2, mask=h_mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + norm.eps)
    y1 = rms_weight(x1 * rstd[:, None], w1[None, :], norm.offset, dt, GEMMA_NORM)
    y2 = rms_weight(x2 * rstd[:, None], w2[None, :], norm.offset, dt, GEMMA_NORM)
    return y1.to(tl.float32), y2.to(tl.float32)


@triton.jit
def _decode_attention_kernel(
    qkv, rope, qk_norm, cache, valid, slot_ptr, out, parts, dims, scores, F: tl.constexpr, T: tl.constexpr
):
    """Key/value head bh % HKV of row bh // HKV, over split program_id(1) of the cache. qkv, valid, out: `Rows`;
    rope, qk_norm, cache, parts, dims, scores: `Rope`, `QKNorm`, `KVCache`, `Partials`, `Dims`, `Scores`; F, T:
    `AttnFlags`, `AttnTile`."""
    H, HKV, G, D, L = dims
    PRECISION: tl.constexpr = T.PRECISION  # a str field goes on as an argument only so (Triton 3.6)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    kvh = bh % HKV
    dt = cache.k.dtype.element_ty
    slot = tl.load(slot_ptr).to(tl.int32)
    pos = tl.load(rope.pos + b).to(tl.int32)
    # a head's D values as two halves: rotate_half pairs i with i + D/2
    half = tl.arange(0, T.BLOCK_H)
    h_mask = half < D // 2
    g = tl.arange(0, T.BLOCK_G)
    g_mask = g < G
    qg_mask = g_mask[:, None] & h_mask[None, :]
    row = qkv.ptr + b * qkv.stride
    q_off = (kvh * G + g)[:, None] * D + half[None, :]  # this kv head's query heads
    q1 = tl.load(row + q_off, mask=qg_mask, other=0.0).to(tl.float32)
    q2 = tl.load(row + q_off + D // 2, mask=qg_mask, other=0.0).to(tl.float32)
    k_off = H * D + kvh * D + half[None, :]
    k1 = tl.load(row + k_off, mask=h_mask[None, :], other=0.0).to(tl.float32)
    k2 = tl.load(row + k_off + D // 2, mask=h_mask[None, :], other=0.0).to(tl.float32)
    if F.HAS_QK_NORM:
        q1, q2 = _head_norm(q1, q2, qk_norm.q_weight, half, h_mask, qk_norm, D, dt, F.GEMMA_NORM)
        k1, k2 = _head_norm(k1, k2, qk_norm.k_weight, half, h_mask, qk_norm, D, dt, F.GEMMA_NORM)
    r_off = pos * rope.stride + half
    c1 = tl.load(rope.cos + r_off, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(rope.cos + r_off + D // 2, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(rope.sin + r_off, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(rope.sin + r_off + D // 2, mask=h_mask, other=0.0).to(tl.float32)[None, :]
    q1, q2 = _rope_half(q1, q2, c1, c2, s1, s2)
    q1 = q1.to(dt)
    q2 = q2.to(dt)
    cache_b = b.to(tl.int64) * cache.stride_b + kvh.to(tl.int64) * cache.stride_h
    # a ring holds absolute column c at c % L; a full cache at c (slot < L)
    write = slot % L
    lo = split * T.CHUNK
    hi = tl.minimum(lo + T.CHUNK, tl.minimum(slot + 1, L))
    if (write >= lo) & (write < lo + T.CHUNK):  # this split owns the new column: write it, then read it back
        k1, k2 = _rope_half(k1, k2, c1, c2, s1, s2)
        v_off = (H + HKV) * D + kvh * D + half[None, :]
        v1 = tl.load(row + v_off, mask=h_mask[None, :], other=0.0)
        v2 = tl.load(row + v_off + D // 2, mask=h_mask[None, :], other=0.0)
        dst = cache_b + write.to(tl.int64) * cache.stride_l + half[None, :]
        tl.store(cache.k + dst, k1.to(dt), mask=h_mask[None, :])
        tl.store(cache.k + dst + D // 2, k2.to(dt), mask=h_mask[None, :])
        tl.store(cache.v + dst, v1.to(dt), mask=h_mask[None, :])
        tl.store(cache.v + dst + D // 2, v2.to(dt), mask=h_mask[None, :])
        tl.debug_barrier()
    m_i = tl.full([T.BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([T.BLOCK_G], 0.0, dtype=tl.float32)
    acc1 = tl.full([T.BLOCK_G, T.BLOCK_H], 0.0, dtype=tl.float32)
    acc2 = tl.full([T.BLOCK_G, T.BLOCK_H], 0.0, dtype=tl.float32)
    for start in range(lo, hi, T.BLOCK_S):
        cols = start + tl.arange(0, T.BLOCK_S)
        c_mask = cols < hi
        kv_mask = c_mask[:, None] & h_mask[None, :]
        offs = cache_b + cols.to(tl.int64)[:, None] * cache.stride_l + half[None, :]
        kt1 = tl.load(cache.k + offs, mask=kv_mask, other=0.0)
        kt2 = tl.load(cache.k + offs + D // 2, mask=kv_mask, other=0.0)
        vt1 = tl.load(cache.v + offs, mask=kv_mask, other=0.0)
        vt2 = tl.load(cache.v + offs + D // 2, mask=kv_mask, other=0.0)
        s = (dot(q1, tl.trans(kt1), PRECISION) + dot(q2, tl.trans(kt2), PRECISION)) * scores.scaling
        if F.SOFTCAP:
            s = tanh(s / scores.softcap, CLAMP=True) * scores.softcap
        if F.RING:  # the absolute column each ring slot holds now (negative: not written yet)
            held = slot - (slot - cols + L) % L
            ok = tl.load(valid.ptr + b * valid.stride + held, mask=c_mask & (held >= 0), other=0) != 0
        else:
            ok = tl.load(valid.ptr + b * valid.stride + cols, mask=c_mask, other=0) != 0
        ok = (ok | (cols == write)) & c_mask
        if F.WINDOW:  # a ring is exactly the window: nothing to mask
            ok = ok & (cols > slot - scores.window)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m_i - base)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(dt)
        acc1 = acc1 * alpha[:, None] + dot(p, vt1, PRECISION)
        acc2 = acc2 * alpha[:, None] + dot(p, vt2, PRECISION)
        m_i = m_new
    heads = kvh * G + g
    if T.SPLITS == 1:
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        dst = out.ptr + b * out.stride + heads[:, None] * D + half[None, :]
        tl.store(dst, (acc1 * inv[:, None]).to(dt), mask=qg_mask)
        tl.store(dst + D // 2, (acc2 * inv[:, None]).to(dt), mask=qg_mask)
    else:
        part = (b * H + heads) * T.SPLITS + split  # [B, H, SPLITS] rows
        dst = parts.o + part.to(tl.int64)[:, None] * D + half[None, :]
        tl.store(dst, acc1, mask=qg_mask)
        tl.store(dst + D // 2, acc2, mask=qg_mask)
        tl.store(parts.ml + part * 2, m_i, mask=g_mask)
        tl.store(parts.ml + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _attention_combine_kernel(
    part_o, part_ml, o_ptr, stride_o, H, D, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    sp = tl.arange(0, BLOCK_SPLITS)
    s_mask = sp < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    row = bh * SPLITS + sp
    m = tl.load(part_ml + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml + row * 2 + 1, mask=s_mask, other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(s_mask & (m > float("-inf")), tl.exp(m - top), 0.0)
    acc = tl.load(
        part_o + row.to(tl.int64)[:, None] * D + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + b * stride_o + h * D + d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def _attention_splits(length: int, chunk: int | None) -> tuple[int, int]:
    chunk = chunk or (length if length <= 256 else 128)
    chunk = max(16, next_power_of_2(chunk)) if chunk < length else length
    return chunk, cdiv(length, chunk)


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: int,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
    ring: bool = False,
    qk_norm: tuple | None = None,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of attention for B rows: returns o [B, heads * D] and writes the new key/value.

    qkv [B, (heads + 2 Hkv) D]: this token's projections (q heads, then k, then v; before RoPE). k_cache,
    v_cache [B, Hkv, L, D]: column `slot` (a 1-element device tensor) receives the rotated key and the value;
    the token attends to columns 0..slot where `valid` [B, L] (bool) is set (column slot always), and with a
    window to the last `window` columns (column j for slot i when i - window < j <= i). ring: the cache holds
    only the last `window` columns (L == window), absolute column c at c % window, and `valid` [B, positions]
    stays per absolute column. pos [B] (or [B, 1]): each row's position, indexing the RoPE tables
    cos, sin [positions, D]. qk_norm: (q weight [D], k weight [D], eps, offset) for per-head q/k RMSNorm
    before RoPE. chunk: cache columns per split program (flash-decoding).
    """
    for name, t in (
        ("qkv", qkv),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("valid", valid),
        ("slot", slot),
        ("pos", pos),
        ("cos", cos),
        ("sin", sin),
    ):
        if not torch.is_tensor(t):
            raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be [B, Hkv, L, D] of one shape; got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    check_dtype("k_cache", k_cache)
    b, hkv, length, d = k_cache.shape
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have one layout, contiguous along D")
    if not isinstance(heads, int) or heads < 1 or heads % hkv:
        raise ValueError(f"heads must be a positive multiple of the cache's {hkv} key/value heads; got {heads}")
    if d % 2:
        raise ValueError(f"head dim (the cache's last size) must be even for RoPE; got {d}")
    if qkv.dim() != 2 or tuple(qkv.shape) != (b, (heads + 2 * hkv) * d) or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [{b}, {(heads + 2 * hkv) * d}] (q, k, v heads of this token); got {tuple(qkv.shape)}"
        )
    if qkv.dtype != k_cache.dtype:
        raise ValueError(f"qkv must have the cache's dtype {k_cache.dtype}; got {qkv.dtype}")
    if ring and window != length:
        raise ValueError(f"a ring cache holds `window` columns: window must be the cache's {length}; got {window!r}")
    if (
        valid.dtype != torch.bool
        or valid.dim() != 2
        or valid.shape[0] != b
        or valid.shape[1] < length
        or (not ring and valid.shape[1] != length)
        or valid.stride(1) != 1
    ):
        expected = f"[{b}, >= {length}]" if ring else f"[{b}, {length}]"
        raise ValueError(
            f"valid must be a bool tensor {expected}, contiguous rows; got {valid.dtype} {tuple(valid.shape)}"
        )
    if slot.numel() != 1 or slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot must be a 1-element integer tensor; got {slot.dtype} {tuple(slot.shape)}")
    pos = pos.reshape(-1)
    if pos.numel() != b or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pos must hold {b} integer positions; got {pos.dtype} {tuple(pos.shape)}")
    if (
        cos.dim() != 2
        or cos.shape[1] != d
        or sin.shape != cos.shape
        or cos.stride(1) != 1
        or sin.stride() != cos.stride()
    ):
        raise ValueError(
            f"cos and sin must be [positions, {d}] tables of one layout; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0; got {softcap}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None; got {window!r}")
    if qk_norm is not None:
        qn, kn, _, _ = qk_norm
        if qn.shape != (d,) or kn.shape != (d,):
            raise ValueError(f"qk_norm weights must have shape ({d},); got {tuple(qn.shape)}, {tuple(kn.shape)}")
    if out is None:
        out = torch.empty(b, heads * d, device=qkv.device, dtype=qkv.dtype)
    if not use_triton(qkv, k_cache):
        out.copy_(
            decode_attention_reference(
                qkv,
                k_cache,
                v_cache,
                valid,
                slot,
                pos,
                cos,
                sin,
                heads=heads,
                scaling=scaling,
                softcap=softcap,
                window=window,
                ring=ring,
                qk_norm=qk_norm,
            ),
        )
        return out
    chunk, splits = _attention_splits(length, chunk)
    group = heads // hkv
    block_g = max(16, next_power_of_2(group))
    block_h = max(16, next_power_of_2(d // 2))
    block_s = max(16, min(64 if d <= 128 else 32, next_power_of_2(chunk)))
    if splits > 1:
        part_o = torch.empty(b * heads * splits, d, device=qkv.device, dtype=torch.float32)
        part_ml = torch.empty(b * heads * splits, 2, device=qkv.device, dtype=torch.float32)
    else:
        part_o = part_ml = out
    qn, kn, eps, offset = qk_norm if qk_norm is not None else (cos, cos, 0.0, 0.0)
    _decode_attention_kernel[(b * hkv, splits)](
        rows_of(qkv),
        Rope(cos, sin, cos.stride(0), pos),
        QKNorm(qn, kn, float(eps), float(offset)),
        KVCache(k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        rows_of(valid.view(torch.uint8)),
        slot,
        rows_of(out),
        Partials(part_o, part_ml),
        Dims(heads, hkv, group, d, length),
        Scores(int(window or 0), float(scaling), float(softcap or 1.0)),
        F=AttnFlags(
            HAS_QK_NORM=qk_norm is not None,
            GEMMA_NORM=qk_norm is not None and float(offset) != 0.0,
            SOFTCAP=softcap is not None,
            WINDOW=window is not None and not ring,
            RING=ring,
        ),
        T=AttnTile(chunk, splits, precision(qkv.dtype), block_g, block_h, block_s),
        num_warps=4,
    )
    if splits > 1:
        _attention_combine_kernel[(b * heads,)](
            part_o,
            part_ml,
            out,
            out.stride(0),
            heads,
            d,
            SPLITS=splits,
            BLOCK_SPLITS=next_power_of_2(splits),
            BLOCK_D=next_power_of_2(d),
            num_warps=4,
        )
    return out


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention_reference(
    qkv,
    k_cache,
    v_cache,
    valid,
    slot,
    pos,
    cos,
    sin,
    *,
    heads,
    scaling,
    softcap=None,
    window=None,
    ring=False,
    qk_norm=None,
) -> torch.Tensor:
    """decode_attention in torch (fp32 maths, q/k rounded to the cache dtype as the unfused path rounds)."""
    from ..norms import rms_norm_reference

    b, hkv, length, d = k_cache.shape
    dtype = k_cache.dtype
    q, k, v = qkv.view(b, heads + 2 * hkv, d).split([heads, hkv, hkv], dim=1)
    if qk_norm is not None:
        qn, kn, eps, offset = qk_norm
        q, k = rms_norm_reference(q, qn, eps, offset), rms_norm_reference(k, kn, eps, offset)
    p = pos.reshape(-1).long()
    c, s = cos[p].float()[:, None], sin[p].float()[:, None]
    q = _rotate(q.float(), c, s).to(dtype)
    k = _rotate(k.float(), c, s).to(dtype)
    col = int(slot.reshape(-1)[0])
    k_cache[:, :, col % length] = k
    v_cache[:, :, col % length] = v
    if ring:
        held = ring_columns(col, length, qkv.device)
        allowed = (held >= 0)[None] & valid.gather(1, held.clamp(min=0)[None].expand(b, -1))
        allowed = allowed | (held == col)[None]
    else:
        cols = torch.arange(length, device=qkv.device)
        allowed = (valid | (cols == col)[None]) & (cols <= col)[None]
        if window is not None:
            allowed = allowed & (cols > col - window)[None]
    group = heads // hkv
    keys = k_cache.float().repeat_interleave(group, dim=1)  # [B, H, L, D]
    values = v_cache.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhl,bhld->bhd", probs, values).reshape(b, heads * d).to(dtype)


def ring_columns(slot, window: int, device=None) -> torch.Tensor:
    """The absolute cache column each slot of a `window`-column ring holds once column `slot` (an int or a
    device tensor) is written there: the latest c <= slot with c % window == the ring slot; negative: none yet."""
    ring = torch.arange(window, device=device if device is not None else getattr(slot, "device", None))
    return slot - (slot - ring) % window
