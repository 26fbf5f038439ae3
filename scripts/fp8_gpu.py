"""FP8 block-scaled linears on one GPU (issue 16): correctness against bf16 and against the same maths in
float64, then timings, a markdown table last.

1. checks: quantization bit-exact against torch, the GEMM (pointer and TMA loads, x W^T and dY W) against
   float64 and against the bf16 product, at Llama-8B shapes and off the 128 blocks;
2. the block-scaled GEMM at 8192^3 (the Triton kernel on operands already in FP8, and fp8_block_matmul: bf16
   in/out, the activation quantized, cuBLAS's block-scaled kernel where torch has it) against bf16 cuBLAS,
   torch._scaled_mm row-wise and transformers' fine-grained FP8 kernel when it loads;
3. a sweep of the GEMM's launch configurations (block sizes, warps, stages, TMA loads) at 8192^3: the best
   is printed and used for the rest of the run (through fastplug.kernels.tuning.override; make it
   fastplug.kernels.fp8.GEMM_LARGE_M to keep it);
4. Llama-8B projections at M=8192 tokens (4096->14336, 14336->4096, 4096->6144): fwd + dX against bf16,
   and the ways of dX (dequantized weight + bf16 GEMM, cuBLAS FP8 on W transposed per call, the Triton FP8
   GEMM reading W transposed or on a transposed copy of W);
5. end to end (fastplug.bench.e2e's model and loop): Llama-8B width, 4 layers, 2x4096 tokens, LoRA r=16 on
   every projection (fp32 adapters, bf16 base), checkpointing, 50 steps: transformers + peft, fastplug bf16,
   fastplug fp8=True: tok/s, peak memory, base weight memory, loss after the steps.

    PYTHONPATH=$PWD python3 scripts/fp8_gpu.py [--quick] [--no-sweep] [--no-e2e]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/fp8_gpu.py --smoke     # CPU: tiny shapes, no timings
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import statistics
import time

import torch
import torch.nn.functional as F
import triton

import fastplug
from fastplug.bench import e2e
from fastplug.bench._report import fmt, markdown_table
from fastplug.kernels import fp8 as F8
from fastplug.kernels import tuning as kernel_tuning

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = DEV.type != "cuda"
ROWS: list[dict] = []
BF16_MS: dict[str, float] = {}  # case -> the bf16 time, for the "vs bf16" column


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def record(section, case, impl, ms=None, rate="", note=""):
    if impl.startswith("bf16") and ms:
        BF16_MS[case] = ms
    base = BF16_MS.get(case)
    row = dict(
        section=section,
        case=case,
        impl=impl,
        ms=ms,
        rate=rate,
        note=note,
        speedup=f"{base / ms:.2f}x" if base and ms and not impl.startswith("bf16") else "",
    )
    ROWS.append(row)
    print(f"  {case:34s} {impl:46s} {fmt(ms):>8} ms  {rate:>14}  {row['speedup']:>6}  {note}", flush=True)


def bench(section, case, impl, fn, flops=None, nbytes=None, grad_to_none=None, note=""):
    """Median time of fn (triton.testing.do_bench); on the CPU smoke run fn runs once and nothing is timed."""
    try:
        fn()
        if SMOKE:
            return None
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    except Exception as exc:  # one failing implementation must not end the run
        record(section, case, impl, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        return None
    rate = f"{flops / ms / 1e9:.0f} TFLOP/s" if flops else f"{nbytes / ms / 1e6:.0f} GB/s" if nbytes else ""
    record(section, case, impl, ms, rate, note)
    return ms


def kernel_ms(fn, grad_to_none=(), reps: int = 5) -> float | None:
    """Milliseconds of GPU kernels per call of fn (torch.profiler): the device's time, none of the host's."""
    if SMOKE:
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for t in grad_to_none:
                t.grad = None
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3 / reps


# -------------------------------------------------------------------------------------------- 1. checks


def checks(quick: bool):
    print("\n# 1. correctness (rel err = ||out - ref|| / ||ref||)", flush=True)
    shapes = [(256, 384)] if SMOKE else [(14336, 4096), (4096, 14336), (6144, 4096), (333, 1000)]
    rows = [8] if SMOKE else [1, 77, 4096]
    tma_options = [False, True] if DEV.type != "cuda" or torch.cuda.get_device_capability() >= (9, 0) else [False]
    worst = {}
    for (n, k), m in itertools.product(shapes, rows):
        w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02
        q, s = F8.quantize_weight_blockwise(w)
        q_ref, s_ref = F8.quantize_weight_blockwise_reference(w)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
        xq, xs = F8.quantize_activation(x)
        xq_ref, xs_ref = F8.quantize_activation_reference(x)
        same = (
            torch.equal(s, s_ref)
            and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
            and torch.equal(xs, xs_ref)
            and torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))
        )
        if not same:  # say where: scales or values, how many, an example
            for what, a, b in (
                ("w scale", s, s_ref),
                ("w values", q, q_ref),
                ("x scale", xs, xs_ref),
                ("x values", xq, xq_ref),
            ):
                a8 = a.view(torch.uint8) if a.element_size() == 1 else a
                b8 = b.view(torch.uint8) if b.element_size() == 1 else b
                diff = (a8 != b8).nonzero()
                if len(diff):
                    i = tuple(diff[0].tolist())
                    print(
                        f"    {what}: {len(diff)} of {a.numel()} differ, e.g. at {i}: {a[i].float().item()!r} "
                        f"vs torch {b[i].float().item()!r}",
                        flush=True,
                    )
        w64 = F8.dequantize_blockwise_reference(q, s, 128, torch.float64)
        x64 = F8.dequantize_blockwise_reference(xq, xs, (1, 128), torch.float64)
        dy = torch.randn(m, n, dtype=torch.bfloat16, device=DEV)
        dq, ds = F8.quantize_activation(dy)
        dy64 = F8.dequantize_blockwise_reference(dq, ds, (1, 128), torch.float64)
        errs = {"quantization == torch": same}
        for tma in tma_options:
            cfg = dataclasses.replace(F8.fp8_gemm_config(m, DEV), tma=tma)
            y = F8.fp8_gemm(xq, xs, q, s, config=cfg)
            dx = F8.fp8_gemm(dq, ds, q, s, input_grad=True, config=cfg)
            errs[f"x W^T vs float64 (tma={tma})"] = rel(y, x64 @ w64.t())
            errs[f"dY W vs float64 (tma={tma})"] = rel(dx, dy64 @ w64)
        y = F8.fp8_block_matmul(x, q, s)
        errs["fp8_block_matmul vs bf16 x, FP8 W"] = rel(y, x.double() @ w64.t())
        errs["fp8_block_matmul vs the bf16 layer"] = rel(y, x.double() @ w.double().t())
        errs["dX dequantized vs bf16 dY, FP8 W"] = rel(F8._project_grad(dy, q, s, 128, fp8=False), dy.double() @ w64)
        errs["dX fp8 vs bf16 dY, FP8 W"] = rel(F8._project_grad(dy, q, s, 128, fp8=True), dy.double() @ w64)
        print(
            f"  N={n} K={k} M={m}: "
            + ", ".join(f"{name} {v if isinstance(v, bool) else f'{v:.2e}'}" for name, v in errs.items()),
            flush=True,
        )
        for name, v in errs.items():
            worst[name] = (worst.get(name, True) and v) if isinstance(v, bool) else max(worst.get(name, 0.0), v)
        if quick:
            break
    for name, v in worst.items():
        record("1 checks", name, "worst over the shapes", note=str(v) if isinstance(v, bool) else f"{v:.2e}")
    ok = worst["quantization == torch"] and all(
        v < 1e-2 for name, v in worst.items() if "float64" in name or "dequantized" in name
    )
    print(f"  checks {'passed' if ok else 'FAILED'}", flush=True)
    return ok


# ------------------------------------------------------------------------------------------------- GEMM


def _operands(m, n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    q, s = F8.quantize_weight_blockwise(w)
    xq, xs = F8.quantize_activation(x)
    return w, x, q, s, xq, xs


def sweep_candidates(quick: bool):
    if SMOKE:
        return [dict(BLOCK_M=32, BLOCK_N=32, GROUP_M=8, num_warps=1, num_stages=1, TMA=t) for t in (False, True)]
    # (BLOCK_M, BLOCK_N, warps, stages): a stage holds (BLOCK_M + BLOCK_N) x 128 bytes of fp8 tiles, so the
    # wide tiles stop at 4 stages (5 would pass the 227 KiB of shared memory of an H100)
    launches = [
        (64, 128, 4, 3),
        (64, 128, 4, 4),
        (64, 128, 4, 5),
        (64, 256, 8, 3),
        (64, 256, 8, 4),
        (128, 128, 4, 3),
        (128, 128, 4, 4),
        (128, 128, 8, 3),
        (128, 128, 8, 4),
        (128, 128, 8, 5),
        (128, 256, 8, 3),
        (128, 256, 8, 4),
    ]
    if quick:
        launches = [c for c in launches if c[3] == 4]
    tma = (False, True) if torch.cuda.get_device_capability() >= (9, 0) else (False,)
    return [
        dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=st, TMA=t)
        for (bm, bn, warps, st), t in itertools.product(launches, tma)
    ]


def sweep(quick: bool):
    """Times every candidate launch on the 8192^3 GEMM (operands in FP8), then the best few on dY W; returns the
    best config of x W^T."""
    size = 256 if SMOKE else 8192
    print(f"\n# 3. GEMM launch sweep at {size}^3 (BLOCK_K = 128, the scale block)", flush=True)
    _, _, q, s, xq, xs = _operands(size, size, size)
    ref = F8.fp8_gemm(xq, xs, q, s)
    flops = 2 * size**3
    results = []
    for cfg in sweep_candidates(quick):
        name = " ".join(f"{k}={v}" for k, v in cfg.items())
        try:
            err = rel(F8.fp8_gemm(xq, xs, q, s, config=cfg), ref)
            ms = (
                None
                if SMOKE
                else triton.testing.do_bench(
                    lambda: F8.fp8_gemm(xq, xs, q, s, config=cfg), warmup=10, rep=50, return_mode="median"
                )
            )
        except Exception as exc:  # out of shared memory or registers: not a candidate here
            print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
            continue
        bad = err > 1e-2
        print(
            f"  {name}: {fmt(ms)} ms{f', {flops / ms / 1e9:.0f} TFLOP/s' if ms else ''}"
            f"{f', WRONG (rel err {err:.1e})' if bad else ''}",
            flush=True,
        )
        if not bad:
            results.append((ms or 0.0, cfg))
    if not results:
        print("  no candidate ran: keeping the default launch", flush=True)
        return F8.fp8_gemm_config(size, DEV)
    results.sort(key=lambda r: r[0])
    best_ms, best = results[0]
    record(
        "3 sweep",
        f"x W^T {size}^3",
        "best: " + " ".join(f"{k}={v}" for k, v in best.items()),
        best_ms or None,
        f"{flops / best_ms / 1e9:.0f} TFLOP/s" if best_ms else "",
    )
    # dY W reads W along its rows (MN-major B): its best launch may differ
    dq, ds = F8.quantize_activation(torch.randn(size, size, dtype=torch.bfloat16, device=DEV))
    dx_results = []
    for _, cfg in results[:6]:
        try:
            F8.fp8_gemm(dq, ds, q, s, input_grad=True, config=cfg)
            ms = (
                None
                if SMOKE
                else triton.testing.do_bench(
                    lambda: F8.fp8_gemm(dq, ds, q, s, input_grad=True, config=cfg),
                    warmup=10,
                    rep=50,
                    return_mode="median",
                )
            )
        except Exception as exc:
            print(f"  dY W {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
            continue
        dx_results.append((ms or 0.0, cfg))
    if dx_results:
        dx_ms, dx_best = min(dx_results, key=lambda r: r[0])
        record(
            "3 sweep",
            f"dY W {size}^3",
            "best: " + " ".join(f"{k}={v}" for k, v in dx_best.items()),
            dx_ms or None,
            f"{flops / dx_ms / 1e9:.0f} TFLOP/s" if dx_ms else "",
        )
    print(f"\n  best x W^T launch: GEMM_CONFIG = {best}", flush=True)
    return best


def _scaled_mm_rowwise(a, b):
    """torch._scaled_mm with one scale per row of a and per row of b (columns of b^T)."""
    sa = a.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
    sb = b.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
    aq = (a.float() / sa).to(torch.float8_e4m3fn)
    bq = (b.float() / sb).to(torch.float8_e4m3fn)
    return aq, bq, sa, sb


TRANSFORMERS_FP8_FILE = None  # --transformers-fp8-file


def _transformers_fp8_module():
    """transformers' fine-grained FP8 integration: the installed one, or (--transformers-fp8-file) the file of an
    earlier version, whose Triton kernel is in the file (4.57's; 5.x fetches its kernel from the Hub, which a
    machine without network cannot), imported inside the installed package so that its relative imports resolve."""
    if TRANSFORMERS_FP8_FILE is None:
        from transformers.integrations import finegrained_fp8

        return finegrained_fp8
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "transformers.integrations._finegrained_fp8_file", TRANSFORMERS_FP8_FILE
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _transformers_rows(section, case, x, q, s, xq, xs, flops, ref):
    """transformers' fine-grained FP8 kernel, in whichever form the installed version (or the given file) has."""
    try:
        ff = _transformers_fp8_module()
    except Exception as exc:
        record(section, case, "transformers fine-grained FP8", note=f"not importable: {exc}")
        return
    if hasattr(ff, "w8a8_block_fp8_matmul_triton"):  # the in-file Triton kernel of earlier versions
        xs_c = xs.contiguous()

        def fn():
            return ff.w8a8_block_fp8_matmul_triton(xq, q, xs_c, s, [128, 128], output_dtype=torch.bfloat16)

        bench(
            section,
            case,
            "transformers w8a8_block_fp8_matmul_triton (FP8 in)",
            fn,
            flops,
            note=f"rel err vs ours {rel(fn(), ref):.1e}" if _runs(fn) else "",
        )
    if hasattr(ff, "load_finegrained_fp8_kernel"):  # the hub kernel of later versions (needs `kernels`, the hub)
        try:
            kernel = ff.load_finegrained_fp8_kernel()
            fn = lambda: kernel.matmul(x, q, s, [128, 128], torch.bfloat16)  # noqa: E731
            bench(
                section,
                case,
                "transformers finegrained-fp8 hub kernel (bf16 in)",
                fn,
                flops,
                note=f"rel err vs ours {rel(fn(), ref):.1e}",
            )
        except Exception as exc:
            record(section, case, "transformers finegrained-fp8 hub kernel", note=f"unavailable: {str(exc)[:120]}")
    try:  # the module a fine-grained FP8 checkpoint loads into: whatever kernel it dispatches to (DeepGEMM...)
        layer = ff.FP8Linear(in_features=q.shape[1], out_features=q.shape[0], block_size=(128, 128)).to(DEV)
        layer.weight.data, layer.weight_scale_inv.data = q, s
        with torch.no_grad():
            fn = lambda: layer(x)  # noqa: E731
            bench(
                section,
                case,
                "transformers FP8Linear.forward (bf16 in)",
                fn,
                flops,
                note=f"rel err vs ours {rel(fn(), ref):.1e}" if _runs(fn) else "",
            )
    except Exception as exc:
        record(section, case, "transformers FP8Linear.forward", note=f"failed: {str(exc).splitlines()[0][:120]}")


