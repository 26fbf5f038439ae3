"""`python -m fastplug.bench micro`: each op forward+backward, fastplug against torch eager, torch.compile
and Liger-Kernel (when importable), at the shapes of shared/BASELINES.md, in bf16 on random data.

Per op and implementation: median ms per fwd+bwd step, peak memory of one step over what the inputs and
grad outputs already hold, and the relative error of the output and of the input grads against torch eager,
so a fast but wrong kernel shows in the table.

Timing (`--timing`, column "timing"). Small ops are host-bound: RMSNorm 16384x4096 fwd+bwd is ~0.26 ms of
GPU work, but Python's launch path (autograd, wrappers) costs ~0.5 ms per call, so timing eager calls
measures the CPU, and numbers move 20-40% between machines. `graph` (the default on CUDA) captures the whole
step (grads set to None, forward, backward; a few steps unrolled) in a CUDA graph and reports the median
device time per step over replays: kernel time only, no host cost, no L2 flush between steps. An
implementation that cannot be captured (something syncs) falls back to `launch` and says so in its note.
`launch` is `triton.testing.do_bench` of eager calls (grads set to None, L2 flushed between calls): what a
training step sees when the host is the bottleneck. On CPU (the --quick smoke run): one call.
`--profile` adds, per op and implementation, the top CUDA kernels of a few steps (torch.profiler).

`fastplug_inplace` (RoPE, SwiGLU, GeGLU): the ops that reuse their inputs' buffers, run as inside a model.
Leaves cannot be reused (their data would change), so this implementation's inputs are fresh autograd
outputs (clones of the leaves, as projection outputs are); making them is neither timed (time of making
and running, minus time of making alone) nor counted in the peak. Liger's rows reach their figures by
writing into the leaves (and, for RoPE, into the caller's grad outputs).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ._report import fmt, grouped_bar_plot, markdown_table, short_error, write_csv

OPS = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "geglu",
    "rope",
    "cross_entropy",
    "cross_entropy_head_grad",
    "attention_causal",
    "attention_gemma2",
    "attention_gemma2_8k",
    "attention_varlen",
    "moe_grouped_gemm",
    "moe_layer",
)
# sdpa / flex / triton (fastplug's kernel without the dispatcher): the attention rows only
# grouped_mm: torch._grouped_mm (the moe rows; their eager is a per-expert loop / transformers' default experts)
IMPLS = ("eager", "compile", "liger", "sdpa", "flex", "triton", "grouped_mm", "fastplug", "fastplug_inplace")
TIMINGS = ("graph", "launch")
COLUMNS = (
    "op",
    "shape",
    "impl",
    "ms",
    "timing",
    "peak MiB",
    "rel err out",
    "rel err grads",
    "speedup vs compile",
    "note",
)
TEXT_COLUMNS = ("op", "shape", "impl", "timing", "note")
# bf16 against bf16 eager: both round, so a few 1e-3 is normal; beyond this the row is flagged.
SUSPICIOUS_REL_ERR = 3e-2


@dataclass
class Case:
    """One op at one shape: leaf inputs (grads wanted), constant inputs, and a callable per implementation."""

    op: str
    shape: str
    leaves: list  # tensors whose .grad the backward fills
    impls: dict = field(default_factory=dict)  # name -> fn() returning a tensor or tuple of tensors
    # name -> fn(*inputs): implementations that reuse their inputs, run on fresh copies (module docstring)
    in_model: dict = field(default_factory=dict)


def _randn(*shape, device, dtype, scale=1.0, requires_grad=False):
    t = torch.randn(*shape, device=device, dtype=torch.float32).mul_(scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach().clone())


def _liger(name: str):
    """A public Liger-Kernel object, or None when liger_kernel is not importable."""
    try:
        if name == "LigerSiLUMulFunction":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as obj
        elif name == "LigerGELUMulFunction":
            from liger_kernel.ops.geglu import LigerGELUMulFunction as obj
        else:
            import liger_kernel.transformers as lt

            obj = getattr(lt, name)
    except Exception:
        return None
    return obj


# --- the six ops ---------------------------------------------------------------------------------


def case_rms_norm(M, N, device, dtype) -> Case:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fastplug.kernels import rms_norm

    x = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    w = _param((1 + 0.1 * torch.randn(N, device=device)).to(dtype))
    eps = 1e-6
    eager = LlamaRMSNorm(N, eps=eps).to(device)
    eager.weight = w
    case = Case("rms_norm", f"{M}x{N}", [x, w])
    case.impls["eager"] = lambda: eager(x)
    case.impls["compile"] = _compiled(lambda: eager(x))
    case.impls["fastplug"] = lambda: rms_norm(x, w, eps)
    liger_cls = _liger("LigerRMSNorm")
    if liger_cls is not None:
        liger = liger_cls(N, eps=eps).to(device)
        liger.weight = w
        case.impls["liger"] = lambda: liger(x)
    return case


def case_layer_norm(M, N, device, dtype) -> Case:
    from fastplug.kernels import layer_norm

    x = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    w = _param((1 + 0.1 * torch.randn(N, device=device)).to(dtype))
    b = _param((0.1 * torch.randn(N, device=device)).to(dtype))
    eps = 1e-5
    eager = torch.nn.LayerNorm(N, eps=eps, device=device, dtype=dtype)
    eager.weight, eager.bias = w, b
    case = Case("layer_norm", f"{M}x{N}", [x, w, b])
    case.impls["eager"] = lambda: eager(x)
    case.impls["compile"] = _compiled(lambda: eager(x))
    case.impls["fastplug"] = lambda: layer_norm(x, w, b, eps)
    liger_cls = _liger("LigerLayerNorm")
    if liger_cls is not None:
        liger = liger_cls(N, eps=eps, bias=True).to(device=device, dtype=dtype)
        liger.weight, liger.bias = w, b
        case.impls["liger"] = lambda: liger(x)
    return case


def _glu_case(op, M, N, device, dtype, eager_fn, fast_fn, liger_name) -> Case:
    gate = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    up = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    case = Case(op, f"{M}x{N}", [gate, up])
    case.impls["eager"] = lambda: eager_fn(gate, up)
    case.impls["compile"] = _compiled(lambda: eager_fn(gate, up))
    case.impls["fastplug"] = lambda: fast_fn(gate, up)
    case.in_model["fastplug_inplace"] = lambda g, u: fast_fn(g, u, reuse_inputs=True)
    liger_fn = _liger(liger_name)
    if liger_fn is not None:
        case.impls["liger"] = lambda: liger_fn.apply(gate, up)
    return case


def case_swiglu(M, N, device, dtype) -> Case:
    from fastplug.kernels import swiglu

    return _glu_case("swiglu", M, N, device, dtype, lambda g, u: F.silu(g) * u, swiglu, "LigerSiLUMulFunction")


def case_geglu(M, N, device, dtype) -> Case:
    from fastplug.kernels import geglu

    return _glu_case(
        "geglu",
        M,
        N,
        device,
        dtype,
        lambda g, u: F.gelu(g, approximate="tanh") * u,
        lambda g, u, **kw: geglu(g, u, approximate="tanh", **kw),
        "LigerGELUMulFunction",
    )


def rope_inputs(B, Hq, Hk, T, D, device, dtype):
    """Realistic rope inputs: q/k projections [B, T, H, D] (leaves; callers view them as [B, H, T, D] like the
    attention module does) and cos/sin [1, T, D] as Llama's rotary embedding returns them in training (theta 500000)."""
    q_proj = _randn(B, T, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k_proj = _randn(B, T, Hk, D, device=device, dtype=dtype, requires_grad=True)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return q_proj, k_proj, emb.cos().to(dtype), emb.sin().to(dtype)


def case_rope(B, Hq, Hk, T, D, device, dtype) -> Case:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from fastplug.kernels import rope

    q_proj, k_proj, cos, sin = rope_inputs(B, Hq, Hk, T, D, device, dtype)

    def views():
        return q_proj.transpose(1, 2), k_proj.transpose(1, 2)

    case = Case("rope", f"q {B}x{Hq}x{T}x{D}, k {B}x{Hk}x{T}x{D}", [q_proj, k_proj])
    case.impls["eager"] = lambda: apply_rotary_pos_emb(*views(), cos, sin)
    case.impls["compile"] = _compiled(lambda: apply_rotary_pos_emb(*views(), cos, sin))
    case.impls["fastplug"] = lambda: rope(*views(), cos, sin)
    case.in_model["fastplug_inplace"] = lambda q, k: rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, inplace=True)
    liger_fn = _liger("liger_rotary_pos_emb")
    if liger_fn is not None:
        case.impls["liger"] = lambda: liger_fn(*views(), cos, sin)
    return case


