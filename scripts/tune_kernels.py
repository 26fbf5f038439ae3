"""Measure launch configurations of the norm, gated-activation and RoPE kernels on a CUDA GPU.

    python3 scripts/tune_kernels.py [--ops rms_norm layer_norm swiglu geglu rope] [--no-compile]
    python3 scripts/tune_kernels.py --quick     # tiny shapes, no GPU needed (interpreter): a smoke test

For each op at the micro-benchmark's shape (bf16): every candidate config (the op's default constants of
fastplug/kernels/{norms,activations,rope}.py changed by `dataclasses.replace(constants, **overrides)`, and
installed with `fastplug.kernels.tuning.override(kernel, functools.partial(heuristic, constants=...))`) is
checked against a float32 torch reference (rel err > 1e-2 or NaN: dropped) and timed: forward alone and
backward alone (one graph, retain_graph) as median ms of triton.testing.do_bench, fwd+bwd as device time
of CUDA-graph replays (the micro bench's graph timing), with the peak MiB of one fwd+bwd above the inputs.
torch.compile of the eager op is measured the same way. One table per op, sorted by
fwd+bwd, printed as soon as the op is done; a summary of the best config per op comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fastplug/triton: --quick runs on the interpreter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.nn.functional as F  # noqa: E402

from fastplug.bench.micro import as_tuple, peak_mib, rel_err, rope_inputs, set_grads_none, time_step  # noqa: E402

norms = importlib.import_module("fastplug.kernels.norms")
activations = importlib.import_module("fastplug.kernels.activations")
rope_module = importlib.import_module("fastplug.kernels.rope")  # the package re-exports a function `rope`
kernel_tuning = importlib.import_module("fastplug.kernels.tuning")

MAX_REL_ERR = 1e-2

# [(name, overrides of the op's default constants)]; the first is the current default. Every candidate names
# each field it sets, so it means the same whatever the defaults are.
NORM_CANDIDATES = [
    ("default", {}),
    # Fewer resident backward programs: fewer fp32 dW (and db) partial rows, so less memory.
    ("bwd 4 warps x 4 prog/SM", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=16, bwd_loop_stages=1)),
    ("bwd 4 warps x 4 prog/SM pipelined 2", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=16, bwd_loop_stages=2)),
    ("bwd 4 warps x 5 prog/SM", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=20, bwd_loop_stages=1)),
    ("bwd 4 warps x 5 prog/SM pipelined 2", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=20, bwd_loop_stages=2)),
    ("bwd 4 warps x 6 prog/SM", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=24, bwd_loop_stages=1)),
    ("bwd 4 warps x 6 prog/SM pipelined 2", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=24, bwd_loop_stages=2)),
    ("bwd 4 warps x 8 prog/SM", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=32, bwd_loop_stages=1)),
    ("bwd 4 warps x 8 prog/SM pipelined 2", dict(bwd_elems_per_warp=1024, resident_warps_per_sm=32, bwd_loop_stages=2)),
]
_GLU_2D = dict(flat=False, max_block_cols=2048)
GLU_CANDIDATES = [
    ("default (flat 8192 el, 16 warps)", {}),
    ("2-D 2048 cols, 4096 el, 8 warps", dict(_GLU_2D, tile_elements=4096, num_warps=8)),
    ("2-D 8192 el, 8 warps", dict(_GLU_2D, tile_elements=8192, num_warps=8)),
    ("2-D 4096 cols, 8192 el, 8 warps", dict(_GLU_2D, max_block_cols=4096, tile_elements=8192, num_warps=8)),
    ("2-D 16384 el, 16 warps", dict(_GLU_2D, tile_elements=16384, num_warps=16)),
    ("flat 2048 el, 4 warps", dict(flat=True, tile_elements=2048, num_warps=4)),
    ("flat 4096 el, 4 warps", dict(flat=True, tile_elements=4096, num_warps=4)),
    ("flat 8192 el, 8 warps", dict(flat=True, tile_elements=8192, num_warps=8)),
    ("flat 16384 el, 16 warps", dict(flat=True, tile_elements=16384, num_warps=16)),
]
_ROPE_LOOP = dict(split_heads=False, max_block_heads=0)
_ROPE_SPLIT = dict(split_heads=True, max_block_heads=0)
ROPE_CANDIDATES = [
    ("default (split 8192 el, 8 warps)", {}),
    ("loop 2048 el, 4 warps", dict(_ROPE_LOOP, tile_elements=2048, num_warps=4)),
    ("loop 4096 el, 4 warps", dict(_ROPE_LOOP, tile_elements=4096, num_warps=4)),
    ("loop 4096 el, 8 warps", dict(_ROPE_LOOP, tile_elements=4096, num_warps=8)),
    ("loop 8192 el, 8 warps", dict(_ROPE_LOOP, tile_elements=8192, num_warps=8)),
    ("split 2048 el, 4 warps", dict(_ROPE_SPLIT, tile_elements=2048, num_warps=4)),
    ("split 4096 el, 4 warps", dict(_ROPE_SPLIT, tile_elements=4096, num_warps=4)),
    ("split 8 heads, 2048 el, 4 warps", dict(_ROPE_SPLIT, max_block_heads=8, tile_elements=2048, num_warps=4)),
    ("split 8 heads, 4096 el, 8 warps", dict(_ROPE_SPLIT, max_block_heads=8, tile_elements=4096, num_warps=8)),
]


@dataclasses.dataclass
class Case:
    op: str
    shape: str
    kernel: str  # the name `fastplug.kernels.tuning.override` takes
    heuristic: object  # the op's config heuristic; takes constants=
    constants: object  # the op's default constants, which the candidates change
    candidates: list
    leaves: list  # tensors whose .grad the backward fills
    ours: object  # () -> outputs, through fastplug
    eager: object  # () -> outputs, the torch op (compiled as the baseline)
    reference: object  # () -> (outputs, grads) in float32
    bytes_moved: int  # minimum HBM bytes of one fwd+bwd


def _randn(*shape, device, dtype, requires_grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)


def _fp32_ref(fn, leaves, grad_outputs):
    """fn on float32 copies of the leaves: outputs and grads."""
    copies = [t.detach().float().requires_grad_() for t in leaves]
    outs = as_tuple(fn(*copies))
    torch.autograd.backward(outs, [g.float() for g in grad_outputs])
    return [o.detach() for o in outs], [c.grad for c in copies]


def case_norm(op, M, N, device, dtype) -> Case:
    x = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype).requires_grad_()
    leaves = [x, w]
    if op == "rms_norm":
        ours = lambda: norms.rms_norm(x, w, 1e-6)  # noqa: E731
        ref_fn = lambda x, w: norms.rms_norm_reference(x, w, 1e-6)  # noqa: E731
    else:
        b = (0.1 * torch.randn(N, device=device)).to(dtype).requires_grad_()
        leaves.append(b)
        ours = lambda: norms.layer_norm(x, w, b, 1e-5)  # noqa: E731
        ref_fn = lambda x, w, b: F.layer_norm(x, (N,), w, b, 1e-5)  # noqa: E731
    eager = lambda: ref_fn(*leaves)  # noqa: E731
    constants = norms.RMS_NORM_CONSTANTS if op == "rms_norm" else norms.LAYER_NORM_CONSTANTS
    return Case(
        op,
        f"{M}x{N}",
        "norm",
        norms.norm_config,
        constants,
        NORM_CANDIDATES,
        leaves,
        ours,
        eager,
        lambda grads: _fp32_ref(ref_fn, leaves, grads),
        5 * M * N * x.element_size(),
    )


def case_glu(op, M, N, device, dtype) -> Case:
    gate = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    up = _randn(M, N, device=device, dtype=dtype, requires_grad=True)
    if op == "swiglu":
        ours = lambda: activations.swiglu(gate, up)  # noqa: E731
        ref_fn = lambda g, u: F.silu(g) * u  # noqa: E731
    else:
        ours = lambda: activations.geglu(gate, up, "tanh")  # noqa: E731
        ref_fn = lambda g, u: F.gelu(g, approximate="tanh") * u  # noqa: E731
    return Case(
        op,
        f"{M}x{N}",
        "glu",
        activations.glu_config,
        activations.GLU_CONSTANTS,
        GLU_CANDIDATES,
        [gate, up],
        ours,
        lambda: ref_fn(gate, up),
        lambda grads: _fp32_ref(ref_fn, [gate, up], grads),
        8 * M * N * gate.element_size(),
    )


def case_rope(B, Hq, Hk, T, D, device, dtype) -> Case:
    q_proj, k_proj, cos, sin = rope_inputs(B, Hq, Hk, T, D, device, dtype)  # the micro-benchmark's inputs

    def ref_fn(qp, kp):
        return rope_module.rope_reference(qp.transpose(1, 2), kp.transpose(1, 2), cos.to(qp.dtype), sin.to(qp.dtype))

    return Case(
        "rope",
        f"q {B}x{Hq}x{T}x{D} k {B}x{Hk}x{T}x{D}",
        "rope",
        rope_module.rope_config,
        rope_module.ROPE_CONSTANTS,
        ROPE_CANDIDATES,
        [q_proj, k_proj],
        lambda: rope_module.rope(q_proj.transpose(1, 2), k_proj.transpose(1, 2), cos, sin),
        lambda: ref_fn(q_proj, k_proj),
        lambda grads: _fp32_ref(ref_fn, [q_proj, k_proj], grads),
        4 * (q_proj.numel() + k_proj.numel()) * q_proj.element_size(),
    )


def build_case(op, quick, device, dtype) -> Case:
    if op in ("rms_norm", "layer_norm"):
        return case_norm(op, *((37, 129) if quick else (16384, 4096)), device, dtype)
    if op in ("swiglu", "geglu"):
        return case_glu(op, *((37, 129) if quick else (16384, 14336)), device, dtype)
    return case_rope(*((1, 4, 2, 16, 80) if quick else (4, 32, 8, 4096, 128)), device, dtype)


# --- measuring -----------------------------------------------------------------------------------------


def _bench(fn, leaves, args) -> float:
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=args.warmup, rep=args.rep, grad_to_none=leaves, return_mode="median")
    times = []  # --quick on CPU: a plain median of a few calls
    for _ in range(3):
        set_grads_none(leaves)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, case: Case, grad_outputs, args) -> dict:
    """fwd, bwd, fwd+bwd median ms, and the host time of one fwd+bwd call (launch overhead)."""
    leaves = case.leaves
    row = {}

    def fwd_bwd():
        torch.autograd.backward(as_tuple(fn()), grad_outputs)

    row["fwd"] = _bench(fn, leaves, args)
    try:
        set_grads_none(leaves)
        outs = as_tuple(fn())
        row["bwd"] = _bench(lambda: torch.autograd.backward(outs, grad_outputs, retain_graph=True), leaves, args)
        outs = None
    except Exception as e:  # a compiled backward may refuse retain_graph
        row["bwd"] = float("nan")
        row["note"] = f"bwd alone: {type(e).__name__}"
    # fwd+bwd as one CUDA graph (micro's graph timing): kernel time, not the host's launch cost.
    device = leaves[0].device
    row["fwd+bwd"], _, note = time_step(fwd_bwd, leaves, device, "graph", args.warmup, args.rep)
    if note:
        row["note"] = note
    row["peak_mib"] = peak_mib(fwd_bwd, leaves, device) or float("nan")
    # Host time per call with the GPU queue far from full: what a fwd+bwd costs the CPU.
    _sync()
    n = 10
    start = time.perf_counter()
    for _ in range(n):
        set_grads_none(leaves)
        fwd_bwd()
    row["host_us"] = (time.perf_counter() - start) / n * 1e6
    _sync()
    set_grads_none(leaves)
    return row


def check(fn, case: Case, grad_outputs, ref_outs, ref_grads) -> float:
    set_grads_none(case.leaves)
    outs = as_tuple(fn())
    torch.autograd.backward(outs, grad_outputs)
    errs = [rel_err(o, r) for o, r in zip(outs, ref_outs)]
    errs += [rel_err(t.grad, r) for t, r in zip(case.leaves, ref_grads)]
    set_grads_none(case.leaves)
    return max(errs)


def _fmt(v) -> str:
    return "   n/a" if v is None or v != v else f"{v:6.3f}"


def run_op(op, args, device, dtype) -> dict | None:
    case = build_case(op, args.quick, device, dtype)
    outs = as_tuple(case.eager())
    grad_outputs = [torch.randn_like(o) for o in outs]  # keeps the outputs' layout, as autograd's would
    del outs
    ref_outs, ref_grads = case.reference(grad_outputs)
    set_grads_none(case.leaves)
    gbytes = case.bytes_moved / 1e9
    print(
        f"\n## {op} {case.shape} {str(dtype).replace('torch.', '')}: minimum traffic {gbytes:.3f} GB fwd+bwd "
        f"(= {gbytes / 3.0:.3f} ms at 3 TB/s)",
        flush=True,
    )
    header = (
        f"{'config':44s} {'fwd':>6s} {'bwd':>6s} {'f+b':>6s} {'TB/s':>5s} {'MiB':>6s} {'host us':>7s} "
        f"{'err':>8s}  overrides"
    )
    print(header, flush=True)
    rows = []

    def emit(name, row, overrides):
        tbps = gbytes / row["fwd+bwd"] if row["fwd+bwd"] > 0 else float("nan")
        line = (
            f"{name:44s} {_fmt(row['fwd'])} {_fmt(row['bwd'])} {_fmt(row['fwd+bwd'])} {tbps:5.2f} "
            f"{row['peak_mib']:6.0f} {row['host_us']:7.0f} {row['err']:8.1e}  {overrides} {row.get('note', '')}"
        )
        print(line, flush=True)
        rows.append((row["fwd+bwd"], line, name, overrides, row))

    if not args.no_compile and not args.quick:
        try:
            compiled = torch.compile(case.eager)
            row = measure(compiled, case, grad_outputs, args)
            row["err"] = check(compiled, case, grad_outputs, ref_outs, ref_grads)
            emit("torch.compile", row, "-")
        except Exception as e:
            print(f"torch.compile failed: {type(e).__name__}: {e}", flush=True)
    for name, overrides in case.candidates:
        constants = dataclasses.replace(case.constants, **overrides)
        with kernel_tuning.override(case.kernel, functools.partial(case.heuristic, constants=constants)):
            try:
                err = check(case.ours, case, grad_outputs, ref_outs, ref_grads)
                if not err <= MAX_REL_ERR:  # NaN fails too
                    print(f"{name:44s} DROPPED: rel err {err:.3e} > {MAX_REL_ERR}  {overrides}", flush=True)
                    continue
                row = measure(case.ours, case, grad_outputs, args)
                row["err"] = err
                emit(name, row, overrides)
            except Exception as e:
                print(f"{name:44s} FAILED: {type(e).__name__}: {str(e)[:300]}  {overrides}", flush=True)
                if args.verbose:
                    traceback.print_exc()
    rows.sort(key=lambda r: r[0])
    print(f"\n{op} sorted by fwd+bwd ms:\n{header}", flush=True)
    for r in rows:
        print(r[1], flush=True)
    ours = [r for r in rows if r[2] != "torch.compile"]
    if not ours:
        return None
    compile_ms = next((r[0] for r in rows if r[2] == "torch.compile"), None)
    default_ms = next((r[0] for r in rows if r[2] == case.candidates[0][0]), None)
    best = ours[0]
    return dict(
        op=op, best=best[2], overrides=best[3], ms=best[0], row=best[4], default_ms=default_ms, compile_ms=compile_ms
    )


def main(argv=None) -> int:
    ops = ("rms_norm", "rope", "layer_norm", "swiglu", "geglu")  # the largest gaps first
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=ops, default=list(ops))
    parser.add_argument("--quick", action="store_true", help="tiny shapes; runs without a GPU (interpreter)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep ms")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failing candidates")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        parser.error("needs a CUDA GPU (or --quick for a smoke test on the interpreter)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        import triton

        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    torch.manual_seed(0)
    started = time.perf_counter()
    summary = []
    for op in args.ops:
        t0 = time.perf_counter()
        try:
            result = run_op(op, args, device, torch.bfloat16)
        except Exception as e:
            print(f"{op}: FAILED {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            result = None
        if result:
            summary.append(result)
        print(f"({op}: {time.perf_counter() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    print(f"\n## Summary: best config per op (fwd+bwd ms), {time.perf_counter() - started:.0f} s in all", flush=True)
    print(f"{'op':11s} {'best':>6s} {'fwd':>6s} {'bwd':>6s} {'default':>7s} {'compile':>7s}  config / overrides")
    for r in summary:
        print(
            f"{r['op']:11s} {_fmt(r['ms'])} {_fmt(r['row']['fwd'])} {_fmt(r['row']['bwd'])}  "
            f"{_fmt(r['default_ms'])}  {_fmt(r['compile_ms'])}  {r['best']}: {r['overrides']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