def _runs(fn) -> bool:
    try:
        fn()
        return True
    except Exception:
        return False


def gemm():
    size = 256 if SMOKE else 8192
    section, case = "2 GEMM", f"{size}^3"
    print(f"\n# 2. GEMM {size}^3, bf16 out", flush=True)
    w, x, q, s, xq, xs = _operands(size, size, size)
    flops = 2 * size**3
    bench(section, case, "bf16 cuBLAS (torch.matmul)", lambda: x @ w.t(), flops)
    aq, bq, sa, sb = _scaled_mm_rowwise(x, w)
    for fast in (True, False):

        def fn(fast=fast):
            return torch._scaled_mm(
                aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16, use_fast_accum=fast
            )

        bench(
            section,
            case,
            f"torch._scaled_mm row-wise (FP8 in, fast_accum={fast})",
            fn,
            flops,
            note=f"rel err vs bf16 {rel(fn(), x @ w.t()):.1e}" if _runs(fn) else "",
        )
    ref = F8.fp8_gemm(xq, xs, q, s)
    bench(
        section,
        case,
        "fastplug block-scaled (FP8 in, default launch)",
        lambda: F8.fp8_gemm(xq, xs, q, s),
        flops,
        note=f"rel err vs bf16 {rel(ref, x @ w.t()):.1e}; "
        f"{kernel_tuning.pick('fp8_gemm', F8.fp8_gemm_config, size, DEV)}",
    )
    bench(
        section,
        case,
        "fastplug fp8_block_matmul (bf16 in, quantizes x; cuBLAS block-scaled where it runs)",
        lambda: F8.fp8_block_matmul(x, q, s),
        flops,
        note=f"rel err vs the Triton GEMM {rel(F8.fp8_block_matmul(x, q, s), ref):.1e}",
    )
    bench(
        section,
        case,
        "fastplug quantize_activation alone",
        lambda: F8.quantize_activation(x),
        nbytes=3 * x.numel() + 4 * xs.numel(),
    )
    _transformers_rows(section, case, x, q, s, xq, xs, flops, ref)
    return w, x, q, s, xq, xs


