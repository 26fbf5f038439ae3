"""The chunked gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next), forward and backward.

Per head, with q and k L2-normalised (q also scaled by Dk^-0.5), g the log decay and beta the write strength:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t        (S: Dk x Dv)

Chunks of C = 64 tokens turn the recurrence into matmuls (the WY form of the DeltaNet paper, as transformers'
`torch_chunk_gated_delta_rule` computes it). With Gc the decay's cumulative sum inside a chunk and
D_ij = exp(Gc_i - Gc_j) for i >= j (0 above):

    T = (I + strictly_lower((beta k) k^T * D))^-1      U = T (beta v)      W = T (beta k exp(Gc))
    Qd = q exp(Gc)    Kd = k exp(Gc_last - Gc)    P = (q k^T) * D    gamma = exp(Gc_last)
    per chunk, in order:  V = U - W S;  O = Qd S + P V;  S <- gamma S + Kd^T V

Stage one (everything up to gamma) has no sequential dependence: plain torch ops over all chunks at once, the
triangular solve included. Stage two, the scan over chunks, is one Triton kernel: a program per (sequence and
head, block of Dv) holds its block of S in registers across the chunks. Its backward: the forward kernel again,
writing each chunk's starting state and new values V (transient buffers, not kept between forward and backward),
then a kernel walking the chunks in reverse with dS in registers (dV needs no state), then the gradients of W, Qd,
Kd, P and gamma as batched matmuls over all chunks.

Checkpoint-friendly: the forward keeps only its inputs (q, k, v, g, beta); backward recomputes stage one, runs the
two kernels and then stage one's backward (derived by hand, `_prepare_backward`: no autograd inside, so the
operator torch.compile traces runs the same code). So a layer holds no chunk-sized intermediates between its
forward and backward, checkpointed or not.

With flash-linear-attention installed (`pip install fastplug[fla]`, the `fla` package; imported only when a
call needs it), CUDA tensors take fla's fused `chunk_gated_delta_rule` instead (the kernels transformers uses
when fla is installed). Tensors Triton cannot run take stage one and a torch loop over the chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..versions import release
from . import tuning
from ._utils import cdiv, check_dtype, check_same_device, next_power_of_2, use_triton

CHUNK = 64
MAX_HEAD_DIM = 256
IMPLEMENTATIONS = ("fla", "triton", "torch")
_L2_EPS = 1e-6  # transformers' and fla's l2norm: x * rsqrt(sum(x^2) + 1e-6)

# ----------------------------------------------------------------------------------------------------
# 1. Triton kernels: the scan over chunks
# ----------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_chunks"])  # a new batch length compiles nothing
def _scan_fwd(
    W, U, QD, KD, P, GAMMA, O, S_FINAL, STATES, V_NEW, n_chunks, dk, dv,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STORE_OUT: tl.constexpr, STORE_FINAL: tl.constexpr,
    STORE_STATES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # operands per (sequence, head) `bh`: W, QD, KD [Tp, dk]; U, O [Tp, dv]; P [n_chunks, C, C]; GAMMA [n_chunks]
    bh = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    k_mask, v_mask = rk < dk, rv < dv
    kv_mask = k_mask[:, None] & v_mask[None, :]
    tokens = n_chunks * C
    s = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(n_chunks):
        rows = n * C + rc
        if STORE_STATES:  # for the backward: the state this chunk starts from, and (below) its new values
            tl.store(STATES + (bh * n_chunks + n) * dk * dv + rk[:, None] * dv + rv[None, :], s, mask=kv_mask)
        ck = bh * tokens * dk + rows[:, None] * dk + rk[None, :]
        cv = bh * tokens * dv + rows[:, None] * dv + rv[None, :]
        w = tl.load(W + ck, mask=k_mask[None, :], other=0.0)
        u = tl.load(U + cv, mask=v_mask[None, :], other=0.0)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)
        if STORE_STATES:
            tl.store(V_NEW + cv, v_new, mask=v_mask[None, :])
        if STORE_OUT:
            qd = tl.load(QD + ck, mask=k_mask[None, :], other=0.0)
            p = tl.load(P + (bh * n_chunks + n) * C * C + rc[:, None] * C + rc[None, :])
            o = tl.dot(qd, s, input_precision=PRECISION) + tl.dot(p, v_new, input_precision=PRECISION)
            tl.store(O + cv, o, mask=v_mask[None, :])
        kd = tl.load(KD + ck, mask=k_mask[None, :], other=0.0)
        gamma = tl.load(GAMMA + bh * n_chunks + n)
        s = gamma * s + tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
    if STORE_FINAL:
        tl.store(S_FINAL + bh * dk * dv + rk[:, None] * dv + rv[None, :], s, mask=kv_mask)


@triton.jit(do_not_specialize=["n_chunks"])  # a new batch length compiles nothing
def _scan_bwd(
    W, QD, KD, P, GAMMA, DO, DS_FINAL, DU, DS_NEXT, n_chunks, dk, dv,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DS_FINAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # Reverse over chunks with dS (the grad of the state leaving the chunk) in registers; the state itself is not
    # needed:  dV = P^T dO + Kd dS (= dU);  DS_NEXT[n] = dS;  dS <- gamma dS + Qd^T dO - W^T dV.
    # The launcher takes dW, dQd, dKd, dP, dgamma from DS_NEXT, the chunk states and new values (batched matmuls).
    bh = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    k_mask, v_mask = rk < dk, rv < dv
    kv_mask = k_mask[:, None] & v_mask[None, :]
    tokens = n_chunks * C
    if HAS_DS_FINAL:
        ds = tl.load(DS_FINAL + bh * dk * dv + rk[:, None] * dv + rv[None, :], mask=kv_mask, other=0.0)
    else:
        ds = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(n_chunks):
        n = n_chunks - 1 - i
        rows = n * C + rc
        tl.store(DS_NEXT + (bh * n_chunks + n) * dk * dv + rk[:, None] * dv + rv[None, :], ds, mask=kv_mask)
        ck = bh * tokens * dk + rows[:, None] * dk + rk[None, :]
        cv = bh * tokens * dv + rows[:, None] * dv + rv[None, :]
        do = tl.load(DO + cv, mask=v_mask[None, :], other=0.0)
        p = tl.load(P + (bh * n_chunks + n) * C * C + rc[:, None] * C + rc[None, :])
        kd = tl.load(KD + ck, mask=k_mask[None, :], other=0.0)
        dv_new = tl.dot(tl.trans(p), do, input_precision=PRECISION) + tl.dot(kd, ds, input_precision=PRECISION)
        tl.store(DU + cv, dv_new, mask=v_mask[None, :])
        gamma = tl.load(GAMMA + bh * n_chunks + n)
        qd = tl.load(QD + ck, mask=k_mask[None, :], other=0.0)
        w = tl.load(W + ck, mask=k_mask[None, :], other=0.0)
        ds = (
            gamma * ds
            + tl.dot(tl.trans(qd), do, input_precision=PRECISION)
            - tl.dot(tl.trans(w), dv_new, input_precision=PRECISION)
        )


# ----------------------------------------------------------------------------------------------------
# 2. Stage one (torch) and the launchers
# ----------------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def _heads_first(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B * H, Tp, ...] in fp32 (Tp: T padded with zeros to whole chunks)."""
    x = x.transpose(1, 2).float()
    pad = tokens - x.shape[2]
    if pad:
        widths = (0, 0) * (x.dim() - 3) + (0, pad)
        x = torch.nn.functional.pad(x, widths)
    return x.reshape(-1, tokens, *x.shape[3:])


