"""MoE kernels on one GPU: correctness at real sizes (every launch path: pointer loads, tensor descriptors,
torch._grouped_mm), then fwd+bwd timings against torch._grouped_mm, a per-expert loop and transformers'
grouped_mm experts (Qwen3-MoE and Mixtral widths); what the autotuner timed for each launch; a table last.

    FASTPLUG_MOE_TUNE_CACHE=$OUT/moe_tuning.json python scripts/moe_gpu.py [--skip-checks] [--only gemm,mixtral]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers
import triton

from fastplug.kernels.moe import (
    ExpertLoRA,
    grouped_gemm,
    grouped_gemm_reference,
    moe_experts,
    moe_experts_reference,
    moe_router,
    moe_router_reference,
    routing_metadata,
    tuning,
)
from fastplug.kernels.moe.grouped_gemm import grouped_mm_dw, grouped_mm_glu, grouped_mm_rows

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: --smoke under TRITON_INTERPRET=1
ROWS: list[tuple[str, str, float, float | None, str]] = []


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def bench(name, impl, fn, leaves, flops=None):
    if DEV.type != "cuda":
        fn()
        return
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=leaves)
    note = f"{flops / ms / 1e9:.0f} TFLOP/s" if flops else ""
    ROWS.append((name, impl, ms, peak, note))
    print(f"  {name:44s} {impl:34s} {ms:8.3f} ms  {peak:8.0f} MiB  {note}", flush=True)


def routing(T, E, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(T, E, device=DEV, generator=g)
    return moe_router_reference(logits, k)


def check_interface():
    from transformers.integrations import moe

    print("transformers", transformers.__version__, "torch", torch.__version__, "triton", triton.__version__)
    print("ALL_EXPERTS_FUNCTIONS:", hasattr(moe, "ALL_EXPERTS_FUNCTIONS"), sorted(moe.ALL_EXPERTS_FUNCTIONS.keys()))
    print(
        "set_experts_implementation:",
        hasattr(transformers.PreTrainedModel, "set_experts_implementation"),
        "| MixtralTopKRouter:",
        hasattr(transformers.models.mixtral.modeling_mixtral, "MixtralTopKRouter"),
        "| _default_apply_gate:",
        hasattr(moe, "_default_apply_gate"),
    )


def check_kernels(smoke=False):
    T, H, I, E, k, r = (40, 32, 16, 4, 2, 4) if smoke else (3000, 1024, 384, 16, 4, 8)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gu = (torch.randn(E, 2 * I, H, device=DEV) / H**0.5).bfloat16().requires_grad_()
    dn = (torch.randn(E, H, I, device=DEV) / I**0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device=DEV, requires_grad=True)
    w, i = moe_router(logits, k)
    wr, ir = moe_router_reference(logits.double(), k)
    print(f"router: same experts {torch.equal(i, ir)}, weights err {rel(w, wr):.2e}")
    idx = i.clone()
    idx[:, 0] = torch.where(idx[:, 0] == 3, E - 1, idx[:, 0])  # expert 3 gets fewer rows
    offsets, gather, scatter = routing_metadata(idx, E)
    print("metadata: rows", int(offsets[-1]), "== T*k", T * k)
    ads = [
        torch.randn(*s, device=DEV, requires_grad=True) / 10 for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))
    ]
    ads = [a.detach().requires_grad_() for a in ads]
    for lora in (False, True):
        ins = [x, gu, dn, logits] + (ads if lora else [])
        ins64 = [t.detach().double().requires_grad_() for t in ins]
        outs = []
        for fn, args in ((moe_experts, ins), (moe_experts_reference, ins64)):
            wt, ix = moe_router_reference(args[3], k)
            kw_ = dict(gate_up_lora=ExpertLoRA(*args[4:6], 2.0), down_lora=ExpertLoRA(*args[6:8], 2.0)) if lora else {}
            y = fn(args[0], args[1], args[2], ix, wt.to(args[0].dtype), **kw_)
            gy = torch.randn(y.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)).to(y.dtype)
            outs.append([y] + list(torch.autograd.grad(y, args, gy)))
        errs = " ".join(f"{rel(a, b):.1e}" for a, b in zip(*outs))
        print(
            f"moe_experts bf16 lora={lora}: rel err out/dx/dgu/ddown/dlogits"
            f"{'/dA1/dB1/dA2/dB2' if lora else ''}: {errs}"
        )
    M, K, N = (100, 32, 48) if smoke else (20000, 512, 640)
    counts = torch.randint(0, 2 * M // E, (E,), device=DEV)
    counts[1] = 0
    counts[-1] = 1
    offs = counts.cumsum(0).int()
    M = int(offs[-1])
    for dtype in (torch.float32, torch.bfloat16):
        xx = torch.randn(M, K, device=DEV, dtype=dtype, requires_grad=True)
        ww = (torch.randn(E, N, K, device=DEV) / K**0.5).to(dtype).requires_grad_()
        y = grouped_gemm(xx, ww, offs)
        x64, w64 = xx.detach().double().requires_grad_(), ww.detach().double().requires_grad_()
        yr = grouped_gemm_reference(x64, w64, offs)
        gy = torch.randn_like(y)
        g1 = torch.autograd.grad(y, (xx, ww), gy)
        g2 = torch.autograd.grad(yr, (x64, w64), gy.double())
        print(f"grouped_gemm {dtype}: out {rel(y, yr):.1e} dx {rel(g1[0], g2[0]):.1e} dw {rel(g1[1], g2[1]):.1e}")


def check_impls(smoke=False):
    """Each launch path forced, on fused (gather + scatter + weights), plain, transposed-weight and dW
    launches, against float64 loops; one shape whose widths divide the blocks and one whose do not."""
    shapes = [(300, 64, 96, 4)] if smoke else [(6000, 1024, 768, 8), (3000, 200, 136, 5)]
    for M, K, N, E in shapes:
        counts = torch.randint(1, 2 * M // E, (E,), device=DEV)
        counts[1] = 0
        counts[-1] = 1
        offs = counts.cumsum(0).int()
        M = int(offs[-1])
        T = M // 2 + 1
        x = torch.randn(T, K, device=DEV).bfloat16()
        xm = torch.randn(M, K, device=DEV).bfloat16()
        w = (torch.randn(E, N, K, device=DEV) / K**0.5).bfloat16()
        wt = (torch.randn(E, K, N, device=DEV) / K**0.5).bfloat16()  # wt.transpose(1, 2): dX's weight view
        gi = torch.randint(0, T, (M,), device=DEV)
        si = torch.randperm(M, device=DEV)
        rw = torch.rand(M, device=DEV)
        dy = torch.randn(M, N, device=DEV).bfloat16()
        d = lambda t: t.double()  # noqa: E731
        refs = {
            "fused": grouped_gemm_reference(d(x), d(w), offs, gather_index=gi, scatter_index=si, row_weights=d(rw)),
            "plain": grouped_gemm_reference(d(xm), d(w), offs),
            "wT": grouped_gemm_reference(d(xm), d(wt).transpose(1, 2), offs),
        }
        ends = offs.tolist()

        def dw_ref(dyr, xr):
            out, s0 = [], 0
            for end in ends:
                out.append(dyr[s0:end].T @ xr[s0:end])
                s0 = end
            return torch.stack(out)

        refs["dw_fused"] = dw_ref(d(dy)[si] * d(rw)[:, None], d(x)[gi])
        refs["dw_plain"] = dw_ref(d(dy), d(xm))
        for impl, cfg in (("ptr", (128, 128, 64, 8, 3)), ("tma", (128, 128, 64, 8, 3)), ("torch", (0, 0, 0, 0, 0))):
            c = tuning.as_config((*cfg, impl))
            cd = tuning.as_config(((64, 128, 128, 8, 3) if impl != "torch" else cfg) + (impl,))
            if smoke:
                c = cd = tuning.as_config((32, 32, 32, 1, 1, impl))
            got = {
                "fused": grouped_mm_rows(x, w, offs, a_index=gi, out_index=si, row_weights=rw, config=c),
                "plain": grouped_mm_rows(xm, w, offs, config=c),
                "wT": grouped_mm_rows(xm, wt.transpose(1, 2), offs, config=c),
                "dw_fused": grouped_mm_dw(dy, x, offs, E, dy_index=si, x_index=gi, row_weights=rw, config=cd),
                "dw_plain": grouped_mm_dw(dy, xm, offs, E, config=cd),
            }
            if impl != "torch":  # the gate_up GEMM with the activation in its epilogue
                gu, h = grouped_mm_glu(x, w, offs, "silu", a_index=gi, config=c)
                gate, up = gu.double()[:, : N // 2], gu.double()[:, N // 2 :]
                got["glu_gu"], refs["glu_gu"] = gu, grouped_gemm_reference(d(x), d(w), offs, gather_index=gi)
                got["glu_h"], refs["glu_h"] = h, gate * torch.sigmoid(gate) * up
            print(f"impl {impl:5s} M{M} K{K} N{N} E{E}: " + " ".join(f"{k} {rel(got[k], refs[k]):.1e}" for k in got))


def print_tuning(prefix=""):
    """What the autotuner timed, per launch key: the best config of each impl and the winner."""
    for key, timed in tuning.TIMINGS.items():
        if prefix and prefix not in key:
            continue
        best = {}
        for ms, cfg in timed:
            if ms is not None and (cfg["impl"] not in best or ms < best[cfg["impl"]][0]):
                best[cfg["impl"]] = (ms, cfg)
        failed = sum(ms is None for ms, _ in timed)
        parts = [
            f"{impl} {ms:.3f} ({cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']})"
            for impl, (ms, cfg) in sorted(best.items(), key=lambda t: t[1][0])
        ]
        print(f"  tune {key}: " + " | ".join(parts) + (f" | {failed} failed" if failed else ""), flush=True)


def bench_grouped_gemm(M=65536, E=64, K=2048, N=1536, fused=True):
    print(f"\n# grouped GEMM {M} rows, {E} experts, {K} -> {N}, bf16")
    k = min(8, E)
    T = M // k
    _, index = routing(T, E, k)
    offsets, gather, scatter = routing_metadata(index, E)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    xt = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=DEV) / K**0.5).bfloat16().requires_grad_()
    rw = torch.rand(M, device=DEV, requires_grad=True)
    gy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    flops = 3 * 2 * M * K * N
    ends = offsets.tolist()

    def tmm():
        torch._grouped_mm(x, w.transpose(1, 2), offs=offsets).backward(gy)

    def loop():
        out, s = [], 0
        for e, end in enumerate(ends):
            out.append(x[s:end] @ w[e].T)
            s = end
        torch.cat(out).backward(gy)

    def ours():
        grouped_gemm(x, w, offsets).backward(gy)

    def ours_fused():
        grouped_gemm(xt, w, offsets, gather_index=gather, scatter_index=scatter, row_weights=rw).backward(gy)

    start = time.time()
    ours(), fused and ours_fused()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    print(f"  (first calls incl. autotuning: {time.time() - start:.1f} s)")
    name = f"grouped GEMM {M}x{K}->{N}, E{E}, fwd+bwd"
    bench(name, "torch._grouped_mm", tmm, [x, w], flops)
    bench(name, "per-expert loop", loop, [x, w], flops)
    bench(name, "fastplug grouped_gemm", ours, [x, w], flops)
    if fused:
        bench(name, "fastplug, gather+scatter+rw fused", ours_fused, [xt, w, rw], flops)
    fname = f"grouped GEMM {M}x{K}->{N}, E{E}, fwd"
    with torch.no_grad():
        bench(
            fname, "torch._grouped_mm", lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets), None, flops / 3
        )
        bench(fname, "fastplug grouped_gemm", lambda: grouped_gemm(x, w, offsets), None, flops / 3)


def qwen3_block(H, I, E, k):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k, norm_topk_prob=True
    )
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block.to(DEV, torch.bfloat16)


def patch_block(block, family="qwen3_moe"):
    """What the patch does to one MoE block: the model's experts implementation and the router forward."""
    import types

    from fastplug.models import moe as moe_rules

    moe_rules._register()
    experts = block.experts.get_base_layer() if hasattr(block.experts, "get_base_layer") else block.experts
    experts.config._experts_implementation = moe_rules.IMPLEMENTATION
    block.gate.forward = types.MethodType(moe_rules._router_forward(*moe_rules._ROUTERS[family]), block.gate)
    return block