def gemm_best(best: dict, operands):
    """The 8192^3 rows of fastplug again, with the sweep's best launch."""
    size = 256 if SMOKE else 8192
    w, x, q, s, xq, xs = operands
    flops = 2 * size**3
    bench(
        "2 GEMM",
        f"{size}^3",
        "fastplug block-scaled (FP8 in, best launch)",
        lambda: F8.fp8_gemm(xq, xs, q, s, config=best),
        flops,
    )
    if not F8._cublas_takes(x, 128, size, size, False):  # else fp8_block_matmul runs cuBLAS, not this launch
        bench(
            "2 GEMM",
            f"{size}^3",
            "fastplug fp8_block_matmul (bf16 in, best launch)",
            lambda: F8.fp8_block_matmul(x, q, s),
            flops,
        )


# ------------------------------------------------------------------------------------------ projections


def projections(quick: bool):
    m = 256 if SMOKE else (2048 if quick else 8192)
    shapes = [(256, 384)] if SMOKE else [(4096, 14336), (14336, 4096), (4096, 6144)]
    print(f"\n# 4. Llama-8B projections, M={m} tokens, bf16 in/out; fwd + dX (frozen base: no dW)", flush=True)
    section = "4 projections"
    for k, n in shapes:
        w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02
        q, s = F8.quantize_weight_blockwise(w)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV, requires_grad=True)
        dy = torch.randn(m, n, dtype=torch.bfloat16, device=DEV)
        case = f"{k}->{n} fwd+dX"
        flops = 2 * 2 * m * n * k
        w64 = F8.dequantize_blockwise_reference(q, s, 128, torch.float64)
        y_err = rel(F8.fp8_linear(x, q, s), x.detach().double() @ w.double().t())
        variants = {
            "bf16 (F.linear, backward)": lambda: F.linear(x, w).backward(dy),
            "fp8, dX through the dequantized W": lambda: F8.fp8_linear(x, q, s, dx_fp8=False).backward(dy),
            "fp8, dX on the FP8 GEMM (the default where cuBLAS runs)": lambda: F8.fp8_linear(
                x, q, s, dx_fp8=True
            ).backward(dy),
        }
        base_kernels = None
        for impl, fn in variants.items():
            kernels = kernel_ms(fn, [x])  # device time beside do_bench's wall time (which includes host gaps)
            base_kernels = base_kernels or kernels
            note = "" if kernels is None else f"kernels {kernels:.3f} ms ({base_kernels / kernels:.2f}x bf16's)"
            if impl.startswith("fp8, dX through"):
                note += f"; y rel err vs the bf16 layer {y_err:.1e}"
            bench(section, case, impl, fn, flops, grad_to_none=[x], note=note)
        xd = x.detach()
        case = f"{k}->{n} fwd"
        with torch.no_grad():
            bench(section, case, "bf16 (x @ W^T)", lambda: xd @ w.t(), flops / 2)
            bench(section, case, "fp8 fp8_block_matmul", lambda: F8.fp8_block_matmul(xd, q, s), flops / 2)
            case = f"{k}->{n} dX"
            ref = dy.double() @ w64
            bench(section, case, "bf16 (dY @ W)", lambda: dy @ w, flops / 2)
            variants = {
                "dequantize W + bf16 GEMM": lambda: F8._project_grad(dy, q, s, 128, fp8=False),
                "FP8 GEMM (cuBLAS on W transposed per call, where it runs)": lambda: F8._project_grad(
                    dy, q, s, 128, fp8=True
                ),
                "FP8 Triton GEMM reading W transposed": lambda: F8.fp8_gemm(
                    *F8.quantize_activation(dy), q, s, input_grad=True
                ),
                "FP8 GEMM on a transposed copy of W": lambda: F8.fp8_gemm(
                    *F8.quantize_activation(dy), q.t().contiguous(), s.t().contiguous()
                ),
            }
            for impl, fn in variants.items():
                bench(section, case, impl, fn, flops / 2, note=f"rel err vs bf16 dY, FP8 W {rel(fn(), ref):.1e}")
        w = q = s = x = dy = None