class _StageOne(NamedTuple):
    """What stage one computes, per (sequence and head, chunk) in fp32: the scan's operands and the intermediates
    its backward reads (recomputed there, never kept between forward and backward)."""

    parts: tuple  # (W, U, Qd, Kd [BH, Tp, D], P [BH, N, C, C], gamma [BH, N]): the scan's operands
    q_raw: torch.Tensor  # [BH, N, C, Dk] before L2 normalisation (q, k repeated for grouped values)
    k_raw: torch.Tensor
    q_rstd: torch.Tensor  # [BH, N, C, 1] rsqrt(sum x^2 + eps)
    k_rstd: torch.Tensor
    q: torch.Tensor  # normalised (q also scaled by Dk^-0.5)
    k: torch.Tensor
    v: torch.Tensor  # [BH, N, C, Dv]
    beta: torch.Tensor  # [BH, N, C, 1]
    decays: tuple  # (E = exp(Gc) [BH, N, C], F = exp(Gc_last - Gc), D [BH, N, C, C], gamma)
    k_beta: torch.Tensor
    kk: torch.Tensor  # (beta k) k^T [BH, N, C, C]
    qk: torch.Tensor  # q k^T
    system: torch.Tensor  # (beta k) k^T * D: its strictly lower part and the identity make the solved matrix
    solution: torch.Tensor  # [U | W] [BH, N, C, Dv + Dk]


