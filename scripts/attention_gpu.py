"""Attention on one GPU in one go: correctness of the Triton kernel at full shapes against the fp32 reference
(both backward paths), where the time goes (each kernel alone, TMA descriptors on and off), sweeps of launch
configs per kernel and head dim, and the issue-11 comparison table (SDPA, the Triton kernel, the dispatcher).
Run from the repo root:  python scripts/attention_gpu.py [--breakdown] [--sweep4] [--no-table] ...

The last lines printed are the table; the chosen configs go into attention.AttentionTables by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
kernel_tuning = importlib.import_module("fastplug.kernels.tuning")
A = importlib.import_module("fastplug.kernels.attention")  # the module: fastplug.kernels exports the function

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DT = torch.bfloat16


def rand(*shape, grad=True):
    return torch.randn(*shape, device=DEV, dtype=DT).requires_grad_(grad)


def bench_ms(fn, rep=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


def check(name, B, Hq, Hkv, T, D, **kw):
    """Triton path (forced) vs the fp32 reference, forward and the three grads."""
    q, k, v = rand(B, Hq, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    start = end = None
    cu = kw.pop("cu_seqlens", None)
    if cu is not None:
        start, end = A.bounds_from_cu_seqlens(cu, T)
    p = A._problem(q, k, kw.get("causal", True), kw.get("sliding_window"), kw.get("softcap"), D**-0.5)
    out = A.FlashAttention.apply(q, k, v, p, start, end)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = A._reference(q.float(), k.float(), v.float(), p.causal, p.window, p.softcap, p.scale, start, end)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.float())
    errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
    ok = max(errs) < 2e-2
    print(f"check {name:<28} out/dq/dk/dv rel err " + " ".join(f"{e:.2e}" for e in errs) + ("" if ok else "  FAIL"))
    return ok


def cases():
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(16383, generator=g)[:7] + 1).values
    cu = torch.cat((torch.tensor([0]), cuts, torch.tensor([16384]))).to(torch.int32).to(DEV)
    return {
        "llama causal B4 32/8 T4096 D128": dict(B=4, Hq=32, Hkv=8, T=4096, D=128),
        "gemma2 B2 8/4 T2048 D256 cap50 w4096": dict(
            B=2, Hq=8, Hkv=4, T=2048, D=256, softcap=50.0, sliding_window=4096
        ),
        "gemma2 B2 8/4 T8192 D256 cap50 w4096": dict(
            B=2, Hq=8, Hkv=4, T=8192, D=256, softcap=50.0, sliding_window=4096
        ),
        "varlen 8 docs 16384 32/8 D128": dict(B=1, Hq=32, Hkv=8, T=16384, D=128, cu_seqlens=cu),
    }


def make(c):
    c = dict(c)
    B, Hq, Hkv, T, D = (c.pop(x) for x in ("B", "Hq", "Hkv", "T", "D"))
    q, k, v = rand(B, Hq, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    return q, k, v, c


def triton_step(q, k, v, kw, do):
    start = end = None
    if kw.get("cu_seqlens") is not None:
        start, end = A.bounds_from_cu_seqlens(kw["cu_seqlens"], q.shape[2])
    D = q.shape[3]
    p = A._problem(
        q,
        k,
        True,
        A._normalise_window(kw.get("sliding_window"), True, q.shape[2], k.shape[2]),
        kw.get("softcap"),
        D**-0.5,
    )

    def fwd():
        return A._flash_forward(q, k, v, p, start, end)

    out, lse = fwd()

    def bwd():
        return A._flash_backward(do, q, k, v, out, lse, p, start, end)

    return fwd, bwd


SWEEP = {
    "fwd": {
        128: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 4)],
        256: [(64, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
    },
    "dkdv": {
        128: [(64, 128, 8, 2), (32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (16, 128, 4, 3)],
        256: [(32, 64, 8, 2), (32, 64, 4, 2), (16, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (32, 32, 4, 2)],
    },
    "dq": {
        128: [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
        256: [(64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
    },
}


# A second, finer round around the first round's best D128 configs (Llama causal, the case furthest from SDPA).
SWEEP2 = {
    "fwd": {128: [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 5)]},
    "dkdv": {128: [(32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 4, 2), (32, 64, 8, 3), (64, 32, 4, 3), (32, 32, 4, 3)]},
    "dq": {128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 4)]},
}


# A third round with registers and spills per config (they showed k/v-major dK/dV tiles spilling, which
# led to the query-row-major tiles); here the D256 case.
SWEEP3 = {
    "dkdv": {
        256: [(bm, bn, w, st) for bm, bn in ((32, 32), (64, 32), (32, 64), (64, 64)) for w in (4, 8) for st in (1, 2)]
    },
}
# After TMA (--breakdown): the neighbours of the chosen tiles, each head dim with its AttentionTables.tma choice.
SWEEP4 = {
    "fwd": {
        128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
        256: [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)],
    },
    "dkdv": {
        128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
        256: [(64, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 3), (64, 64, 8, 2)],
    },
    "dq": {
        128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 4, 3)],
        256: [(128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2), (128, 64, 8, 2)],
    },
}
# per kernel: the module of fastplug.kernels.attention whose launcher looks it up (the recorder replaces it there)
KERNELS = {"fwd": ("forward", "_attn_fwd"), "dkdv": ("backward", "_attn_bwd_dkdv"), "dq": ("backward", "_attn_bwd_dq")}
ALL_TMA = ("fwd", "dkdv", "dq")


def tuned(**changes):
    """attention's tables changed for the block (a `with` block: the override is undone at its end)."""
    tables = dataclasses.replace(A.ATTENTION_TABLES, **changes)
    return kernel_tuning.override("attention", functools.partial(A.attention_config, tables=tables))


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: launches it and keeps the compiled kernel (registers, spills)."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.fn[grid](*args, **kwargs)
            return self.last

        return launch