def bench_mixtral(T=8192, H=4096, I=14336, E=8, k=2):
    """One Mixtral MoE block (router + experts + combine) as the e2e LoRA-on-attention run uses it: expert
    and router weights frozen, the input's gradient only; forward (no grad, checkpointing's first pass)
    and fwd+bwd."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    print(f"\n# Mixtral MoE block, {T} tokens, hidden {H}, {E} x {I}, top-{k}, bf16, frozen experts")
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(DEV):
        base = MixtralSparseMoeBlock(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.02)
    base.requires_grad_(False)
    fast = patch_block(copy.deepcopy(base), "mixtral")
    x = (torch.randn(1, T, H, device=DEV) * 0.5).bfloat16().requires_grad_()
    gy = torch.randn(1, T, H, device=DEV, dtype=torch.bfloat16)
    start = time.time()
    outs = []
    for blk in (base, fast):
        y = blk(x)
        y = y[0] if isinstance(y, tuple) else y
        (dx,) = torch.autograd.grad(y, x, gy)
        outs.append((y, dx))
    torch.cuda.synchronize() if DEV.type == "cuda" else None
    print(f"  (first calls incl. autotuning: {time.time() - start:.1f} s)")
    print("  fastplug vs transformers, rel err out/dx:", " ".join(f"{rel(a, b):.1e}" for a, b in zip(outs[1], outs[0])))
    flops = 2 * T * k * H * 3 * I
    for impl, blk in (("transformers grouped_mm", base), ("fastplug", fast)):

        def step(blk=blk):
            y = blk(x)
            (y[0] if isinstance(y, tuple) else y).backward(gy)

        bench(f"Mixtral block {T} tok, frozen experts, fwd+bwd(dx)", impl, step, [x], 3 * flops)
        with torch.no_grad():
            bench(f"Mixtral block {T} tok, forward (no grad)", impl, lambda blk=blk: blk(x), None, flops)
    print_tuning("|E8|")


def bench_layer(T=8192, H=2048, I=768, E=64, k=8):
    print(f"\n# Qwen3-MoE expert layer (router + experts + combine), {T} tokens, hidden {H}, {E} x {I}, top-{k}, bf16")
    base = qwen3_block(H, I, E, k)
    fast = patch_block(copy.deepcopy(base))  # the deep copy has its own config
    x = (torch.randn(1, T, H, device=DEV) * 0.5).bfloat16().requires_grad_()
    gy = torch.randn(1, T, H, device=DEV, dtype=torch.bfloat16)
    outs = []
    for blk in (base, fast):
        blk.zero_grad(set_to_none=True)
        y = blk(x)
        (dx,) = torch.autograd.grad(y, x, gy, retain_graph=True)
        y.backward(gy)
        outs.append((y, dx, blk.experts.gate_up_proj.grad, blk.gate.weight.grad))
    print(
        "  fastplug vs transformers, rel err out/dx/dgate_up/drouter:",
        " ".join(f"{rel(a, b):.1e}" for a, b in zip(outs[1], outs[0])),
    )
    name = f"Qwen3-MoE layer {T} tok, full FT, fwd+bwd"
    for impl, blk in (("transformers grouped_mm", base), ("fastplug", fast)):
        params = list(blk.parameters())
        bench(name, impl, lambda blk=blk: blk(x).backward(gy), [x] + params)

    # LoRA r=16 on attention is elsewhere; here LoRA on the expert weights, base frozen
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(
        r=16, lora_alpha=16, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]
    )
    lora_base = inject_adapter_in_model(cfg, qwen3_block(H, I, E, k))
    lora_base.experts.get_base_layer().config._experts_implementation = "grouped_mm"
    for n, p in lora_base.named_parameters():
        p.requires_grad_("lora_" in n)
    lora_fast = patch_block(copy.deepcopy(lora_base))
    import types

    from fastplug.models import moe as moe_rules

    lora_fast.experts.forward = types.MethodType(moe_rules._lora_experts_forward, lora_fast.experts)
    for n, p in list(lora_base.named_parameters()) + list(lora_fast.named_parameters()):
        if "lora_B" in n:
            torch.nn.init.normal_(p, 0, 0.02)
    lora_fast.load_state_dict(lora_base.state_dict())
    ys = []
    for blk in (lora_base, lora_fast):
        blk.zero_grad(set_to_none=True)
        y = blk(x)
        y.backward(gy)
        ys.append((y, *[p.grad for n, p in blk.named_parameters() if "lora_" in n]))
    print(
        "  LoRA-on-experts fastplug vs peft, rel err out + LoRA grads:",
        " ".join(f"{rel(a, b):.1e}" for a, b in zip(ys[1], ys[0])),
    )
    name = f"Qwen3-MoE layer {T} tok, LoRA r16 on experts"
    for impl, blk in (("transformers + peft target_parameters", lora_base), ("fastplug", lora_fast)):
        params = [p for p in blk.parameters() if p.requires_grad]
        bench(name, impl, lambda blk=blk: blk(x).backward(gy), [x] + params)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    parser.add_argument(
        "--only",
        default="gemm,fused,layer,mixtral",
        help="benchmarks to run: gemm, fused (gemm with gather/scatter/weights), layer, mixtral",
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    print("tuning cache:", tuning.cache_path(), "| autotune:", tuning.autotune_enabled())
    check_interface()
    if not args.skip_checks:
        tuning.set_autotune(False)  # correctness only: the default configs, nothing compiled twice
        check_kernels(args.smoke)
        check_impls(args.smoke)
        tuning.set_autotune(None)
    if args.smoke:
        bench_grouped_gemm(M=256, E=4, K=32, N=48)
        bench_layer(T=32, H=64, I=32, E=4, k=2)
        bench_mixtral(T=32, H=64, I=48, E=4, k=2)
    else:
        if "gemm" in only:
            bench_grouped_gemm(fused="fused" in only)
            print_tuning("|E64|")
        if "mixtral" in only:
            bench_mixtral()
        if "layer" in only:
            bench_layer()
    print("\n| row | impl | ms | peak MiB | note |\n|---|---|---|---|---|")
    for name, impl, ms, peak, note in ROWS:
        print(f"| {name} | {impl} | {ms:.3f} | {peak:.0f} | {note} |")


if __name__ == "__main__":
    main()