def case_cross_entropy(N, H, V, device, dtype, train_head=False) -> Case:
    from fastplug.kernels import fused_linear_cross_entropy

    hidden = _randn(N, H, device=device, dtype=dtype, requires_grad=True)
    # The LM head is frozen in LoRA fine-tuning (no weight grad); full fine-tuning or tied embeddings train it.
    weight = _randn(V, H, device=device, dtype=dtype, scale=H**-0.5, requires_grad=train_head)
    labels = torch.randint(0, V, (N,), device=device)
    labels[torch.rand(N, device=device) < 0.05] = -100  # some ignored positions, as with padding

    def eager_fn():
        # What transformers' ForCausalLMLoss does: full logits, upcast to fp32, mean over valid labels.
        logits = F.linear(hidden, weight).float()
        return F.cross_entropy(logits, labels, ignore_index=-100)

    op = "cross_entropy_head_grad" if train_head else "cross_entropy"
    case = Case(op, f"{N}x{H}, vocab {V}", [hidden, weight] if train_head else [hidden])
    case.impls["eager"] = eager_fn
    case.impls["compile"] = _compiled(eager_fn)
    case.impls["fastplug"] = lambda: fused_linear_cross_entropy(hidden, weight, labels)
    liger_cls = _liger("LigerFusedLinearCrossEntropyLoss")
    if liger_cls is not None:
        liger = liger_cls()
        case.impls["liger"] = lambda: liger(weight, hidden, labels)
    return case