# ---------------------------------------------------------------------------------------------- e2e


LLAMA_8B_4L = dict(
    config="LlamaConfig",
    batch=2,
    seq=4096,
    lora=e2e.ALL_LINEAR_LORA,
    attn="sdpa",
    full=dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    tiny=dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    ),
)


def _base_weight_bytes(model) -> int:
    """Bytes of the decoder layers' base linear weights (FP8 ones with their scales)."""
    total = 0
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if ".layers." in name and "lora_" not in name and isinstance(module, torch.nn.Linear) and w is not None:
            total += w.numel() * w.element_size()
            scale = getattr(w, "fp8_scale", None)
            total += 0 if scale is None else scale.numel() * scale.element_size()
    return total


def end_to_end(steps: int):
    e2e.MODELS["llama8b_4layers"] = LLAMA_8B_4L
    batch, seq = (2, 32) if SMOKE else (LLAMA_8B_4L["batch"], LLAMA_8B_4L["seq"])
    steps = 3 if SMOKE else steps
    print(
        f"\n# 5. end to end: Llama-8B width, 4 layers, {batch}x{seq}, LoRA r=16 (fp32) on all projections, "
        f"{steps} steps of fused AdamW on random tokens",
        flush=True,
    )
    section, case = "5 e2e", f"Llama-8B width 4 layers {batch}x{seq} LoRA r=16"
    results = {}
    for impl in ("bf16 transformers + peft", "fastplug bf16", "fastplug fp8=True"):
        model = handle = None
        try:
            model = e2e.build_model("llama8b_4layers", SMOKE, DEV, seed=0)
            if impl != "bf16 transformers + peft":
                handle = fastplug.patch_model(model, fp8=impl.endswith("fp8=True"))
                print(handle.summary(), flush=True)
            base_gib = _base_weight_bytes(model) / 2**30
            params = [p for p in model.parameters() if p.requires_grad]
            batches = e2e.token_batches(model.config.vocab_size, batch, seq, 4, 0, DEV)
            if DEV.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            times, losses = e2e.train_steps(model, params, batches, steps, DEV, float("inf"))
            step_s = statistics.median(times[min(5, len(times) - 1) :])
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEV.type == "cuda" else None
            last = statistics.mean(losses[-5:])
            note = (
                f"peak {fmt(peak)} GiB, base weights {base_gib:.3f} GiB, loss first {losses[0]:.4f}, "
                f"last 5 steps {last:.4f}"
            )
            if impl == "fastplug fp8=True" and "fastplug bf16" in results:
                ref_last, ref_step = statistics.mean(results["fastplug bf16"][0][-5:]), results["fastplug bf16"][1]
                note += f" ({(last - ref_last) / ref_last:+.2%}); {ref_step / step_s:.2f}x fastplug bf16's tok/s"
            results[impl] = (losses, step_s)
            record(section, case, impl, step_s * 1e3, f"{batch * seq / step_s:,.0f} tok/s", note)
        except Exception as exc:
            record(section, case, impl, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        finally:
            if handle is not None:
                handle.restore()
            del model, handle
            gc.collect()
            if DEV.type == "cuda":
                torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and sweep candidates, M=2048")
    parser.add_argument("--no-sweep", action="store_true", help="keep the default GEMM launch")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--steps", type=int, default=50, help="end-to-end steps per implementation")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes, no timings")
    parser.add_argument(
        "--transformers-fp8-file",
        metavar="PATH",
        help="transformers/integrations/finegrained_fp8.py of a version with the Triton kernel in the "
        "file (4.57), for the comparison row where the installed version needs the Hub",
    )
    args = parser.parse_args()
    global TRANSFORMERS_FP8_FILE
    TRANSFORMERS_FP8_FILE = args.transformers_fp8_file
    if SMOKE and not args.smoke:
        parser.error("no CUDA device: run with --smoke (and TRITON_INTERPRET=1) for a CPU check of the script")
    start = time.time()
    import transformers

    device = f"{torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}" if DEV.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}; "
        f"device: {device}; fp8 path: {F8.fp8_path(DEV)}",
        flush=True,
    )
    torch.manual_seed(0)
    ok = checks(args.quick)
    operands = gemm()
    if not args.no_sweep:
        best = sweep(args.quick)
        chosen = best if isinstance(best, F8.Fp8GemmConfig) else F8.Fp8GemmConfig.from_dict(best)
        # the launch every large-M call below takes (small M keeps its own)
        kernel_tuning.override("fp8_gemm", lambda M, device: chosen if M > 64 else F8.fp8_gemm_config(M, device))
        gemm_best(best, operands)
    del operands
    projections(args.quick)
    if not args.no_e2e:
        end_to_end(args.steps)
    print(f"\n(total {time.time() - start:.0f} s; checks {'passed' if ok else 'FAILED'}, see section 1)\n")
    columns = ("section", "case", "impl", "ms", "rate", "speedup", "note")
    # the summary: the GEMM, the sweep's winners, fwd+dX per projection and the end-to-end rows
    rows = [r for r in ROWS if r["section"] in ("2 GEMM", "3 sweep", "5 e2e") or r["case"].endswith("fwd+dX")]
    print(
        markdown_table([{c: fmt(r[c]) if c == "ms" else r[c] for c in columns} for r in rows], columns).replace(
            "| speedup |", "| vs bf16 |"
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
