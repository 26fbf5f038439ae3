"""Cross-entropy on materialised logits, and fused with the LM head so that [N, V] logits never exist.

Both ops share one Triton row kernel (`_ce_rows`): a program reads a row once to build the
logsumexp online in fp32, then reads it again to write d(loss)/d(logits), possibly over the same buffer.
Label smoothing, z-loss, Gemma2's softcap, a logit scale and the entropy are constexpr flags of that one kernel.

`fused_linear_log_probs` is the same op read the other way round, for RL trainers: the log-probability of each
row's label is minus its cross-entropy (reduction "none"), under a sampling temperature applied after the
softcap (as TRL divides the model's final logits), with the entropy of the row's distribution and the
gradients of both.

`fused_linear_cross_entropy` walks the rows in chunks: logits_chunk = hidden_chunk @ weight.T on tensor
cores, the row kernel turns the chunk buffer into dlogits in place, and two more GEMMs give the chunk's
share of grad_hidden and grad_weight. All gradients are computed in forward and only scaled by
grad_output in backward (reduction "none" recomputes instead: its grad_output differs per row).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._utils import (
    cdiv,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    no_autocast,
    num_sms,
    rows_view,
    use_triton,
)
from .jit_helpers import tanh

REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)

# Budget for the logits chunk of the fused op: 1024 rows of a 128K bf16 vocab. Bigger chunks mean fewer
# read-modify-write passes over a trained head's 1 GiB grad_weight and fuller grad_hidden GEMMs (256 MiB the
# fastest measured: `python3 scripts/ce_chunks_gpu.py`, docs/benchmarks/kernels.md), and the op still stays
# under 256 MiB above its inputs and their grads. Tests lower it to get many chunks.
LOGITS_CHUNK_BYTES = 256 * 1024 * 1024
# Columns one program handles per loop step; tests lower it to exercise vocabularies of several blocks.
ROW_BLOCK = 8192
# Row programs per SM of the persistent grid: 1, 2, 4 and one per row measured within noise of each other, 2 the
# best (`python3 scripts/ce_chunks_gpu.py`; docs/benchmarks/kernels.md, "cross-entropy").
ROW_PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _final_logits(x, logit_scale, softcap, post_scale, HAS_SOFTCAP: tl.constexpr):
    """z = post_scale * softcap(logit_scale * x). Without a softcap the launcher folds post_scale (1 / temperature)
    into logit_scale, so only the softcapped path multiplies twice."""
    z = x.to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap) * post_scale
    return z


@triton.jit(do_not_specialize=["n_rows"])  # a new batch length compiles nothing
def _ce_rows(
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    labels_ptr,
    loss_ptr,
    bad_label_ptr,
    scale_ptr,
    scale_stride,
    entropy_ptr,
    ent_scale_ptr,
    ent_scale_stride,
    n_rows,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    post_scale,
    smoothing,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per-row loss; with WRITE_GRAD also grad_scale[row] * d(loss_row)/d(logits_row) into grad_ptr.

    loss_row = lse - (1 - eps) * z_label - eps * mean(z) + z_loss * lse^2, z = post_scale * softcap(logit_scale * x).
    HAS_ENTROPY: also the entropy of softmax(z) into entropy_ptr; ENTROPY_GRAD (with WRITE_GRAD): the gradient
    adds ent_scale[row] * d(entropy_row)/d(logits_row). Ignored rows get 0 for both and a zero gradient.
    grad_ptr may equal logits_ptr: each element is read before the same program overwrites it.
    A label outside [0, V) that is not ignore_index gives a NaN row and is written to bad_label_ptr (any one
    of them when several are: the launcher only asks whether one is there).

    A persistent grid, and pass 2 walks the row backwards, starting with the blocks pass 1 loaded last and
    so the likeliest still in L2 (a 128K bf16 vocab row is 250 KB).
    """
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):  # int64: row * stride
        _ce_row(
            row,
            logits_ptr,
            logits_stride,
            grad_ptr,
            grad_stride,
            labels_ptr,
            loss_ptr,
            bad_label_ptr,
            scale_ptr,
            scale_stride,
            entropy_ptr,
            ent_scale_ptr,
            ent_scale_stride,
            n_cols,
            ignore_index,
            logit_scale,
            softcap,
            post_scale,
            smoothing,
            z_loss,
            HAS_SOFTCAP,
            HAS_SMOOTHING,
            HAS_Z_LOSS,
            HAS_ENTROPY,
            ENTROPY_GRAD,
            WRITE_GRAD,
            BLOCK,
        )