def sweep(name, c, table=SWEEP):
    q, k, v, kw = make(c)
    D = q.shape[3]
    do = torch.randn(q.shape[0], q.shape[2], q.shape[1], D, device=DEV, dtype=DT)
    for kernel, configs in table.items():
        results = []
        for cfg in configs.get(128 if D <= 128 else 256, []):
            try:
                with tuned(**{kernel: ((256, tuple(cfg)),)}):
                    stage, kernel_name = KERNELS[kernel]
                    module = importlib.import_module(f"{A.__name__}.{stage}")
                    recorder = _LaunchRecorder(getattr(module, kernel_name))
                    setattr(module, kernel_name, recorder)
                    try:
                        fwd, bwd = triton_step(q, k, v, kw, do)
                        ms = bench_ms(fwd if kernel == "fwd" else bwd, rep=100)
                    finally:
                        setattr(module, kernel_name, recorder.fn)
                compiled = recorder.last
                regs = f"r{getattr(compiled, 'n_regs', '?')}s{getattr(compiled, 'n_spills', '?')}"
                results.append((ms, cfg, regs))
            except Exception as exc:  # out of shared memory or registers: that config is out
                results.append((float("inf"), cfg, "-"))
                print(f"  {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
        results.sort()
        print(f"sweep {name:<38} {kernel:<5} " + ", ".join(f"{c}={ms:.3f}[{r}]" for ms, c, r in results), flush=True)


def kernel_problem(c):
    """(q, k, v, problem, doc start, doc end, dO) of one case, for calling the kernels' launchers directly."""
    q, k, v, kw = make(c)
    B, Hq, T, D = q.shape
    start = end = None
    if kw.get("cu_seqlens") is not None:
        start, end = A.bounds_from_cu_seqlens(kw["cu_seqlens"], T)
    p = A._problem(q, k, True, A._normalise_window(kw.get("sliding_window"), True, T, T), kw.get("softcap"), D**-0.5)
    return q, k, v, p, start, end, torch.randn(B, T, Hq, D, device=DEV, dtype=DT)


def breakdown(name, c):
    """Each kernel of one problem alone, TMA descriptors on and off, and the whole backward as tuned."""
    q, k, v, p, start, end, do = kernel_problem(c)
    out, lse = A._flash_forward(q, k, v, p, start, end)
    delta, dq, dk, dv = torch.empty_like(lse), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cfg = lambda kernel: A._config(kernel, p.block_d, q.device)  # noqa: E731  the launch as configured now
    tile = lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    rows = []
    for tma in (ALL_TMA, ()):
        with tuned(tma=((256, tma),)):
            tag = "tma" if tma else "ptr"
            rows.append((f"fwd {tile(cfg('fwd'))}", tag, bench_ms(lambda: A._flash_forward(q, k, v, p, start, end))))
            rows.append(
                (
                    f"dq+delta {tile(cfg('dq'))}",
                    tag,
                    bench_ms(lambda: A._launch_dq(do, q, k, v, out, lse, delta, dq, p, start, end, cfg("dq"))),
                )
            )
            rows.append(
                (
                    f"dkdv {tile(cfg('dkdv'))}",
                    tag,
                    bench_ms(lambda: A._launch_dkdv(do, q, k, v, lse, delta, dk, dv, p, start, end, cfg("dkdv"))),
                )
            )
    rows.append(
        (
            "whole backward",
            f"tma {'+'.join(A._bucket(A.ATTENTION_TABLES.tma, p.block_d))}",
            bench_ms(lambda: A._flash_backward(do, q, k, v, out, lse, p, start, end)),
        )
    )
    for what, tag, ms in rows:
        print(f"breakdown {name:<38} {what:<34} {tag:<12} {ms:.3f} ms", flush=True)


def compare_old(path):
    """The kernels of another attention.py (one file: a commit before kernels/attention/ was split by stage, its
    registered ops cut off) against this one's, forward and backward apart, every case, same run."""
    spec = importlib.util.spec_from_file_location("fastplug.kernels._attention_old", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # dataclasses look their module up there
    spec.loader.exec_module(old)
    for name, c in cases().items():
        q, k, v, p, start, end, do = kernel_problem(c)
        row = []
        for module in (old, A):
            out, lse = module._flash_forward(q, k, v, p, start, end)
            row.append(bench_ms(lambda: module._flash_forward(q, k, v, p, start, end)))
            row.append(bench_ms(lambda: module._flash_backward(do, q, k, v, out, lse, p, start, end)))
        print(
            f"old vs new {name:<38} fwd {row[0]:.3f} -> {row[2]:.3f}  bwd {row[1]:.3f} -> {row[3]:.3f}  "
            f"sum {row[0] + row[1]:.3f} -> {row[2] + row[3]:.3f} ms",
            flush=True,
        )
        q = k = v = None
        torch.cuda.empty_cache()


def table():
    rows = []
    for name, c in cases().items():
        q, k, v, kw = make(c)
        B, Hq, T, D = q.shape
        leaves = [q, k, v]
        do = torch.randn(B, T, Hq, D, device=DEV, dtype=DT)

        def step(fn):
            def run():
                for t in leaves:
                    t.grad = None
                fn().backward(do)

            return run

        impls = {}
        cu = kw.get("cu_seqlens")
        if cu is None and "softcap" not in kw:
            impls["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(
                1, 2
            )
            impls["sdpa repeat_kv"] = lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True
            ).transpose(1, 2)
        if cu is not None:
            seen = A.visible_keys(T, T, True, None, *A.bounds_from_cu_seqlens(cu, T), device=DEV)
            impls["sdpa block-diag mask"] = lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=seen
            ).transpose(1, 2)
        if "softcap" in kw and T <= 2048:

            def eager():
                kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
                s = (q @ kk.transpose(-1, -2)) * D**-0.5
                s = 50.0 * torch.tanh(s / 50.0)
                s = s.masked_fill(~A.visible_keys(T, T, True, 4096, device=DEV), float("-inf"))
                return (torch.softmax(s.float(), -1).to(DT) @ vv).transpose(1, 2)

            impls["eager"] = eager
        impls["triton kernel"] = lambda: A.FlashAttention.apply(
            q,
            k,
            v,
            A._problem(
                q, k, True, A._normalise_window(kw.get("sliding_window"), True, T, T), kw.get("softcap"), D**-0.5
            ),
            *((A.bounds_from_cu_seqlens(cu, T)) if cu is not None else (None, None)),
        )
        impls["fastplug dispatcher"] = lambda: A.attention(q, k, v, **kw)
        for impl, fn in impls.items():
            try:
                ms = bench_ms(step(fn))
                fms = bench_ms(fn)
                rows.append((name, impl, ms, fms))
            except Exception as exc:
                rows.append((name, impl, float("nan"), float("nan")))
                print(f"{name} {impl}: {type(exc).__name__}: {str(exc)[:200]}")
        q = k = v = leaves = None
        torch.cuda.empty_cache()
    print("\n| case | impl | fwd+bwd ms | fwd ms |\n|---|---|---|---|")
    for name, impl, ms, fms in rows:
        print(f"| {name} | {impl} | {ms:.3f} | {fms:.3f} |")


