"""The decode GEMV's launcher: `gemv` checks its operands, picks the path (tile or word-wise 4-bit loop) and the
tile, and launches `gemv_kernels._gemv_kernel` with its argument tuples; `gemv_reference` is the same maths in
torch, `packed_reason` says which 4-bit weights one launch can read. It imports quant's modules, not its package:
`quant.gemv_4bit` launches this module's `gemv`."""

from __future__ import annotations

import torch

from .. import state, tuning
from .._utils import cdiv, check_dtype, interpreter_enabled, next_power_of_2, use_triton
from ..quant.dequant import dequantize_4bit, dequantize_4bit_reference
from ..quant.formats import _unpacked, is_4bit
from ..quant.gemv_kernels import LOOKUPS
from ..quant.gemv_tile import GemvConfig, default_gemv_config, launch_checked
from .config import (
    ACTIVATIONS,
    MAX_ROWS,
    MAX_SEGMENTS,
    WORDS_MAX_ROWS,
    DecodeGemvConfig,
    Norm,
    decode_gemv_config,
    precision,
    rows_of,
)
from .gemv_kernels import (
    Q4_DENSE,
    WORDS_OFF,
    GemvArgs,
    GemvFlags,
    GemvTile,
    Q4Format,
    Segment,
    WordsLoop,
    _gemv_kernel,
    _sum_splits_kernel,
)
from .step import launch_rms_norm