def case_moe_grouped_gemm(M, E, K, N, device, dtype) -> Case:
    """Rows already grouped by expert (random counts, top-8 routing of M / 8 tokens): out = x @ w[e]^T."""
    from fastplug.kernels.moe import grouped_gemm, moe_router_reference, routing_metadata

    top_k = min(8, E)
    _, index = moe_router_reference(torch.randn(M // top_k, E, device=device), top_k)
    offsets = routing_metadata(index, E)[0]
    ends = offsets.tolist()
    x = _randn(M // top_k * top_k, K, device=device, dtype=dtype, requires_grad=True)
    w = _randn(E, N, K, device=device, dtype=dtype, scale=K**-0.5, requires_grad=True)

    def loop():
        out, start = [], 0
        for e, end in enumerate(ends):
            out.append(x[start:end] @ w[e].T)
            start = end
        return torch.cat(out)

    case = Case("moe_grouped_gemm", f"{M} rows, {E} experts, {K}->{N}", [x, w])
    case.impls["eager"] = loop
    case.impls["grouped_mm"] = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    case.impls["fastplug"] = lambda: grouped_gemm(x, w, offsets)
    return case


def case_moe_layer(T, H, I, E, top_k, device, dtype) -> Case:
    """One Qwen3-MoE sparse block (router + experts + combine), full fine-tuning: transformers' default
    experts implementation (grouped_mm) against the block as fastplug patches it."""
    import copy
    import types

    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from fastplug.models import moe as moe_rules

    config = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=True
    )
    config._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    fast = copy.deepcopy(block)  # its own config: switching it leaves `block` alone
    moe_rules._register()
    fast.experts.config._experts_implementation = moe_rules.IMPLEMENTATION
    fast.gate.forward = types.MethodType(moe_rules._router_forward("norm_topk_prob", False), fast.gate)
    x = _randn(1, T, H, device=device, dtype=dtype, scale=0.5, requires_grad=True)
    params = dict(block.named_parameters())
    for name, p in fast.named_parameters():  # one set of leaves: both blocks read the same parameters
        parent, _, leaf = name.rpartition(".")
        setattr(fast.get_submodule(parent), leaf, params[name])
    case = Case("moe_layer", f"{T} tokens, hidden {H}, {E}x{I} top-{top_k}", [x, *params.values()])
    case.impls["eager"] = lambda: block(x)
    case.impls["fastplug"] = lambda: fast(x)
    return case


class _AttentionModule(torch.nn.Module):
    """What transformers' eager_attention_forward reads off the attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False  # no dropout


def case_attention(op, B, Hq, Hkv, T, D, device, dtype, softcap=None, window=None, docs=None) -> Case:
    """q (B, Hq, T, D), k/v (B, Hkv, T, D), causal. eager: transformers' eager attention (Gemma2's with a
    softcap) and its 4-D mask; for packed documents (docs: lengths) the reference is SDPA with the
    block-diagonal mask transformers builds for them. Outputs (B, T, Hq, D) everywhere."""
    import importlib

    A = importlib.import_module("fastplug.kernels.attention")  # the module: the package exports the function

    q = _randn(B, Hq, T, D, device=device, dtype=dtype, requires_grad=True)
    k = _randn(B, Hkv, T, D, device=device, dtype=dtype, requires_grad=True)
    v = _randn(B, Hkv, T, D, device=device, dtype=dtype, requires_grad=True)
    scale = D**-0.5
    start = end = cu = None
    if docs is not None:
        cu = torch.tensor([0, *docs], device=device).cumsum(0).to(torch.int32)
        start, end = A.bounds_from_cu_seqlens(cu, T)
    seen = A.visible_keys(T, T, True, window, start, end, device)
    desc = (
        f"B{B} {Hq}/{Hkv} heads T{T} D{D}"
        + (f" softcap {softcap:g}" if softcap else "")
        + (f" window {window}" if window else "")
        + (f", {len(docs)} docs" if docs else "")
    )
    case = Case(op, desc, [q, k, v])
    module = _AttentionModule(Hq // Hkv)
    if docs is not None:
        groups = Hq // Hkv
        case.impls["eager"] = lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=seen, scale=scale
        ).transpose(1, 2)
    else:
        if softcap is not None:
            from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
        else:
            from transformers.models.llama.modeling_llama import eager_attention_forward
        mask = torch.zeros(seen.shape, device=device, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
        extra = {"softcap": softcap} if softcap is not None else {}
        case.impls["eager"] = lambda: eager_attention_forward(module, q, k, v, mask, scaling=scale, **extra)[0]
    if softcap is None and window is None and docs is None:
        case.impls["sdpa"] = lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=Hq != Hkv
        ).transpose(1, 2)
    if docs is None:
        case.impls["flex"] = _flex(q, k, v, T, scale, softcap, window)
    p = A._Problem(
        B,
        Hq,
        Hkv,
        T,
        T,
        D,
        max(16, A.next_power_of_2(D)),
        True,
        A._normalise_window(window, True, T, T),
        softcap,
        scale,
    )
    case.impls["triton"] = lambda: A.FlashAttention.apply(q, k, v, p, start, end)
    case.impls["fastplug"] = lambda: A.attention(
        q, k, v, sliding_window=window, softcap=softcap, scale=scale, cu_seqlens=cu
    )
    return case


def _flex(q, k, v, T, scale, softcap, window) -> Callable:
    """torch's flex_attention (compiled on first call) with the same mask and softcap."""
    state = {}

    def run():
        if not state:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def mask_mod(b, h, q_idx, kv_idx):
                causal = q_idx >= kv_idx
                return causal & (q_idx - kv_idx < window) if window is not None else causal

            def score_mod(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

            state["mask"] = create_block_mask(mask_mod, None, None, T, T, device=q.device)
            state["score_mod"] = score_mod if softcap is not None else None
            state["fn"] = torch.compile(flex_attention)
        out = state["fn"](
            q,
            k,
            v,
            score_mod=state["score_mod"],
            block_mask=state["mask"],
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2)

    return run


def _varlen_docs(total: int, n: int, seed: int = 0) -> list[int]:
    """n document lengths of random sizes summing to total."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(total - 1, generator=g)[: n - 1] + 1).values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _compiled(fn: Callable) -> Callable:
    """torch.compile of the eager version, built lazily so that a failing compile is one row's error."""
    compiled = None

    def run():
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled()

    return run


def build_cases(ops, quick: bool, device, dtype) -> list[tuple[str, Callable[[], Case]]]:
    """(op, builder) pairs; shapes from shared/BASELINES.md, or tiny ones with --quick."""
    if quick:
        shapes = {
            "rms_norm": lambda: case_rms_norm(37, 129, device, dtype),
            "layer_norm": lambda: case_layer_norm(37, 129, device, dtype),
            "swiglu": lambda: case_swiglu(37, 129, device, dtype),
            "geglu": lambda: case_geglu(37, 129, device, dtype),
            "rope": lambda: case_rope(1, 4, 2, 16, 80, device, dtype),
            "cross_entropy": lambda: case_cross_entropy(37, 64, 257, device, dtype),
            "cross_entropy_head_grad": lambda: case_cross_entropy(37, 64, 257, device, dtype, train_head=True),
            "attention_causal": lambda: case_attention("attention_causal", 1, 4, 2, 40, 64, device, dtype),
            "attention_gemma2": lambda: case_attention(
                "attention_gemma2", 1, 2, 1, 40, 80, device, dtype, softcap=50.0, window=9
            ),
            "attention_gemma2_8k": lambda: case_attention(
                "attention_gemma2_8k", 1, 2, 1, 33, 32, device, dtype, softcap=50.0, window=5
            ),
            "attention_varlen": lambda: case_attention(
                "attention_varlen", 1, 4, 2, 40, 64, device, dtype, docs=_varlen_docs(40, 3)
            ),
            "moe_grouped_gemm": lambda: case_moe_grouped_gemm(256, 4, 32, 48, device, dtype),
            "moe_layer": lambda: case_moe_layer(32, 64, 32, 4, 2, device, dtype),
        }
    else:
        shapes = {
            "rms_norm": lambda: case_rms_norm(16384, 4096, device, dtype),
            "layer_norm": lambda: case_layer_norm(16384, 4096, device, dtype),
            "swiglu": lambda: case_swiglu(16384, 14336, device, dtype),
            "geglu": lambda: case_geglu(16384, 14336, device, dtype),
            "rope": lambda: case_rope(4, 32, 8, 4096, 128, device, dtype),
            "cross_entropy": lambda: case_cross_entropy(8192, 4096, 128256, device, dtype),
            "cross_entropy_head_grad": lambda: case_cross_entropy(8192, 4096, 128256, device, dtype, train_head=True),
            # shared/BASELINES.md: SDPA 3.96 ms, flex 5.37; Gemma2 T2048 eager 3.34, flex 1.94; T8192 flex 15.7
            "attention_causal": lambda: case_attention("attention_causal", 4, 32, 8, 4096, 128, device, dtype),
            "attention_gemma2": lambda: case_attention(
                "attention_gemma2", 2, 8, 4, 2048, 256, device, dtype, softcap=50.0, window=4096
            ),
            "attention_gemma2_8k": lambda: case_attention(
                "attention_gemma2_8k", 2, 8, 4, 8192, 256, device, dtype, softcap=50.0, window=4096
            ),
            "attention_varlen": lambda: case_attention(
                "attention_varlen", 1, 32, 8, 16384, 128, device, dtype, docs=_varlen_docs(16384, 8)
            ),
            # shared/BASELINES.md: torch._grouped_mm fwd+bwd 2.16 ms
            "moe_grouped_gemm": lambda: case_moe_grouped_gemm(65536, 64, 2048, 1536, device, dtype),
            "moe_layer": lambda: case_moe_layer(8192, 2048, 768, 64, 8, device, dtype),
        }
    return [(op, shapes[op]) for op in ops]


# --- measuring -----------------------------------------------------------------------------------


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fwd_bwd(fn, grad_outputs):
    outs = as_tuple(fn())
    torch.autograd.backward(outs, grad_outputs)
    return outs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def set_grads_none(leaves):
    for t in leaves:
        t.grad = None


def time_step(step, leaves, device, timing, warmup_ms, rep_ms) -> tuple[float, str, str | None]:
    """(median ms per step, how it was timed, a note when graph timing fell back to launch timing)."""
    if device.type != "cuda":
        return _cpu_ms(step, leaves), "cpu", None
    note = None
    if timing == "graph":
        try:
            return _graph_ms(step, leaves, warmup_ms, rep_ms), "graph", None
        except Exception as exc:
            note = f"launch timing: graph capture failed: {short_error(exc, 100)}"
            set_grads_none(leaves)
            torch.cuda.synchronize()
    from triton.testing import do_bench

    ms = do_bench(step, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves, return_mode="median")
    return ms, "launch", note


def _cpu_ms(step, leaves) -> float:
    """One call: CPU timings of the interpreted kernels mean nothing; the smoke run checks the plumbing."""
    set_grads_none(leaves)
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _graph_ms(step, leaves, warmup_ms, rep_ms) -> float:
    """Median device ms per step: steps unrolled into one CUDA graph and replayed, so no host cost is timed."""

    def fresh_step():
        set_grads_none(leaves)  # at capture time: each captured step's backward writes fresh grads, as in launch
        step()

    # Warm up on a side stream (torch.cuda.graph requires it; compiled functions are built by now) and get a
    # rough step time, host cost included, only to choose how many steps to unroll.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        fresh_step()
        start.record()
        for _ in range(3):
            fresh_step()
        end.record()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # Unroll up to ~5 ms of (estimated) steps per replay so that the replay's own launch cost is negligible.
    unroll = max(1, min(50, round(5.0 / max(start.elapsed_time(end) / 3, 1e-3))))

    graph = torch.cuda.CUDAGraph()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a Triton kernel object collected mid-capture unloads its module and breaks the capture
    try:
        with torch.cuda.graph(graph):
            for _ in range(unroll):
                fresh_step()
    finally:
        if gc_was_enabled:
            gc.enable()

    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replay_ms = max(start.elapsed_time(end), 1e-3)
    for _ in range(int(warmup_ms / replay_ms)):
        graph.replay()
    # Queue all timed replays before waiting: the GPU never idles, so no launch latency is in the events.
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(max(10, min(1000, int(rep_ms / replay_ms))))
    ]
    for before, after in events:
        before.record()
        graph.replay()
        after.record()
    torch.cuda.synchronize()
    return statistics.median(before.elapsed_time(after) for before, after in events) / unroll


def _in_model_step(fn, leaves, grad_outputs):
    """(make, run): make() gives fresh autograd copies of the leaves and copies of the grad outputs; run(made)
    is the fwd+bwd step on them, gradients reaching the leaves through the copies. run takes the inputs out
    of `made`: as inside a model, only autograd holds them then (a buffer the caller still held could not
    become the leaf's gradient without a copy)."""

    def make():
        return [t.clone() for t in leaves], [g.clone() if g is not None else None for g in grad_outputs]

    def run(made, keep_outputs=False):
        """The step; keep_outputs: copies of the outputs as forward left them (backward may reuse them)."""
        inputs, grads = made
        outs = as_tuple(fn(*inputs))
        inputs.clear()
        kept = [o.detach().clone() for o in outs] if keep_outputs else None
        torch.autograd.backward(outs, grads)
        return kept

    return make, run


def peak_mib(fn, leaves, device, make=None) -> float | None:
    """Extra memory of one fwd+bwd over what is already held (inputs, grad outputs), grads freed first;
    with `make`, fn(make()) where what make() returns counts as held."""
    if device.type != "cuda":
        return None
    set_grads_none(leaves)
    gc.collect()
    torch.cuda.synchronize()
    made = make() if make is not None else None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(made) if make is not None else fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_table(step, leaves, steps: int = 3, top: int = 12) -> str:
    """The top CUDA kernels (and memsets/copies) of `steps` fwd+bwd steps by total device time, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                set_grads_none(leaves)
                step()
            torch.cuda.synchronize()
    except Exception as exc:
        return f"    profile failed: {short_error(exc)}"
    calls, total_us = {}, {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            calls[event.name] = calls.get(event.name, 0) + 1
            total_us[event.name] = total_us.get(event.name, 0.0) + event.time_range.elapsed_us()

    def line(name, n_calls, us):
        name = name if len(name) <= 60 else name[:57] + "..."
        return f"    {name:<60} {n_calls / steps:>6g} {us / 1e3 / steps:>9.4f}"

    lines = [f"    {'kernel':<60} {'calls':>6} {'ms/step':>9}"]
    top_names = sorted(total_us, key=total_us.get, reverse=True)[:top]
    lines += [line(name, calls[name], total_us[name]) for name in top_names]
    lines.append(line("all kernels", sum(calls.values()), sum(total_us.values())))
    return "\n".join(lines)


def measure_case(case: Case, impls, device, timing, warmup_ms, rep_ms, profile=False) -> list[dict]:
    """One row per implementation; with `profile` (CUDA only) a row also gets "kernels", its kernel table."""
    rows = []
    # Some implementations (Liger's SwiGLU, GeGLU and RoPE) write their backward into their inputs: each
    # implementation starts from these pristine values, or it would run on another's leftovers.
    pristine = [t.detach().clone() for t in case.leaves]
    # Reference outputs, grads and grad outputs from eager, once.
    set_grads_none(case.leaves)
    ref_outs = [o.detach().clone() for o in as_tuple(case.impls["eager"]())]
    grad_outputs = [torch.randn_like(o) if o.dim() else None for o in ref_outs]
    set_grads_none(case.leaves)
    _fwd_bwd(case.impls["eager"], [g.clone() if g is not None else None for g in grad_outputs])
    ref_grads = [t.grad.detach().clone() for t in case.leaves]

    for impl in impls:
        fn, in_model = case.impls.get(impl), case.in_model.get(impl)
        if fn is None and in_model is None and impl != "liger":  # one this op does not have (sdpa for RMSNorm ...)
            continue
        row = {"op": case.op, "shape": case.shape, "impl": impl}
        rows.append(row)
        if fn is None and in_model is None:
            row["note"] = "not available (liger_kernel not importable)" if impl == "liger" else "not available"
            continue
        try:
            # Each implementation gets its own copy of the grad outputs: some backward passes write into them.
            with torch.no_grad():
                for t, p in zip(case.leaves, pristine):
                    t.copy_(p)
            set_grads_none(case.leaves)
            if in_model is not None:
                make, run = _in_model_step(in_model, case.leaves, grad_outputs)
                outs = run(make(), keep_outputs=True)
            else:
                outs = _fwd_bwd(fn, [g.clone() if g is not None else None for g in grad_outputs])
            row["rel err out"] = max(rel_err(o, r) for o, r in zip(outs, ref_outs))
            row["rel err grads"] = max(rel_err(t.grad, r) for t, r in zip(case.leaves, ref_grads))
            del outs
            if in_model is not None:
                step = lambda: run(make())  # noqa: E731
                ms, row["timing"], timing_note = time_step(step, case.leaves, device, timing, warmup_ms, rep_ms)
                row["ms"] = ms - time_step(make, case.leaves, device, timing, warmup_ms, rep_ms)[0]
                row["peak MiB"] = peak_mib(run, case.leaves, device, make=make)
            else:
                my_grads = [g.clone() if g is not None else None for g in grad_outputs]
                step = lambda: _fwd_bwd(fn, my_grads)  # noqa: E731
                row["ms"], row["timing"], timing_note = time_step(step, case.leaves, device, timing, warmup_ms, rep_ms)
                row["peak MiB"] = peak_mib(step, case.leaves, device)
            if profile:
                row["kernels"] = kernel_table(step, case.leaves)
            worst = max(row["rel err out"], row["rel err grads"])
            notes = [timing_note] if timing_note else []
            if not worst <= SUSPICIOUS_REL_ERR:
                notes.insert(0, f"WRONG? rel err {worst:.2e} vs eager")
            if notes:
                row["note"] = "; ".join(notes)
        except Exception as exc:  # one failing implementation is one row's error, not the end of the run
            row["note"] = short_error(exc)
        finally:
            set_grads_none(case.leaves)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    compile_ms = next((r.get("ms") for r in rows if r["impl"] == "compile"), None)
    for row in rows:
        if compile_ms and row.get("ms"):
            row["speedup vs compile"] = compile_ms / row["ms"]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench micro", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {','.join(OPS)}")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    parser.add_argument("--out", default="bench_out", help="folder for micro.csv and micro.png")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU, for smoke tests)")
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default="graph",
        help="CUDA only: graph = device time of CUDA-graph replays of the fwd+bwd step (default); "
        "launch = triton do_bench of eager calls, host launch cost included",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="CUDA only: also print the top kernels of a few fwd+bwd steps per op and implementation",
    )
    parser.add_argument("--warmup-ms", type=float, default=50.0, help="warm-up time per implementation")
    parser.add_argument("--rep-ms", type=float, default=300.0, help="measuring time per implementation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for name, chosen, valid in (("--ops", ops, OPS), ("--impls", impls, IMPLS)):
        bad = [c for c in chosen if c not in valid]
        if bad:
            parser.error(f"{name}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
    if "eager" not in impls:
        impls.insert(0, "eager")  # the reference every error is measured against
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.quick:
            parser.error("without a GPU only --quick runs (tiny shapes, eager and fastplug)")
        # torch.compile needs a C++ toolchain on CPU and Liger needs CUDA: only eager and fastplug here.
        impls = [i for i in impls if i in ("eager", "fastplug", "fastplug_inplace")]
        if args.profile:
            print("--profile needs CUDA (torch.profiler CUDA kernels): skipped on CPU", flush=True)
    profile = args.profile and device.type == "cuda"
    dtype = torch.bfloat16
    from fastplug.kernels._utils import kernel_path

    timing = args.timing if device.type == "cuda" else "one CPU call"
    print(
        f"micro bench on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, bf16, fwd+bwd, "
        f"timing: {timing}; fastplug path: {kernel_path(device)}",
        flush=True,
    )

    rows = []
    for op, build in build_cases(ops, args.quick, device, dtype):
        torch.manual_seed(args.seed)
        try:
            case = build()
        except Exception as exc:
            rows.append({"op": op, "impl": "all", "note": f"setup failed: {short_error(exc)}"})
            continue
        case_rows = measure_case(case, impls, device, args.timing, args.warmup_ms, args.rep_ms, profile)
        for r in case_rows:
            print(
                f"  {r['op']:<13} {r['impl']:<8} ms={fmt(r.get('ms'))} ({r.get('timing', '-')}) "
                f"peak={fmt(r.get('peak MiB'))} MiB err={fmt(r.get('rel err out'))}/{fmt(r.get('rel err grads'))} "
                f"{r.get('note', '')}",
                flush=True,
            )
        for r in case_rows:
            if "kernels" in r:
                print(f"\n  top kernels, {r['op']} {r['impl']} (per step):\n{r['kernels']}\n", flush=True)
        rows.extend(case_rows)
        del case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    csv_path = os.path.join(args.out, "micro.csv")
    write_csv(csv_path, rows, COLUMNS)
    groups = list(dict.fromkeys(r["op"] for r in rows))
    eager_ms = {r["op"]: r.get("ms") for r in rows if r["impl"] == "eager"}
    speedups = {
        (r["op"], r["impl"]): eager_ms[r["op"]] / r["ms"] for r in rows if r.get("ms") and eager_ms.get(r["op"])
    }
    plot_msg = grouped_bar_plot(
        os.path.join(args.out, "micro.png"),
        groups,
        impls,
        [("fwd+bwd speedup over torch eager (bf16, higher is better)", "x eager", speedups)],
    )
    print(f"\ncsv: {csv_path}\n{plot_msg}\n")
    table = [{c: (r.get(c, "") if c in TEXT_COLUMNS else fmt(r.get(c))) for c in COLUMNS} for r in rows]
    print(markdown_table(table, COLUMNS))
    failed = [r for r in rows if r["impl"] == "fastplug" and (not r.get("ms") or "WRONG" in r.get("note", ""))]
    return 1 if failed else 0


# --- QLoRA (4-bit bitsandbytes bases) -------------------------------------------------------------


def qlora_rows(device="cuda", quick: bool = False) -> list[dict]:
    """4-bit rows against bitsandbytes (its CUDA kernels) and peft + bitsandbytes: NF4 dequantization
    (double quant, bf16 out), the batch-1 GEMV, and the 4-bit LoRA MLP fwd+bwd at Llama-8B width (r=16).
    Each row: op, shape, impl, ms (do_bench median), peak MiB of the call over its inputs, rel err vs the
    reference implementation. `quick`: tiny shapes (a smoke run)."""
    import bitsandbytes as bnb
    import peft

    from ..kernels.lora import lora_mlp
    from ..kernels.quant import dequantize_4bit, dequantize_4bit_scratch, gemv_4bit
    from ..models.projections import fused_projections

    device = torch.device(device)
    hidden, inter, tokens = (64, 96, 32) if quick else (4096, 14336, 8192)

    def timed(fn):
        if device.type != "cuda":
            return _cpu_ms(fn, [])
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100)

    def peak(fn):
        if device.type != "cuda":
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def params4bit(out, inn):
        w = torch.randn(out, inn, dtype=torch.bfloat16)
        return bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True).to(device)

    rows = []

    def add(op, shape, impl, fn, ref=None, note=""):
        out = fn()
        err = rel_err(out, ref) if ref is not None else None
        rows.append(
            {
                "op": op,
                "shape": shape,
                "impl": impl,
                "ms": timed(fn),
                "peak MiB": peak(fn),
                "rel err": err,
                "note": note,
            }
        )
        return out

    w = params4bit(hidden, inter)  # the down projection's [4096, 14336]
    shape = f"{hidden}x{inter} nf4 dq"
    ref = add("dequant_4bit", shape, "bitsandbytes", lambda: bnb.functional.dequantize_4bit(w.data, w.quant_state))
    add("dequant_4bit", shape, "fastplug", lambda: dequantize_4bit_scratch(w, torch.bfloat16), ref)

    for out_f, in_f in ((inter, hidden), (hidden, inter)):
        wg = params4bit(out_f, in_f)
        x = torch.randn(1, in_f, dtype=torch.bfloat16, device=device)
        shape = f"1x{in_f} @ [{out_f}x{in_f}]"
        ref = add("gemv_4bit", shape, "bitsandbytes", lambda: bnb.matmul_4bit(x, wg.t(), quant_state=wg.quant_state))
        add("gemv_4bit", shape, "fastplug", lambda: gemv_4bit(x, wg), ref)
        add("gemv_4bit", shape, "dequant+matmul", lambda: x @ dequantize_4bit(wg, dtype=torch.bfloat16).t(), ref)
        wg = None  # frees the weight before the next shape

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()

            def linear(i, o):
                return bnb.nn.Linear4bit(
                    i, o, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True
                )

            self.gate_proj, self.up_proj = linear(hidden, inter), linear(hidden, inter)
            self.down_proj = linear(inter, hidden)

    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"])
    mlp = peft.get_peft_model(MLP().to(device), config).base_model.model  # peft's default: fp32 adapters
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    adapters = [p for p in mlp.parameters() if p.requires_grad]

    def step(forward):
        def run():
            x.grad = None
            for p in adapters:
                p.grad = None
            y = forward()
            y.backward(grad)
            return y.detach()

        return run

    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    shape = f"{tokens}x{hidden}, I={inter}, r=16"
    ref = add(
        "lora_mlp_4bit fwd+bwd",
        shape,
        "peft+bnb",
        step(lambda: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))),
    )
    add("lora_mlp_4bit fwd+bwd", shape, "fastplug", step(lambda: lora_mlp(x, *fused_projections(*layers))), ref)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