def _prepare(q, k, v, g, beta) -> _StageOne:
    """Stage one: the scan's operands from the layer's q, k [B, T, Hk, Dk], v [B, T, H, Dv], g, beta [B, T, H]; fp32,
    [B * H, ...], contiguous."""
    heads, k_heads = v.shape[2], k.shape[2]
    if heads != k_heads:  # grouped values: each q/k head serves heads // k_heads consecutive value heads
        q, k = (t.repeat_interleave(heads // k_heads, dim=2) for t in (q, k))
    tokens = cdiv(q.shape[1], CHUNK) * CHUNK
    n = tokens // CHUNK
    q_raw, k_raw, v, g, beta = (_heads_first(t, tokens) for t in (q, k, v, g, beta))
    bh = q_raw.shape[0]
    q_raw, k_raw, v = (t.view(bh, n, CHUNK, t.shape[-1]) for t in (q_raw, k_raw, v))
    q_rstd, k_rstd = (torch.rsqrt((t * t).sum(-1, keepdim=True) + _L2_EPS) for t in (q_raw, k_raw))
    qc = q_raw * q_rstd * q_raw.shape[-1] ** -0.5
    kc = k_raw * k_rstd
    gc = g.view(bh, n, CHUNK).cumsum(-1)
    beta = beta.view(bh, n, CHUNK, 1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q_raw.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    e = gc.exp()
    f = (gc[..., -1:] - gc).exp()
    k_beta = kc * beta
    kk = k_beta @ kc.transpose(-1, -2)
    system = kk * decay
    rhs = torch.cat((v * beta, k_beta * e.unsqueeze(-1)), dim=-1)
    # unitriangular: the solve reads the strictly lower part alone (the identity stands for the diagonal)
    solution = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solution.split([v.shape[-1], kc.shape[-1]], dim=-1)
    qk = qc @ kc.transpose(-1, -2)
    gamma = e[..., -1].contiguous()
    flat = (t.reshape(bh, tokens, t.shape[-1]).contiguous() for t in (w, u, qc * e.unsqueeze(-1), kc * f.unsqueeze(-1)))
    parts = (*flat, (qk * decay).contiguous(), gamma)
    return _StageOne(parts, q_raw, k_raw, q_rstd, k_rstd, qc, kc, v, beta, (e, f, decay, gamma), k_beta, kk, qk,
                     system, solution)  # fmt: skip


def _l2norm_backward(raw, rstd, grad, scale: float):
    """d raw of y = raw * rstd * scale, rstd = (sum raw^2 + eps)^-1/2."""
    return scale * rstd * (grad - raw * (rstd * rstd) * (raw * grad).sum(-1, keepdim=True))


def _prepare_backward(st: _StageOne, grads, shapes):
    """Grads of (q, k, v, g, beta) in the caller's shapes (fp32) from the grads of the scan's operands: stage one's
    backward, derived by hand (no autograd inside, so the registered operator's backward runs it too)."""
    dw, du, dqd, dkd, dp, dgamma = grads
    bh, n = st.q.shape[:2]
    dw, du, dqd, dkd = (t.view(bh, n, CHUNK, t.shape[-1]) for t in (dw, du, dqd, dkd))
    e, f, decay, gamma = st.decays
    # solution = A^-1 rhs with A = I + strictly_lower(system): d rhs = A^-T d solution, dA = -d rhs solution^T
    d_rhs = torch.linalg.solve_triangular(
        st.system.transpose(-1, -2), torch.cat((du, dw), dim=-1), upper=True, unitriangular=True
    )
    d_system = -(d_rhs @ st.solution.transpose(-1, -2)).tril(-1)
    d_decay = d_system * st.kk + dp * st.qk
    d_kk, d_qk = d_system * decay, dp * decay
    d_k_beta = d_kk @ st.k
    dk = d_kk.transpose(-1, -2) @ st.k_beta + d_qk.transpose(-1, -2) @ st.q + dkd * f.unsqueeze(-1)
    dq = d_qk @ st.k + dqd * e.unsqueeze(-1)
    d_vb, d_kbe = d_rhs.split([st.v.shape[-1], st.k.shape[-1]], dim=-1)
    dv = d_vb * st.beta
    d_k_beta = d_k_beta + d_kbe * e.unsqueeze(-1)
    dk = dk + d_k_beta * st.beta
    d_beta = (d_vb * st.v).sum(-1) + (d_k_beta * st.k).sum(-1)
    de = (d_kbe * st.k_beta).sum(-1) + (dqd * st.q).sum(-1)
    df = (dkd * st.k).sum(-1)
    # Gc: E = exp(Gc), F = exp(Gc_last - Gc), D_ij = exp(Gc_i - Gc_j), gamma = exp(Gc_last); g = diff of Gc
    d_gc = de * e - df * f
    d_gc[..., -1] += (df * f).sum(-1) + dgamma * gamma
    through_decay = d_decay * decay
    d_gc = d_gc + through_decay.sum(-1) - through_decay.sum(-2)
    dg = d_gc.flip(-1).cumsum(-1).flip(-1)
    dq = _l2norm_backward(st.q_raw, st.q_rstd, dq, st.q_raw.shape[-1] ** -0.5)
    dk = _l2norm_backward(st.k_raw, st.k_rstd, dk, 1.0)
    return _heads_last(dq, dk, dv, dg, d_beta, shapes)


def _heads_last(dq, dk, dv, dg, d_beta, shapes):
    """[BH, N, C, ...] grads back to the callers' [B, T, H, ...] (q and k summed over the value heads they serve)."""
    (batch, tokens, k_heads, dk_dim), heads = shapes[0], shapes[2][2]

    def back(t):
        t = t.reshape(batch, heads, -1, *t.shape[3:])[:, :, :tokens]
        return t.transpose(1, 2)

    dq, dk = (back(t) for t in (dq, dk))
    if heads != k_heads:
        dq, dk = (t.reshape(batch, tokens, k_heads, heads // k_heads, dk_dim).sum(3) for t in (dq, dk))
    return dq, dk, back(dv), back(dg.unsqueeze(-1)).squeeze(-1), back(d_beta.unsqueeze(-1)).squeeze(-1)


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """One launch of `_scan_fwd` or `_scan_bwd`: a program holds a [block_k, block_v] block of the state."""

    block_k: int  # all of Dk (a power of two, 16 at least: tl.dot's least)
    block_v: int  # Dv in blocks of this many columns (a power of two)
    num_warps: int
    num_stages: int  # software pipelining of the chunk loop's loads (each stage holds a chunk's operands)


# sm_90's limit of shared memory per program (227 KiB); tests/kernels/test_delta_rule_sm90.py compiles the scan
# kernels for sm_90 without a GPU and checks every launch below against it
HOPPER_SHARED_MEMORY = 232448


@functools.lru_cache(maxsize=64)
def scan_config(dk: int, dv: int) -> ScanConfig:
    """Dk 128 (Qwen3.5's): 32 value columns a program, 8 warps; sm_90's compile then holds the bf16 layers' kernels
    in 177-230 registers without spills (ptxas -v; 64 columns spilled; fp32 layers' tf32x3 dots spill up to 1 KiB
    a thread). Narrower heads take 64 columns.

    One stage: every chunk's operands (W, Qd, Kd: C x Dk fp32, P: C x C) are loaded once and used at once, and
    Triton's default three stages hold three chunks' worth. Shared memory per program as Triton 3.6-3.9 compile for
    sm_90 (Dk = Dv, block_v as chosen; forward / backward, tf32): 1 stage 74 / 82 KiB at 128 and 123 / 147 KiB at
    256; 2 stages 262 / 279 KiB at 128; 3 stages (the default) 385 / 401 KiB at 128, over the 227 KiB limit."""
    block_k = max(16, next_power_of_2(dk))
    block_v = max(16, min(32 if block_k >= 128 else 64, next_power_of_2(dv)))
    return ScanConfig(block_k, block_v, 8 if block_k * block_v >= 4096 else 4, num_stages=1)


def _blocks(dk: int, dv: int) -> ScanConfig:
    return tuning.pick("gated_delta_scan", scan_config, dk, dv)


def _precision(dtype: torch.dtype) -> str:
    # fp32 layers: three TF32 products per dot (fp32's accuracy on tensor cores; plain fp32 dots spill registers
    # by the tens of KiB); bf16/fp16 layers: TF32's, finer than their inputs
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _scan(parts, want_final: bool, precision: str, *, store_out: bool = True, states=None, v_new=None):
    """O [BH, Tp, Dv] and the final state [BH, Dk, Dv] (None unless wanted); with `states` [BH, N, Dk, Dv] and
    `v_new` [BH, Tp, Dv] given, fills them with the state each chunk starts from and its new values."""
    w, u, qd, kd, p, gamma = parts
    bh, tokens, dk = w.shape
    dv = u.shape[-1]
    cfg = _blocks(dk, dv)
    o = torch.empty_like(u) if store_out else None
    final = w.new_empty((bh, dk, dv)) if want_final else None
    _scan_fwd[(bh, cdiv(dv, cfg.block_v))](
        w, u, qd, kd, p, gamma, o if o is not None else u, final if final is not None else u,
        states if states is not None else u, v_new if v_new is not None else u, tokens // CHUNK, dk, dv,
        C=CHUNK, BK=cfg.block_k, BV=cfg.block_v, STORE_OUT=store_out, STORE_FINAL=want_final,
        STORE_STATES=states is not None, PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return o, final


def _scan_backward(parts, do, ds_final, precision: str):
    """Grads of (W, U, Qd, Kd, P, gamma) from dO [BH, Tp, Dv] and dS_final [BH, Dk, Dv] (or None): the chunk states
    and new values recomputed, the reverse kernel (dU and the grad of each chunk's final state), then the rest as
    batched matmuls over the chunks."""
    w, u, qd, kd, p, gamma = parts
    bh, tokens, dk = w.shape
    dv = u.shape[-1]
    n = tokens // CHUNK
    cfg = _blocks(dk, dv)
    states = w.new_empty((bh, n, dk, dv))
    v_new = torch.empty_like(u)
    _scan(parts, False, precision, store_out=False, states=states, v_new=v_new)
    du = torch.empty_like(u)
    ds_next = torch.empty_like(states)
    _scan_bwd[(bh, cdiv(dv, cfg.block_v))](
        w, qd, kd, p, gamma, do, ds_final if ds_final is not None else u, du, ds_next, n, dk, dv,
        C=CHUNK, BK=cfg.block_k, BV=cfg.block_v, HAS_DS_FINAL=ds_final is not None, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    chunks = bh * n
    s_t = states.view(chunks, dk, dv).transpose(1, 2)  # [chunks, Dv, Dk]
    du_c, do_c, v_c = (t.view(chunks, CHUNK, dv) for t in (du, do, v_new))
    dw = torch.bmm(du_c, s_t).neg_().view(bh, tokens, dk)
    dqd = torch.bmm(do_c, s_t).view(bh, tokens, dk)
    dkd = torch.bmm(v_c, ds_next.view(chunks, dk, dv).transpose(1, 2)).view(bh, tokens, dk)
    dp = torch.bmm(do_c, v_c.transpose(1, 2)).view(bh, n, CHUNK, CHUNK)
    dgamma = (states * ds_next).sum((-1, -2))
    return dw, du, dqd, dkd, dp, dgamma


def _scan_reference(parts, want_final: bool):
    """Stage two in torch (a loop over chunks): the path of tensors Triton cannot run, and the kernels' oracle."""
    w, u, qd, kd, p, gamma = parts
    bh, tokens, dk = w.shape
    n = tokens // CHUNK
    w, u, qd, kd = (t.view(bh, n, CHUNK, t.shape[-1]) for t in (w, u, qd, kd))
    s = w.new_zeros((bh, dk, u.shape[-1]))
    outs = []
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ s
        outs.append(qd[:, c] @ s + p[:, c] @ v_new)
        s = gamma[:, c, None, None] * s + kd[:, c].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=1), (s if want_final else None)


def _finish(o: torch.Tensor, batch: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """[BH, Tp, Dv] -> [B, T, H, Dv] in the caller's dtype."""
    o = o.view(batch, -1, o.shape[1], o.shape[2])[:, :, :tokens]
    return o.transpose(1, 2).to(dtype).contiguous()


def _state_out(s: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    return None if s is None else s.view(batch, -1, *s.shape[1:])


# ----------------------------------------------------------------------------------------------------
# 3. Autograd function: keeps the inputs, recomputes stage one in backward
# ----------------------------------------------------------------------------------------------------


def _forward(q, k, v, g, beta, want_final: bool, precision: str):
    with torch.no_grad():
        o, final = _scan(_prepare(q, k, v, g, beta).parts, want_final, precision)
    return _finish(o, q.shape[0], q.shape[1], q.dtype), _state_out(final, q.shape[0])


def _backward(inputs, do, ds_final, precision: str):
    """Grads of (q, k, v, g, beta), in their dtypes, from dO [B, T, H, Dv] and dS_final [B, H, Dk, Dv] (or None):
    stage one recomputed, the reverse scan, stage one's backward."""
    with torch.no_grad():
        stage = _prepare(*inputs)
        tokens = stage.parts[0].shape[1]
        do = _heads_first(do, tokens).contiguous()
        ds = None if ds_final is None else ds_final.float().reshape(-1, *ds_final.shape[2:]).contiguous()
        grads = _scan_backward(stage.parts, do, ds, precision)
        out = _prepare_backward(stage, grads, [t.shape for t in inputs])
    return [grad.to(t.dtype).contiguous() for grad, t in zip(out, inputs)]  # as the operator's fake says


class GatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, want_final, precision):
        o, final = _forward(q, k, v, g, beta, want_final, precision)
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.precision = precision
        return o, final

    @staticmethod
    def backward(ctx, do, ds_final):
        grads = _backward(ctx.saved_tensors, do, ds_final, ctx.precision)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None)


# ----------------------------------------------------------------------------------------------------
# 4. Public function, fla's path and the reference
# ----------------------------------------------------------------------------------------------------


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention (the `fla` package) is installed; nothing is imported to find out."""
    try:
        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):  # a finder that refuses it (the benchmarks hide it so)
        return False


@functools.cache
def _fla_chunk_rule():
    """fla's chunk_gated_delta_rule, imported by the first call that wants it; None (said once) when fla is not
    installed or does not import against this torch / triton."""
    if not fla_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:
        warnings.warn(
            f"fastplug: flash-linear-attention is installed but does not import ({type(exc).__name__}: {exc}); "
            "the gated delta rule takes fastplug's Triton scan",
            stacklevel=4,
        )
        return None
    return chunk_gated_delta_rule


@functools.cache
def fla_refusal(device: torch.device) -> str | None:
    """Why fla's kernels cannot serve CUDA `device` although fla imports, or None. fla 0.6 raises in its backward
    (gated chunk_bwd_dqkwg, its #640) on Hopper with Triton >= 3.4.0 and < 3.7.1 unless tilelang is installed:
    decided here, before a forward that would succeed and a backward that would not."""
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if hopper and (3, 4) <= release(triton.__version__) < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
        return (
            f"flash-linear-attention's gated delta rule backward is wrong on Hopper with Triton {triton.__version__} "
            "(fla #640: it needs Triton >= 3.7.1 or tilelang); fastplug's Triton scan runs instead"
        )
    return None


def _fla_rule_for(x: torch.Tensor):
    """fla's chunk_gated_delta_rule when it can serve x (CUDA, installed, not refused on this GPU), else None;
    a refusal is said once per device."""
    if not x.is_cuda or _fla_chunk_rule() is None:
        return None
    reason = fla_refusal(x.device)
    if reason is not None:
        _warn_refusal_once(reason)
        return None
    return _fla_chunk_rule()


@functools.cache
def _warn_refusal_once(reason: str) -> None:
    warnings.warn(f"fastplug: {reason}", stacklevel=5)


def _check(q, k, v, g, beta, implementation):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        check_dtype(name, t)
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"q and k must have one shape [batch, tokens, k_heads, k_dim]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    batch, tokens, k_heads, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, tokens):
        raise ValueError(f"v must have shape [{batch}, {tokens}, heads, v_dim]; got {tuple(v.shape)}")
    heads, dv = v.shape[2:]
    if heads % k_heads:
        raise ValueError(f"v's heads ({heads}) must be a multiple of q/k's ({k_heads})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (batch, tokens, heads):
            raise ValueError(f"{name} must have shape ({batch}, {tokens}, {heads}); got {tuple(t.shape)}")
    if not (1 <= dk <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM):
        raise ValueError(f"head dims must be in [1, {MAX_HEAD_DIM}]; got k_dim {dk}, v_dim {dv}")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}; got {implementation!r}")


def implementation_for(x: torch.Tensor, requested: str | None = None) -> str:
    """The path `gated_delta_rule` takes for tensors like x: fla's kernels on CUDA when fla is installed, else
    fastplug's Triton scan, else (no Triton for x) torch."""
    if requested is not None:
        if requested == "fla" and not (x.is_cuda and _fla_chunk_rule() is not None):
            raise ValueError(
                "implementation 'fla' needs CUDA tensors and flash-linear-attention (pip install fastplug[fla])"
            )
        refused = fla_refusal(x.device) if requested == "fla" else None
        if refused is not None:
            raise ValueError(f"implementation 'fla' cannot run here: {refused}")
        if requested == "triton" and not use_triton(x):
            raise ValueError(f"implementation 'triton' cannot run on {x.device.type} tensors here")
        return requested
    if not use_triton(x):
        return "torch"
    return "fla" if _fla_rule_for(x) is not None else "triton"


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    output_final_state: bool = False,
    implementation: str | None = None,
):
    """(o [B, T, H, Dv] in q's dtype, the final state [B, H, Dk, Dv] in fp32 or None) of the gated delta rule
    from an empty state, as transformers' `torch_chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`:
    q, k [B, T, Hk, Dk] (L2-normalised here, q scaled by Dk^-0.5), v [B, T, H, Dv] with H a multiple of Hk,
    g (log decay, <= 0) and beta [B, T, H]. implementation: None (fla on CUDA when installed, else Triton, else
    torch) or one of IMPLEMENTATIONS."""
    _check(q, k, v, g, beta, implementation)
    chosen = implementation_for(q, implementation)
    if q.shape[1] == 0:
        chosen = "torch"
    if chosen == "fla":
        return _fla_chunk_rule()(q, k, v, g, beta, output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
    if chosen == "torch":
        o, final = _scan_reference(_prepare(q, k, v, g, beta).parts, output_final_state)
        return _finish(o, q.shape[0], q.shape[1], q.dtype), _state_out(final, q.shape[0])
    precision = _precision(q.dtype)
    if torch.compiler.is_compiling():
        o, final = _gated_delta_rule_op(q, k, v, g, beta, output_final_state, precision)
        return o, (final if output_final_state else None)
    return GatedDeltaRule.apply(q, k, v, g, beta, output_final_state, precision)


def gated_delta_rule_reference(q, k, v, g, beta, *, output_final_state: bool = False):
    """The recurrence token by token in plain torch (float64 inputs stay float64): the tests' oracle."""
    compute = torch.promote_types(q.dtype, torch.float32)
    heads, k_heads = v.shape[2], k.shape[2]
    if heads != k_heads:
        q, k = (t.repeat_interleave(heads // k_heads, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.transpose(1, 2).to(compute) for t in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    s = q.new_zeros((*q.shape[:2], q.shape[-1], v.shape[-1]))
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[..., None, :]
        outs.append((s * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, dim=2).transpose(1, 2).to(q.dtype if q.dtype == torch.float64 else v.dtype)
    return o, (s if output_final_state else None)


# ----------------------------------------------------------------------------------------------------
# 5. Registered operator (what torch.compile traces): the same forward and backward, opaque to it
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fastplug::gated_delta_rule",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, bool want_final, str precision) -> (Tensor, Tensor)",
)
def _gated_delta_rule_op(q, k, v, g, beta, want_final, precision):
    o, final = _forward(q, k, v, g, beta, want_final, precision)
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, want_final, precision):
    batch, tokens, _, dk = q.shape
    heads, dv = v.shape[2:]
    final = (
        q.new_empty((batch, heads, dk, dv), dtype=torch.float32) if want_final else q.new_empty(0, dtype=torch.float32)
    )
    return q.new_empty((batch, tokens, heads, dv)), final


@torch.library.custom_op(
    "fastplug::gated_delta_rule_backward",
    mutates_args=(),
    schema="(Tensor do, Tensor ds, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, str precision) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _gated_delta_rule_backward_op(do, ds, q, k, v, g, beta, precision):
    return tuple(_backward((q, k, v, g, beta), do, ds if ds.numel() else None, precision))


@_gated_delta_rule_backward_op.register_fake
def _(do, ds, q, k, v, g, beta, precision):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta))


def _setup_rule(ctx, inputs, output):
    q, k, v, g, beta, _, precision = inputs
    ctx.save_for_backward(q, k, v, g, beta)
    ctx.precision = precision


def _rule_op_backward(ctx, do, ds):
    q = ctx.saved_tensors[0]
    ds = ds if ds is not None and ds.numel() else q.new_empty(0, dtype=torch.float32)
    grads = _gated_delta_rule_backward_op(do, ds, *ctx.saved_tensors, ctx.precision)
    return (*grads, None, None)


_gated_delta_rule_op.register_autograd(_rule_op_backward, setup_context=_setup_rule)