@triton.jit
def _ce_row(
    row,
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    labels_ptr,
    loss_ptr,
    bad_label_ptr,
    scale_ptr,
    scale_stride,
    entropy_ptr,
    ent_scale_ptr,
    ent_scale_stride,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    post_scale,
    smoothing,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    label = tl.load(labels_ptr + row).to(tl.int64)
    in_row = logits_ptr + row * logits_stride
    out_row = grad_ptr + row * grad_stride
    cols = tl.arange(0, BLOCK)
    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                tl.store(out_row + offs, zeros.to(grad_ptr.dtype.element_ty), mask=offs < n_cols)
    else:
        # Pass 1: online logsumexp (running max m, running sum s of exp(z - m)), plus sum(z) for smoothing and
        # the running sum t of exp(z - m) * z for the entropy (lse - t / s, the mean logit under p).
        m = -float("inf")
        s = 0.0
        t = 0.0
        z_sum = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            # evict_last: pass 2 reads the row again (a few % faster: docs/benchmarks/kernels.md, "cross-entropy")
            raw = tl.load(in_row + offs, mask=mask, other=0.0, eviction_policy="evict_last")
            z = tl.where(mask, _final_logits(raw, logit_scale, softcap, post_scale, HAS_SOFTCAP), -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            e = tl.exp(z - m_new)
            rescale = tl.exp(m - m_new)
            s = s * rescale + tl.sum(e, axis=0)
            if HAS_ENTROPY:
                t = t * rescale + tl.sum(e * tl.where(mask, z, 0.0), axis=0)  # no 0 * -inf
            m = m_new
            if HAS_SMOOTHING:
                z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        lse = m + tl.log(s)
        mean_z = t / s
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, lse - mean_z)

        # A label outside [0, V) gives NaN rather than reading out of bounds, and is reported to the launcher.
        in_range = (label >= 0) & (label < n_cols)
        if (label < 0) | (label >= n_cols):
            tl.store(bad_label_ptr, label)
        z_label = _final_logits(
            tl.load(in_row + label, mask=in_range, other=0.0), logit_scale, softcap, post_scale, HAS_SOFTCAP
        )
        z_label = tl.where(in_range, z_label, float("nan"))
        if HAS_SMOOTHING:
            loss = lse - (1.0 - smoothing) * z_label - smoothing * (z_sum / n_cols)
        else:
            loss = lse - z_label
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr + row, loss)

        if WRITE_GRAD:
            # Pass 2: dloss/dz = p * (1 + 2 z_loss lse) - (1 - eps) [j == label] - eps / V, plus the entropy's
            # ent_scale * dH/dz = -ent_scale * p * (z - mean_z), then through the softcap (post_scale (1 - tanh^2))
            # and the logit scale, all times this row's grad scale.
            scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
            ent_scale = 0.0
            if ENTROPY_GRAD:
                ent_scale = tl.load(ent_scale_ptr + row * ent_scale_stride).to(tl.float32)
            p_coef = scale
            if HAS_Z_LOSS:
                p_coef = scale * (1.0 + 2.0 * z_loss * lse)
            label_coef = scale
            if HAS_SMOOTHING:
                label_coef = scale * (1.0 - smoothing)
            last_start = (n_cols - 1) // BLOCK * BLOCK
            for back in range(0, n_cols, BLOCK):
                offs = last_start - back + cols
                mask = offs < n_cols
                raw = tl.load(in_row + offs, mask=mask, other=0.0, eviction_policy="evict_first")  # read last
                z = _final_logits(raw, logit_scale, softcap, post_scale, HAS_SOFTCAP)
                p = tl.exp(z - lse)
                g = p * p_coef
                if ENTROPY_GRAD:
                    g -= p * ent_scale * (z - mean_z)
                g = tl.where(offs == label, g - label_coef, g)
                if HAS_SMOOTHING:
                    g -= scale * smoothing / n_cols
                if HAS_SOFTCAP:
                    capped = z / (softcap * post_scale)
                    g *= post_scale * (1.0 - capped * capped)
                g *= logit_scale
                tl.store(out_row + offs, g.to(grad_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")


@triton.jit
def _scale_in_place(x_ptr, n, scale_ptr, BLOCK: tl.constexpr):
    """x *= scale for a contiguous x and a one-element scale on the device; a scale of 1 (what a plain
    loss.backward() passes) reads and writes nothing, so the common case costs no pass over a 1 GiB grad."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- launchers


class _LossConfig(NamedTuple):
    ignore_index: int
    label_smoothing: float
    softcap: float | None
    logit_scale: float
    z_loss: float
    reduction: str
    temperature: float = 1.0  # the final logits are divided by it (after the softcap)


def _row_block(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the row kernel: 16 fp32 values per thread at the full 8192 block."""
    block = min(ROW_BLOCK, next_power_of_2(n_cols))
    return block, max(1, min(16, block // 512))


def _launch_rows(
    logits, grad, labels, loss_rows, grad_scale, cfg: _LossConfig, bad_label, entropy_rows=None, entropy_scale=None
) -> None:
    """Row kernel over 2-D `logits` (unit last stride); `grad` None computes the loss only.

    grad_scale: fp32 tensor with one value per row, or a single value for every row.
    bad_label: `_no_bad_label(...)`, where the kernel writes a label out of range; `_check_bad_label` reads it.
    entropy_rows: fp32 [rows] the kernel writes each row's entropy to (None: not computed); entropy_scale (with
    `grad` and entropy_rows): fp32 per-row weights of the entropy's gradient.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block, num_warps = _row_block(n_cols)
    write_grad = grad is not None
    scale_stride = 0 if grad_scale.numel() == 1 else 1
    entropy_grad = write_grad and entropy_scale is not None
    if entropy_grad and entropy_rows is None:
        raise ValueError("entropy_scale needs entropy_rows (the kernel computes the entropy for its gradient)")
    # 1 / temperature: folded into the logit scale, or after the softcap where there is one
    logit_scale, post_scale = cfg.logit_scale, 1.0 / cfg.temperature
    if cfg.softcap is None:
        logit_scale, post_scale = logit_scale * post_scale, 1.0
    n_programs = min(n_rows, num_sms(logits.device) * ROW_PROGRAMS_PER_SM)
    _ce_rows[(n_programs,)](
        logits,
        logits.stride(0),
        grad if write_grad else logits,
        grad.stride(0) if write_grad else 0,
        labels,
        loss_rows,
        bad_label,
        grad_scale,
        scale_stride,
        loss_rows if entropy_rows is None else entropy_rows,
        entropy_scale if entropy_grad else grad_scale,
        (0 if entropy_scale.numel() == 1 else 1) if entropy_grad else 0,
        n_rows,
        n_cols,
        cfg.ignore_index,
        logit_scale,
        cfg.softcap or 1.0,
        post_scale,
        cfg.label_smoothing,
        cfg.z_loss,
        HAS_SOFTCAP=cfg.softcap is not None,
        HAS_SMOOTHING=cfg.label_smoothing > 0,
        HAS_Z_LOSS=cfg.z_loss > 0,
        HAS_ENTROPY=entropy_rows is not None,
        ENTROPY_GRAD=entropy_grad,
        WRITE_GRAD=write_grad,
        BLOCK=block,
        num_warps=num_warps,
    )


def _no_bad_label(ignore_index: int, device) -> torch.Tensor:
    # ignore_index is the "none" value: a row whose label equals it never reports.
    return torch.full((1,), ignore_index, dtype=torch.int64, device=device)


def _label_error(label: int, n_cols: int, ignore_index: int) -> IndexError:
    # The words of torch's (and so transformers') own error first, then what was expected.
    return IndexError(
        f"Target {label} is out of bounds: labels must lie in [0, {n_cols}) (the vocabulary) or equal "
        f"ignore_index ({ignore_index})"
    )


def _check_bad_label(bad_label: torch.Tensor, n_cols: int, ignore_index: int) -> None:
    """Raise if the kernel saw a label out of range, without a host sync where one would cost.

    CPU: read it and raise IndexError now. CUDA (and while torch.compile traces): torch._assert_async, which
    stops at the next point the host waits for the GPU anyway (loss.item(), the Trainer's logging) with a
    device-side assert, as torch's own cross_entropy does on CUDA; a sync per step to raise the IndexError
    there would stall the GPU behind Python. The loss is NaN meanwhile.
    """
    if bad_label.device.type == "cpu" and not torch.compiler.is_compiling():
        label = int(bad_label[0])
        if label != ignore_index:
            raise _label_error(label, n_cols, ignore_index)
        return
    torch._assert_async(
        bad_label[0] == ignore_index,
        f"fastplug cross-entropy: a label is out of bounds (outside [0, {n_cols}) and not ignore_index {ignore_index})",
    )


def _check_label_range(labels: torch.Tensor, n_cols: int, ignore_index: int) -> None:
    """`_check_bad_label` for the torch references: the same test made with torch ops."""
    labels = labels.reshape(-1)
    if labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= n_cols))
    # gather, not labels[index]: indexing with a 0-d tensor reads the index on the host (a graph break under compile)
    first_bad = labels.gather(0, bad.to(torch.int8).argmax().reshape(1)).to(torch.int64)
    _check_bad_label(torch.where(bad.any(), first_bad, ignore_index).reshape(1), n_cols, ignore_index)


def _scale_grad(grad: torch.Tensor | None, grad_output: torch.Tensor) -> None:
    """grad *= grad_output (one element) in place, without asking the host whether it is 1 (a sync)."""
    if grad is None:
        return
    if not (grad.is_contiguous() and use_triton(grad, grad_output)):
        grad.mul_(grad_output)
        return
    block = 4096
    n_programs = max(1, min(cdiv(grad.numel(), block), num_sms(grad.device) * 8))
    _scale_in_place[(n_programs,)](grad, grad.numel(), grad_output, BLOCK=block, num_warps=8)


def logits_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk of the fused op: as many as fit LOGITS_CHUNK_BYTES, in whole 128-row GEMM tiles.

    Bigger chunks make the grad_weight GEMM (K = chunk rows) less bound by re-reading its accumulator.
    """
    fit = max(1, LOGITS_CHUNK_BYTES // (vocab * torch.finfo(dtype).bits // 8))
    rows = fit // 128 * 128 if fit >= 128 else 1 << (fit.bit_length() - 1)
    return min(n_rows, rows)


def _check_options(ignore_index, label_smoothing, softcap, z_loss, reduction, logit_scale=1.0) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int; got {ignore_index!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1]; got {label_smoothing}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive number; got {softcap}")
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a number >= 0; got {z_loss}")
    if not (math.isfinite(logit_scale) and logit_scale != 0):
        raise ValueError(f"logit_scale must be a finite non-zero number; got {logit_scale}")


def _check_labels(labels: torch.Tensor, n_rows: int, what: str) -> None:
    if labels.dtype not in LABEL_DTYPES:
        raise ValueError(f"labels must be an integer tensor; got {str(labels.dtype).replace('torch.', '')}")
    if labels.numel() != n_rows:
        raise ValueError(f"labels must have one entry per row of {what} ({n_rows}); got {labels.numel()}")


# ---------------------------------------------------------------------------- cross-entropy on logits


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, cfg: _LossConfig):
        x = rows_view(logits)
        labels = labels.reshape(-1).contiguous()
        valid = (labels != cfg.ignore_index).sum().clamp_min(1).to(torch.float32)
        if cfg.reduction == "mean":
            grad_scale = valid.reciprocal().reshape(1)  # no host sync: the count stays on the device
        else:
            grad_scale = torch.ones(1, dtype=torch.float32, device=x.device)
        grad = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        loss_rows = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        bad_label = _no_bad_label(cfg.ignore_index, x.device)
        _launch_rows(x, grad, labels, loss_rows, grad_scale, cfg, bad_label)
        _check_bad_label(bad_label, x.shape[1], cfg.ignore_index)

        ctx.grad_logits, ctx.logits_shape, ctx.reduction = grad, logits.shape, cfg.reduction
        if cfg.reduction == "none":
            return loss_rows.to(logits.dtype).reshape(logits.shape[:-1])
        total = loss_rows.sum()
        return (total * grad_scale[0] if cfg.reduction == "mean" else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad, ctx.grad_logits = ctx.grad_logits, None
        if grad is None:
            raise RuntimeError("cross_entropy: backward ran twice; its gradient buffer is used up")
        # The buffer is ours: scale it in place rather than allocate a second logits-sized tensor.
        if ctx.reduction == "none":
            grad.mul_(grad_output.reshape(-1, 1))
        else:
            _scale_grad(grad, grad_output)
        return grad.reshape(ctx.logits_shape), None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits [..., V] against labels [...], as torch.nn.functional.cross_entropy.

    softcap: Gemma2's final_logit_softcapping (z = softcap * tanh(logits / softcap)) applied first.
    z_loss adds z_loss * logsumexp(z)^2 per non-ignored row. "mean" divides by the non-ignored count
    (a batch with every label ignored gives 0). The loss has the logits' dtype; the maths runs in fp32.
    A label outside [0, V) other than ignore_index raises IndexError("Target ... is out of bounds") on CPU;
    on CUDA a device-side assert stops the run at its next host sync (no sync of its own; see _check_bad_label).
    """
    check_dtype("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V > 0; got {tuple(logits.shape)}")
    n_rows = logits.numel() // logits.shape[-1]
    _check_labels(labels, n_rows, "logits")
    _check_options(ignore_index, label_smoothing, softcap, z_loss, reduction)
    labels = labels.to(logits.device)
    cfg = _LossConfig(ignore_index, float(label_smoothing), softcap, 1.0, float(z_loss), reduction)
    if not use_triton(logits, labels):
        return cross_entropy_reference(
            logits,
            labels,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            softcap=softcap,
            z_loss=z_loss,
            reduction=reduction,
        )
    return _CrossEntropy.apply(logits, labels, cfg)


# ------------------------------------------------------------------------- fused with the linear head


def _plan_chunks(n_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """(start, end) of each row chunk. Every chunk runs, even one whose labels are all ignored: skipping
    it would need the labels on the host, and a host sync mid-step stalls the GPU behind Python."""
    return [(start, min(n_rows, start + chunk_rows)) for start in range(0, n_rows, chunk_rows)]


def _linear_ce_chunks(
    hidden,
    weight,
    bias,
    labels,
    cfg,
    chunks,
    chunk_rows,
    loss_rows,
    grad_scale,
    grad_hidden=None,
    grad_weight=None,
    grad_bias=None,
    entropy_rows=None,
    entropy_scale=None,
) -> None:
    """Loss rows of the given chunks, and (into the buffers that are not None) the gradients.

    grad_weight is overwritten by the first chunk; grad_bias is an fp32 accumulator. entropy_rows / entropy_scale:
    the rows' entropies and their gradient weights (`_launch_rows`).
    """
    write_grad = grad_hidden is not None or grad_weight is not None or grad_bias is not None
    buf = torch.empty(min(chunk_rows, hidden.shape[0]), weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    per_row_scale = grad_scale.numel() > 1
    bad_label = _no_bad_label(cfg.ignore_index, hidden.device)
    first = True
    for start, end in chunks:
        h = hidden[start:end]
        logits = buf[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        scale = grad_scale[start:end] if per_row_scale else grad_scale
        entropy = None if entropy_rows is None else entropy_rows[start:end]
        entropy_weight = None
        if entropy_scale is not None:
            entropy_weight = entropy_scale[start:end] if entropy_scale.numel() > 1 else entropy_scale
        # In place: the chunk's logits become its dlogits (the buffer is ours).
        _launch_rows(logits, logits if write_grad else None, labels[start:end], loss_rows[start:end], scale, cfg,
                     bad_label, entropy, entropy_weight)  # fmt: skip
        if grad_hidden is not None:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            if first:
                torch.mm(logits.t(), h, out=grad_weight)
            else:
                grad_weight.addmm_(logits.t(), h)
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=torch.float32)
        first = False
    if grad_weight is not None and first:
        grad_weight.zero_()
    _check_bad_label(bad_label, weight.shape[0], cfg.ignore_index)


def _loss_and_grads(
    hidden, weight, bias, labels, cfg, chunks, chunk_rows, loss_rows, grad_scale, needs, entropy_rows=None,
    entropy_scale=None,
):  # fmt: skip
    """Loss rows of all chunks (into loss_rows) and the gradients of (hidden, weight, bias) that `needs` asks
    for, None for the others; the bias gradient is summed in fp32 and returned in the bias dtype."""
    need_h, need_w, need_b = needs
    grad_hidden = torch.empty_like(hidden) if need_h else None
    grad_weight = torch.empty_like(weight) if need_w else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device) if need_b else None
    _linear_ce_chunks(hidden, weight, bias, labels, cfg, chunks, chunk_rows, loss_rows, grad_scale,
                      grad_hidden, grad_weight, grad_bias, entropy_rows, entropy_scale)  # fmt: skip
    return grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, cfg: _LossConfig, inv_divisor, chunks, chunk_rows):
        n = hidden.shape[0]
        loss_rows = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        ctx.cfg, ctx.chunks, ctx.chunk_rows = cfg, chunks, chunk_rows
        if cfg.reduction == "none":
            # Each row's grad_output is only known in backward: recompute the chunks there.
            _linear_ce_chunks(hidden, weight, bias, labels, cfg, chunks, chunk_rows, loss_rows, inv_divisor)
            ctx.save_for_backward(hidden, weight, bias, labels)
            return loss_rows
        ctx.grads = _loss_and_grads(hidden, weight, bias, labels, cfg, chunks, chunk_rows, loss_rows, inv_divisor,
                                    ctx.needs_input_grad[:3])  # fmt: skip
        return loss_rows.sum() * inv_divisor[0]

    @staticmethod
    def backward(ctx, grad_output):
        cfg = ctx.cfg
        if cfg.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            scratch = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            grads = _loss_and_grads(hidden, weight, bias, labels, cfg, ctx.chunks, ctx.chunk_rows, scratch,
                                    grad_output.to(torch.float32).contiguous(), ctx.needs_input_grad[:3])  # fmt: skip
        else:
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError("fused_linear_cross_entropy: backward ran twice; its gradients are used up")
            for g in grads:
                _scale_grad(g, grad_output)
        return (*grads, None, None, None, None, None)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Under autocast the head runs in the autocast dtype, as nn.Linear would; otherwise in hidden's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype; got {hidden.dtype} and {weight.dtype}")
    return hidden.dtype


def _inverse_divisor(reduction, labels, ignore_index, num_items_in_batch, device) -> torch.Tensor:
    """1 / (what the summed loss is divided by), as a 1-element fp32 tensor on the device (no host sync)."""
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError(f"num_items_in_batch needs reduction='mean'; got reduction={reduction!r}")
        divisor = torch.as_tensor(num_items_in_batch).to(device=device, dtype=torch.float32)
        if divisor.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a number; got a tensor of shape {tuple(divisor.shape)}")
        return divisor.reshape(1).reciprocal()
    if reduction == "mean":
        n_valid = (labels != ignore_index).sum().clamp_min(1)
        return n_valid.to(torch.float32).reshape(1).reciprocal()
    return torch.ones(1, dtype=torch.float32, device=device)


def _check_linear_inputs(hidden, weight, bias, labels) -> int:
    """The shared input checks of the fused ops; returns the number of rows."""
    check_dtype("hidden", hidden)
    check_dtype("weight", weight)
    if weight.dim() != 2 or 0 in weight.shape:
        raise ValueError(f"weight must have shape [V, H] with V, H > 0; got {tuple(weight.shape)}")
    vocab, hidden_size = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden must have shape [..., {hidden_size}] to match weight [V, H]; got {tuple(hidden.shape)}"
        )
    if bias is not None:
        check_dtype("bias", bias)
        check_shape("bias", bias, (vocab,), "one per row of weight")
    n_rows = hidden.numel() // hidden_size
    _check_labels(labels, n_rows, "hidden")
    check_same_device(hidden=hidden, weight=weight, bias=bias)
    return n_rows


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of (hidden @ weight.T + bias) * logit_scale, softcapped, without the [N, V] logits.

    hidden [..., H], weight [V, H], labels [...] already shifted (one per hidden row). With
    num_items_in_batch the summed loss is divided by it (transformers' gradient-accumulation loss);
    otherwise the semantics are those of `cross_entropy`, out-of-range labels included. The loss is fp32
    (reduction "none": [N] rows). No rows at all give 0 and zero gradients, as rows that are all ignored do.
    """
    n_rows = _check_linear_inputs(hidden, weight, bias, labels)
    _check_options(ignore_index, label_smoothing, softcap, z_loss, reduction, logit_scale)
    labels = labels.to(hidden.device)
    if not use_triton(hidden, weight, bias, labels):
        return fused_linear_cross_entropy_reference(
            hidden,
            weight,
            labels,
            bias=bias,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            softcap=softcap,
            logit_scale=logit_scale,
            z_loss=z_loss,
            reduction=reduction,
            num_items_in_batch=num_items_in_batch,
        )

    dtype = _compute_dtype(hidden, weight)
    hidden2 = rows_view(hidden.to(dtype))
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    labels = labels.reshape(-1).contiguous()
    chunk_rows = logits_chunk_rows(max(n_rows, 1), weight.shape[0], dtype)
    chunks = _plan_chunks(n_rows, chunk_rows)
    inv_divisor = _inverse_divisor(reduction, labels, ignore_index, num_items_in_batch, hidden.device)
    cfg = _LossConfig(ignore_index, float(label_smoothing), softcap, float(logit_scale), float(z_loss), reduction)
    if torch.compiler.is_compiling() and reduction != "none":
        needs = (hidden2.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        return _linear_ce_op(hidden2, weight, bias, labels, inv_divisor, cfg.ignore_index, cfg.label_smoothing,
                             softcap, cfg.logit_scale, cfg.z_loss, *needs)[0]  # fmt: skip
    loss = _FusedLinearCrossEntropy.apply(hidden2, weight, bias, labels, cfg, inv_divisor, chunks, chunk_rows)
    return loss.reshape(hidden.shape[:-1]) if reduction == "none" else loss


# ------------------------------------------------------------------------- per-token log-probabilities


class _FusedLinearLogProbs(torch.autograd.Function):
    """Minus the cross-entropy rows (and the entropies) of the chunks; the backward recomputes the chunks with each
    row's grad_output, as reduction "none" of the loss does."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, cfg: _LossConfig, chunks, chunk_rows, with_entropy: bool):
        ctx.set_materialize_grads(False)  # the entropy is often only logged: no gradient to fold in then
        rows = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(rows) if with_entropy else None
        unused_scale = torch.ones(1, dtype=torch.float32, device=hidden.device)
        _linear_ce_chunks(hidden, weight, bias, labels, cfg, chunks, chunk_rows, rows, unused_scale,
                          entropy_rows=entropy)  # fmt: skip
        ctx.cfg, ctx.chunks, ctx.chunk_rows = cfg, chunks, chunk_rows
        ctx.save_for_backward(hidden, weight, bias, labels)
        return rows.neg_(), entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, labels = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if (grad_log_probs is None and grad_entropy is None) or not any(needs):
            return (None,) * 8
        device = hidden.device
        # the kernel's rows are cross-entropies: d/d(-log p) = -grad_log_probs
        if grad_log_probs is None:
            scale = torch.zeros(1, dtype=torch.float32, device=device)
        else:
            scale = grad_log_probs.to(torch.float32).neg().contiguous()
        entropy_scale = entropy = None
        if grad_entropy is not None:
            entropy_scale = grad_entropy.to(torch.float32).contiguous()
            entropy = torch.empty(hidden.shape[0], dtype=torch.float32, device=device)
        scratch = torch.empty(hidden.shape[0], dtype=torch.float32, device=device)
        grads = _loss_and_grads(hidden, weight, bias, labels, ctx.cfg, ctx.chunks, ctx.chunk_rows, scratch, scale,
                                needs, entropy, entropy_scale)  # fmt: skip
        return (*grads, None, None, None, None, None)


def _check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number > 0; got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature}")


def fused_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each row's label, and with `entropy=True` the entropy of the row's distribution, under
    softmax(z / temperature) with z = softcap(logit_scale * (hidden @ weight.T + bias)), without the [N, V] logits.

    The temperature divides the final (softcapped) logits, as TRL's trainers do. hidden [..., H], weight [V, H],
    labels [...] (one per hidden row). Returns (log_probs, entropy or None), fp32, of shape hidden.shape[:-1];
    rows whose label is ignore_index give 0 for both and no gradient. Both outputs are differentiable in hidden,
    weight and bias (the backward recomputes the logits chunk by chunk). At temperature 1 the log-probs equal
    -fused_linear_cross_entropy(..., reduction="none"); out-of-range labels raise as there.
    """
    n_rows = _check_linear_inputs(hidden, weight, bias, labels)
    _check_options(ignore_index, 0.0, softcap, 0.0, "none", logit_scale)
    _check_temperature(temperature)
    labels = labels.to(hidden.device)
    if not use_triton(hidden, weight, bias, labels):
        return fused_linear_log_probs_reference(
            hidden,
            weight,
            labels,
            bias=bias,
            temperature=temperature,
            softcap=softcap,
            logit_scale=logit_scale,
            ignore_index=ignore_index,
            entropy=entropy,
        )
    dtype = _compute_dtype(hidden, weight)
    hidden2 = rows_view(hidden.to(dtype))
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    labels = labels.reshape(-1).contiguous()
    chunk_rows = logits_chunk_rows(max(n_rows, 1), weight.shape[0], dtype)
    cfg = _LossConfig(ignore_index, 0.0, softcap, float(logit_scale), 0.0, "none", float(temperature))
    log_probs, entropies = _FusedLinearLogProbs.apply(
        hidden2, weight, bias, labels, cfg, _plan_chunks(n_rows, chunk_rows), chunk_rows, bool(entropy)
    )
    shape = hidden.shape[:-1]
    return log_probs.reshape(shape), None if entropies is None else entropies.reshape(shape)


# ------------------------------------------------------------------------------- registered operator
# What torch.compile traces for reductions "mean"/"sum" (the training loss); eager calls keep the autograd
# Function. Like it, the forward computes the gradients (the logits never exist whole) and the backward
# scales them by grad_output; gradients not asked for are empty tensors (operators cannot return None).
@torch.library.custom_op(
    "fastplug::linear_cross_entropy",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor inv_divisor, int ignore_index, "
    "float label_smoothing, float? softcap, float logit_scale, float z_loss, bool need_h, bool need_w, bool need_b) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _linear_ce_op(hidden, weight, bias, labels, inv_divisor, ignore_index, label_smoothing, softcap, logit_scale,
                  z_loss, need_h, need_w, need_b):  # fmt: skip
    cfg = _LossConfig(ignore_index, label_smoothing, softcap, logit_scale, z_loss, "sum")
    chunk_rows = logits_chunk_rows(max(hidden.shape[0], 1), weight.shape[0], hidden.dtype)
    loss_rows = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    grads = _loss_and_grads(hidden, weight, bias, labels, cfg, _plan_chunks(hidden.shape[0], chunk_rows), chunk_rows,
                            loss_rows, inv_divisor, (need_h, need_w, need_b))  # fmt: skip
    return (loss_rows.sum() * inv_divisor[0], *(hidden.new_empty(0) if g is None else g for g in grads))


@_linear_ce_op.register_fake
def _(hidden, weight, bias, labels, inv_divisor, ignore_index, label_smoothing, softcap, logit_scale, z_loss,
      need_h, need_w, need_b):  # fmt: skip
    return (
        hidden.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden) if need_h else hidden.new_empty(0),
        torch.empty_like(weight) if need_w else hidden.new_empty(0),
        bias.new_empty(bias.shape) if need_b else hidden.new_empty(0),
    )


def _setup_linear_ce(ctx, inputs, output):
    ctx.grads = output[1:]
    ctx.mark_non_differentiable(*output[1:])


def _linear_ce_backward(ctx, grad_output, *_):
    needs = ctx.needs_input_grad[:3]
    grads = [g * grad_output.to(g.dtype) if need else None for g, need in zip(ctx.grads, needs)]
    return (*grads, *[None] * 10)


_linear_ce_op.register_autograd(_linear_ce_backward, setup_context=_setup_linear_ce)


# ------------------------------------------------------------------------------------------ references


def _reference_loss(z, labels, ignore_index, label_smoothing, softcap, z_loss, reduction, divisor=None):
    """Plain torch on final logits z [N, V] (already float): per-row loss, reduced."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    labels = labels.reshape(-1).to(z.device)
    _check_label_range(labels, z.shape[-1], ignore_index)
    valid = labels != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    z_label = z.gather(1, torch.where(valid, labels, 0).long().unsqueeze(1)).squeeze(1)
    rows = lse - (1.0 - label_smoothing) * z_label - label_smoothing * z.mean(-1) + z_loss * lse * lse
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    if divisor is None:
        divisor = valid.sum().clamp_min(1)
    return rows.sum() / torch.as_tensor(divisor, device=z.device).to(z.dtype)


def _reference_logits(hidden, weight, bias, logit_scale):
    """logit_scale * (hidden @ weight.T + bias) as [N, V] in (at least) fp32.

    Under autocast the inputs are rounded to the autocast dtype first, as the fused ops (and nn.Linear) round them,
    but the matmul runs outside autocast: inside, it would return bf16 logits and so bf16 log-probs and losses,
    where the fused ops accumulate in fp32 and return fp32.
    """
    tensors = (hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        low = torch.get_autocast_dtype(device_type)
        # autocast leaves float64 alone (the tests' references)
        tensors = tuple(t if t is None or t.dtype == torch.float64 else t.to(low) for t in tensors)
    hidden2, weight, bias = tensors
    dtype = torch.promote_types(hidden2.dtype, torch.float32)
    with no_autocast(hidden2):
        z = hidden2.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    return z * logit_scale


def cross_entropy_reference(
    logits,
    labels,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    z_loss=0.0,
    reduction="mean",
):
    """`cross_entropy` in plain torch, with the logits materialised in (at least) fp32."""
    _check_options(ignore_index, label_smoothing, softcap, z_loss, reduction)
    z = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    loss = _reference_loss(z, labels, ignore_index, label_smoothing, softcap, z_loss, reduction)
    if reduction == "none":
        loss = loss.reshape(logits.shape[:-1])
    return loss.to(logits.dtype)


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    logit_scale=1.0,
    z_loss=0.0,
    reduction="mean",
    num_items_in_batch=None,
):
    """`fused_linear_cross_entropy` in plain torch: the [N, V] logits in (at least) fp32."""
    _check_options(ignore_index, label_smoothing, softcap, z_loss, reduction, logit_scale)
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"num_items_in_batch needs reduction='mean'; got reduction={reduction!r}")
    z = _reference_logits(hidden, weight, bias, logit_scale)
    loss = _reference_loss(
        z, labels, ignore_index, label_smoothing, softcap, z_loss, reduction, divisor=num_items_in_batch
    )
    return loss.reshape(hidden.shape[:-1]) if reduction == "none" else loss


def fused_linear_log_probs_reference(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    temperature=1.0,
    softcap=None,
    logit_scale=1.0,
    ignore_index=-100,
    entropy=False,
):
    """`fused_linear_log_probs` in plain torch: the [N, V] logits in (at least) fp32."""
    _check_options(ignore_index, 0.0, softcap, 0.0, "none", logit_scale)
    _check_temperature(temperature)
    z = _reference_logits(hidden, weight, bias, logit_scale)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    labels = labels.reshape(-1).to(z.device)
    _check_label_range(labels, z.shape[-1], ignore_index)
    valid = labels != ignore_index
    picked = log_p.gather(1, torch.where(valid, labels, 0).long().unsqueeze(1)).squeeze(1)
    shape = hidden.shape[:-1]
    log_probs = torch.where(valid, picked, torch.zeros_like(picked)).reshape(shape)
    if not entropy:
        return log_probs, None
    rows = -(log_p.exp() * log_p).sum(-1)
    return log_probs, torch.where(valid, rows, torch.zeros_like(rows)).reshape(shape)