def guarded(fn, *args):
    """One failing section prints its traceback and the run goes on: a device call is too dear to lose."""
    try:
        return fn(*args)
    except Exception:
        import traceback

        traceback.print_exc()
        return False


def checks(quick=False):
    cu = torch.tensor([0, 1000, 1777, 3001], dtype=torch.int32, device=DEV)
    all_cases = {
        "causal D128 GQA4": ((1, 8, 2, 1531, 128), {}),
        "full D64 MQA": ((1, 4, 1, 1000, 64), dict(causal=False)),
        "causal D80 window 300": ((1, 4, 2, 1200, 80), dict(sliding_window=300)),
        "D256 cap 50 window 512": ((1, 4, 2, 1500, 256), dict(softcap=50.0, sliding_window=512)),
        "D96 varlen 3 docs": ((1, 4, 2, 3001, 96), dict(cu_seqlens=cu)),
    }
    ok = True
    # every kernel both ways: tiles through TMA descriptors, and through pointers (quick: a few cases each)
    for tag, tma, names in (
        ("tma", ALL_TMA, [0, 3, 4] if quick else range(5)),
        ("ptr", (), [2] if quick else range(5)),
    ):
        with tuned(tma=((256, tma),)):
            for i in names:
                name = list(all_cases)[i]
                shape, kw = all_cases[name]
                ok &= check(f"{tag} {name}", *shape, **kw)
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="first round: six configs per kernel, all cases")
    parser.add_argument("--sweep2", action="store_true", help="second round around the D128 best (Llama case)")
    parser.add_argument("--sweep3", action="store_true", help="broad round on the Llama case, with registers/spills")
    parser.add_argument("--breakdown", action="store_true", help="each kernel alone, TMA on/off")
    parser.add_argument("--sweep4", default="", help="after TMA: neighbours of the chosen tiles, on these cases (0,2)")
    parser.add_argument("--compare-old", default="", help="an earlier attention.py to time against, every case")
    parser.add_argument("--gpu-tests", action="store_true", help="pytest tests/gpu/test_attention_gpu.py last")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--quick-check", action="store_true", help="a few check cases per backward")
    parser.add_argument("--breakdown-cases", default="0,1,2,3", help="indices into the cases, for --breakdown")
    parser.add_argument("--no-table", action="store_true")
    args = parser.parse_args()
    import transformers
    import triton

    print(
        f"torch {torch.__version__} triton {triton.__version__} transformers {transformers.__version__} "
        f"{torch.cuda.get_device_name()}"
    )
    from transformers import masking_utils

    print(
        "sliding_window_overlay:",
        inspect.getsource(masking_utils.sliding_window_overlay)
        .split("def inner_mask")[1]
        .strip()
        .splitlines()[-1]
        .strip(),
    )
    t0 = time.time()
    if not args.no_check:
        ok = guarded(checks, args.quick_check)
        print(f"checks {'passed' if ok else 'FAILED'} in {time.time() - t0:.0f} s", flush=True)
    if args.sweep:
        for name, c in cases().items():
            guarded(sweep, name, c)
        print(f"sweep done at {time.time() - t0:.0f} s", flush=True)
    if args.sweep2:
        name, c = next(iter(cases().items()))
        guarded(sweep, name, c, SWEEP2)
    if args.sweep3:
        name = "gemma2 B2 8/4 T8192 D256 cap50 w4096"
        guarded(sweep, name, cases()[name], SWEEP3)
        print(f"sweep3 done at {time.time() - t0:.0f} s", flush=True)
    if args.breakdown:
        for i, (name, c) in enumerate(cases().items()):
            if str(i) in args.breakdown_cases.split(","):
                guarded(breakdown, name, c)
        print(f"breakdown done at {time.time() - t0:.0f} s", flush=True)
    if args.compare_old:
        guarded(compare_old, args.compare_old)
        print(f"compare-old done at {time.time() - t0:.0f} s", flush=True)
    for i in filter(None, args.sweep4.split(",")):
        name = list(cases())[int(i)]
        guarded(sweep, name, cases()[name], SWEEP4)
        print(f"sweep4 {name} done at {time.time() - t0:.0f} s", flush=True)
    if not args.no_table:
        guarded(table)
    if args.gpu_tests:
        import subprocess

        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_attention_gpu.py"]
        )
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