def gemv(
    x: torch.Tensor,
    weights,
    *,
    norm: tuple | None = None,
    biases=None,
    lora=None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    config: DecodeGemvConfig | tuple | None = None,
    words: bool | None = None,
    words_tile: GemvConfig | None = None,
) -> torch.Tensor:
    """y = [x W0^T | x W1^T | x W2^T] for x [M, K] (M <= 16) and up to three weights [N_i, K], in one launch.

    norm: (weight [K], eps, offset): x is RMSNorm'ed first (offset 0: transformers' Llama RMSNorm, weight times
    the rounded normalised x; else Gemma's (offset + weight) in fp32). biases: one per weight, or None.
    lora: (xa [M, sum r], [B_i [N_i, r_i] or None], [scaling_i]): adds s_i xa_i B_i^T, xa_i the columns of xa
    that belong to weight i, in order (weights without an adapter have None and own no columns).
    activation ('silu', 'gelu_tanh', 'gelu'): exactly two weights (gate, up) of one shape; y = act(g) * u.
    residual [M, N]: y = residual + the projection (`out` may be `residual` itself: in place).
    out_dtype: torch.float32 for logits; softcap: tanh(y / cap) * cap, rounded like transformers.
    The weights may instead all be bitsandbytes 4-bit weights of one format (`packed_reason`), decoded from
    their packed bytes in the kernel and rounded to x's dtype (the dtype the whole product then runs in).
    With up to WORDS_MAX_ROWS rows of x (the decode step) they are read as 32-bit words instead, the 4-bit GEMV's
    loop (`words`: None picks it where the kernels run compiled on CUDA and the format allows; True asks for it),
    products of the unrounded weight in fp32, x normalised first by one more launch: a 16-byte load per thread
    and a warp-shuffle table, each nibble looked up once for all rows, where the decoded tile takes a byte load,
    a table load and a scale per element (an order of magnitude faster, and ahead of bitsandbytes' GEMV:
    docs/benchmarks/kernels.md, "decode GEMV"). More rows, or weights the loop cannot read, are dequantized and
    read dense. `words_tile`: the word-wise loop's tile (a `quant.GemvConfig`; it implies words=True); by default
    `quant.gemv_config`'s, picked through `kernels.tuning` as "gemv_4bit". A plain product (one weight, nothing
    fused) splits K over more programs where its tile says so (`GemvConfig.split`), the splits' fp32 sums added
    by one more launch.
    """
    weights = list(weights)
    entries, ns, dtype = _check_operands(x, weights)
    m, k = x.shape
    act = ACTIVATIONS.get(activation, None) if activation in ACTIVATIONS else None
    if act is None:
        raise ValueError(f"activation must be one of {[a for a in ACTIVATIONS if a]} or None; got {activation!r}")
    if act >= 0 and (len(weights) != 2 or ns[0] != ns[1]):
        raise ValueError(
            f"activation {activation!r} needs two weights (gate, up) of one shape; got shapes "
            f"{[tuple(w.shape) for w in weights]}"
        )
    n_out = ns[0] if act >= 0 else sum(ns)
    if norm is not None:
        nw, eps, offset = norm
        if not torch.is_tensor(nw) or nw.shape != (k,):
            raise ValueError(f"norm weight must have shape ({k},); got {getattr(nw, 'shape', None)}")
    if biases is not None:
        biases = list(biases)
        if len(biases) != len(weights) or any(b is None for b in biases):
            raise ValueError("biases must hold one bias per weight (or be None)")
        for i, (b, n) in enumerate(zip(biases, ns)):
            if b.shape != (n,) or b.dtype != dtype:
                raise ValueError(
                    f"biases[{i}] must be a {dtype} tensor of shape ({n},); got {b.dtype} {tuple(b.shape)}"
                )
    xa, adapters = _adapters(lora, x, ns, dtype)
    if residual is not None and (tuple(residual.shape) != (m, n_out) or residual.stride(1) != 1):
        raise ValueError(f"residual must have shape ({m}, {n_out}), contiguous rows; got {tuple(residual.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0; got {softcap}")
    out_dtype = out_dtype or dtype
    if out is None:
        out = torch.empty(m, n_out, device=x.device, dtype=out_dtype)
    elif tuple(out.shape) != (m, n_out) or out.stride(1) != 1:
        raise ValueError(f"out must have shape ({m}, {n_out}), contiguous rows; got {tuple(out.shape)}")
    if not use_triton(x, weights[0]):
        reference = gemv_reference(
            x,
            weights,
            norm=norm,
            biases=biases,
            lora=lora,
            activation=activation,
            residual=residual,
            out_dtype=out_dtype,
            softcap=softcap,
        )
        return out.copy_(reference)
    tile = _words_tile(x, entries, ns, k, act >= 0, words, words_tile)
    if entries and tile is None and m > 1:
        # Dequantized (into new buffers, one launch a weight) and read dense: much faster at 2-8 rows than decoding
        # the 4-bit tiles (docs/benchmarks/kernels.md, "decode GEMV") (whose per-element table and scale loads the
        # pipeliner stages in shared memory; 256 columns of them overflowed it at batch 8 of Llama-1B NF4).
        weights, entries = [dequantize_4bit(w, dtype=dtype) for w in weights], None
    if config is None:
        config = tuning.pick("decode_gemv", decode_gemv_config, m, max(ns), k, act >= 0, x.element_size())
    use_dot, block_m, block_n, block_k, warps = DecodeGemvConfig(*config)
    if use_dot and block_m < 16:
        raise ValueError("config: the dot path needs BLOCK_M >= 16")
    if tile is not None and norm is not None:
        # normalised once, by one more launch: fused, every program of the word-wise loop would redo the norm's
        # conversions for its rows (2.5x the product alone: docs/benchmarks/kernels.md, "decode GEMV")
        x, norm = launch_rms_norm(torch.empty_like(x), x, norm, add=False), None
    q4, words_loop, lookup, y = Q4_DENSE, WORDS_OFF, {}, out
    split_words, splits = k // 8, 1  # the word-wise loop's words a program reads along K: a whole row
    if entries:  # the kernel reads the packed bytes; the rest of each weight's fields through one table
        seg_w, strides = [e.packed.data for e in entries], [0] * len(entries)
        # the word-wise loop on one weight takes its fields as kernel parameters (absmax, code, absmax2, code2,
        # offset) and compiles that one segment only: registers as in a kernel of its own (on the tile paths the
        # same change added registers: scripts/decode_ptx.py)
        one = len(entries) == 1 and tile is not None
        q4_table = tuple(entries[0].args[1:]) if one else _packed_table(entries)
        q4 = Q4Format(**entries[0].consts, FIELDS_AS_ARGS=one)
        if tile is not None:
            seg_w, block_n, use_dot = [e.words for e in entries], tile.block_n, False
            block_m, warps = next_power_of_2(m), tile.num_warps
            aligned = x.data_ptr() % 16 == 0 and (m == 1 or x.stride(0) % 8 == 0)
            even = all(n % block_n == 0 for n in ns) and k // 8 % (tile.nb * tile.sub) == 0
            lookup = dict(
                LOOKUP=LOOKUPS[tile.lookup], PTX=tile.lookup == "shfl" and x.dtype == torch.bfloat16 and aligned
            )
            plain = len(ns) == 1 and biases is None and lora is None and residual is None and softcap is None
            if tile.split > 1 and plain and out_dtype == dtype:  # whole chunks a split
                chunk = tile.nb * tile.sub
                split_words = cdiv(cdiv(k // 8, chunk), tile.split) * chunk
                splits = cdiv(k // 8, split_words)
            if splits > 1:
                y = torch.empty(splits * m, n_out, device=x.device, dtype=torch.float32)
            words_loop = WordsLoop(tile.nb, tile.sub, even, SPLIT=splits > 1)
    else:
        seg_w, strides, q4_table = weights, [w.stride(0) for w in weights], x
    unused = MAX_SEGMENTS - len(ns)  # segments past the weights: n = 0, their pointers unread
    seg_n = ns + [0] * unused
    seg_w = seg_w + [seg_w[0]] * unused
    strides = strides + [0] * unused
    seg_bias = (biases or [x]) + [x] * (MAX_SEGMENTS - len(biases or [x]))
    segments = tuple(Segment(seg_w[i], strides[i], seg_bias[i], *adapters[i], seg_n[i]) for i in range(MAX_SEGMENTS))
    blocks = [cdiv(n, block_n) for n in seg_n]
    nw, eps, offset = norm if norm is not None else (x, 0.0, 0.0)  # x: an unread pointer
    res = residual if residual is not None else out  # out: an unread pointer without a residual
    args = GemvArgs(
        x=rows_of(x),
        norm=Norm(nw, float(eps), float(offset)),
        segments=segments,
        q4_table=q4_table,
        lora_x=rows_of(xa),
        residual=rows_of(res),
        y=rows_of(y),
        M=m,
        K=k,
        row_words=k // 8,
        split_words=split_words,
        blocks=(blocks[0], blocks[1]),
        softcap=float(softcap or 1.0),
    )
    flags = GemvFlags(
        HAS_NORM=norm is not None,
        GEMMA_NORM=norm is not None and float(offset) != 0.0,
        HAS_BIAS=biases is not None,
        HAS_LORA=lora is not None,
        ACT=act,
        HAS_RES=residual is not None,
        SOFTCAP=softcap is not None,
    )
    ranks = [a[1] for a in adapters]
    tile_c = GemvTile(use_dot, precision(dtype), block_m, block_n, block_k, max(16, next_power_of_2(max(ranks))))
    consts = dict(F=flags, Q4=q4, TILE=tile_c, WORDS=words_loop, **lookup, num_warps=warps)
    grid = (blocks[0] if act >= 0 else sum(blocks), splits)
    # the dtypes the compiled kernel depends on beyond its constexprs (biases and adapters have x's, checked above)
    absmax = entries[0].packed.absmax.dtype if entries else None
    dtypes = (x.dtype, nw.dtype, seg_w[0].dtype, res.dtype, y.dtype, absmax)
    launch_checked(_gemv_kernel, grid, args, consts, dict(LOOKUP=LOOKUPS["gather"], PTX=False), dtypes)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(m * n_out, block),)](y, out, m * n_out, SPLIT=splits, BLOCK=block, num_warps=4)
    return out


def _check_operands(x, weights) -> tuple:
    """(quant's cached fields of 4-bit weights or None, each weight's N, the dtype the product runs in) of gemv's x
    and weights, which must fit one launch."""
    if not 1 <= len(weights) <= MAX_SEGMENTS:
        raise ValueError(f"weights must hold 1 to {MAX_SEGMENTS} matrices; got {len(weights)}")
    if not torch.is_tensor(x) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [rows, K]; got {getattr(x, 'shape', type(x).__name__)}")
    check_dtype("x", x)
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows; got {m}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension")
    reason = packed_reason(weights)
    if reason:
        raise ValueError(f"weights: {reason}")
    entries = [_unpacked(w) for w in weights] if is_4bit(weights[0]) else None  # quant's cached fields
    packs = [e.packed for e in entries] if entries else None
    dtype = x.dtype if packs else weights[0].dtype
    for i, w in enumerate(weights):
        shape = packs[i].shape if packs else (tuple(w.shape) if torch.is_tensor(w) and w.dim() == 2 else None)
        if shape is None or shape[1] != k:
            raise ValueError(f"weights[{i}] must be a 2-D tensor [N, {k}]; got {getattr(w, 'shape', None)}")
        if packs:
            continue
        if w.dtype != dtype:
            raise ValueError(f"weights[{i}] must have weights[0]'s dtype {dtype}; got {w.dtype}")
        if w.stride(1) != 1:
            raise ValueError(f"weights[{i}] must be contiguous along its last dimension")
    if not packs:
        check_dtype("weights", weights[0])
    if x.dtype != dtype:
        raise ValueError(f"x must have the weights' dtype {dtype}; got {x.dtype}")
    ns = [p.shape[0] for p in packs] if packs else [w.shape[0] for w in weights]
    return entries, ns, dtype


def _adapters(lora, x, ns, dtype) -> tuple:
    """(xa, one (B, rank, first column of xa, scaling) a segment) of gemv's `lora` (x and zeros where a weight has
    no adapter: unread)."""
    adapters = [(x, 0, 0, 0.0)] * MAX_SEGMENTS
    if lora is None:
        return x, adapters
    xa, bs, scalings = lora
    bs, scalings = list(bs), list(scalings)
    if len(bs) != len(ns) or len(scalings) != len(ns):
        raise ValueError("lora must give one B (or None) and one scaling per weight")
    col = 0
    for i, (b, n) in enumerate(zip(bs, ns)):
        if b is None:
            continue
        if b.dim() != 2 or b.shape[0] != n or b.dtype != dtype or not b.is_contiguous():
            raise ValueError(
                f"lora B[{i}] must be a contiguous {dtype} tensor [{n}, r]; got {b.dtype} {tuple(b.shape)}"
            )
        adapters[i] = (b, b.shape[1], col, float(scalings[i]))
        col += b.shape[1]
    m = x.shape[0]
    if xa.dim() != 2 or tuple(xa.shape) != (m, col) or xa.dtype != dtype or xa.stride(1) != 1:
        raise ValueError(
            f"lora xa must be a {dtype} tensor [{m}, {col}] (x A^T of every adapter); got {xa.dtype} {tuple(xa.shape)}"
        )
    return xa, adapters


def _words_tile(x, entries, ns, k, glu: bool, words: bool | None, words_tile: GemvConfig | None):
    """The word-wise tile (a quant.GemvConfig) for up to WORDS_MAX_ROWS rows of x on 4-bit weights, or None.
    `words`: None where compiled on CUDA and the weights allow, True asks for it (an error where they do not),
    False never. `words_tile`, a tile given, asks for it where the weights allow (elsewhere the other paths)."""
    if words is False or entries is None or x.shape[0] > WORDS_MAX_ROWS:
        if words:
            raise ValueError(f"words=True takes at most {WORDS_MAX_ROWS} rows of x and 4-bit weights")
        return None
    if words is None and words_tile is None and not (x.is_cuda and not interpreter_enabled()):
        return None
    blocksize = entries[0].packed.blocksize
    if k % 8 or blocksize < 8 or any(e.words is None for e in entries):
        if words:
            raise ValueError("words=True takes K a multiple of 8, blocksize >= 8 and word-aligned packed bytes")
        return None
    if words_tile is not None:
        return words_tile
    # as many programs as row blocks (gate/up: one per block of both)
    m = x.shape[0]
    tile = tuning.pick("gemv_4bit", default_gemv_config, m, ns[0] if glu else sum(ns), k, blocksize, x.device)
    if glu and m == 1:  # a program holds rows of both weights: half the words a step, the same registers
        tile = tile._replace(nb=max(1, tile.nb // 2))
    return tile


def _packed_format(entry) -> tuple:
    return (*entry.consts.values(), entry.packed.absmax.dtype)


def packed_reason(weights) -> str | None:
    """Why `gemv` cannot read these weights in one launch as far as 4 bits go (None: it can): a 4-bit
    weight among dense ones, or 4-bit weights of different blocksizes or double quantization."""
    packed = [is_4bit(w) for w in weights]
    if not any(packed):
        return None
    if not all(packed):
        return "4-bit and dense weights mixed in one launch"
    formats = {_packed_format(_unpacked(w)) for w in weights}
    if len(formats) > 1:
        return (
            "4-bit weights of different formats (log2 blocksize, log2 nested blocksize, nested, absmax "
            f"dtype): {formats}"
        )
    return None


# the addresses of absmax, code, absmax2, code2 and offset of each 4-bit weight (a graph replays its launches
# with the table it captured: the same addresses give the same table, made once, on the device)
_PACKED_TABLES: dict[tuple, torch.Tensor] = state.register_cache("decode.packed_tables", {})


def _packed_table(entries) -> torch.Tensor:
    # args: data, absmax, code, absmax2, code2, offset (quant's pointer arguments, unused ones filled in)
    rows = [tuple(t.data_ptr() for t in e.args[1:]) for e in entries]
    device = entries[0].packed.data.device
    key = (device, *rows)
    table = _PACKED_TABLES.get(key)
    if table is None:
        table = _PACKED_TABLES[key] = torch.tensor(rows, dtype=torch.int64).to(device)
    return table


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


def gemv_reference(
    x, weights, *, norm=None, biases=None, lora=None, activation=None, residual=None, out_dtype=None, softcap=None
) -> torch.Tensor:
    """gemv in torch, the unfused modules' maths and rounding (fp32 products)."""
    from ..norms import rms_norm_reference

    dtype = x.dtype
    if norm is not None:
        x = rms_norm_reference(x, *norm)
    outs = []
    xa_col = 0
    for i, w in enumerate(weights):
        if is_4bit(w):  # rounded to x's dtype, as the kernel's tile
            w = dequantize_4bit_reference(w, dtype)
        y = _round(x.float() @ w.float().t() + (biases[i].float() if biases is not None else 0.0), dtype)
        if lora is not None and lora[1][i] is not None:
            b = lora[1][i]
            xa = lora[0][:, xa_col : xa_col + b.shape[1]].float()
            xa_col += b.shape[1]
            y = _round(y + lora[2][i] * (xa @ b.float().t()), dtype)
        outs.append(y)
    if activation is not None:
        g, u = outs
        act = {
            "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "gelu": torch.nn.functional.gelu,
        }[activation]
        y = _round(act(g) * u, dtype)
    else:
        y = torch.cat(outs, dim=1)
    if residual is not None:
        y = _round(residual.float() + y, dtype)
    if softcap is not None:
        y = _round(y / softcap, dtype)
        y = _round(torch.tanh(y), dtype)
        y = _round(y * softcap, dtype)
    return y.to(out_dtype or dtype)
