"""`python -m fastplug.bench.qlora`: the QLoRA benchmark rows in one run.

Micro rows from `micro.qlora_rows` (dequantization, batch-1 GEMV, 4-bit LoRA MLP against bitsandbytes and
peft + bitsandbytes), then end to end: a random-init Llama of 8B width (4 layers, vocab 128256) whose decoder
linears are bitsandbytes NF4 (double quant, bf16 compute), LoRA r=16 on all of them (peft's fp32 adapters),
non-reentrant checkpointing, fused AdamW, 2x4096 tokens: transformers + peft + bnb, then the same model
patched by fastplug, then Liger when installed. `--shape llama1b`: the e2e bench's Llama-1B preset at 4x2048
instead. `--quick`: tiny shapes on CPU (a smoke run). Markdown table last.

`--impls` picks the end-to-end rows; `fastplug-bf16` is the same model unquantized (bf16 bases) patched by
fastplug: what the 4-bit path loses against its own bf16 path, in the same run; `fastplug+graphs` adds
`cuda_graphs=True` (the decoder layers replayed as CUDA graphs), `+auto` gradient_checkpointing="auto" (only
as many layers checkpointed as the memory budget needs). `--profile`: for each fastplug
row, one more step under torch.profiler (kernel table, device ms against host ms). `--gemv`: the 4-bit GEMV
against bitsandbytes and dequantize+matmul at batch 1-8 (and `--gemv-sweep`: its tile configurations).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ._report import fmt, markdown_table
from .presets import ALL_LINEAR_LORA, MODELS, QLORA_TINY

# --shape: (the e2e bench's preset, batch, seq, name in the table)
SHAPES = {
    "llama8b_4l": ("llama8b_4l", 2, 4096, "Llama-8B width, 4 layers"),
    "llama1b": ("llama", 4, 2048, "Llama-1B shape"),
}


def _to_4bit(model, device) -> None:
    """Every nn.Linear of the decoder layers becomes a bitsandbytes NF4 Linear4bit holding the same weight."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in ALL_LINEAR_LORA:
                lin = getattr(owner, name, None)
                if not isinstance(lin, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    lin.in_features,
                    lin.out_features,
                    bias=False,
                    compute_dtype=torch.bfloat16,
                    quant_type="nf4",
                    compress_statistics=True,
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(
                    lin.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True
                )._quantize(device)
                setattr(owner, name, q)


IMPLS = (
    "transformers+peft+bnb",
    "fastplug",
    "liger",
    "fastplug-bf16",
    "fastplug+graphs",
    "fastplug+auto",
    "fastplug+auto+graphs",
)


def _build(config, device, quantize: bool):
    import peft
    import transformers

    from fastplug.patch import checkpointing

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if quantize:
        _to_4bit(model, device)
    checkpointing.enable_native(model)
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=ALL_LINEAR_LORA))


def _step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _profile(model, optimizer, ids, device, label: str, rows: int = 30) -> str:
    """One step under torch.profiler: the kernel table (by total CUDA time), kernels per step, device ms
    (the sum of kernel time: the step if the host kept up) and host ms (the step's Python, before the sync)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        loss = _step(model, optimizer, ids)
        host = time.perf_counter() - start
        loss.item()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events)
    print(f"\n== profile: {label} ==", flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    summary = (
        f"{label}: device {kernel_ms:.1f} ms of kernels ({launches} launches), host {1e3 * host:.1f} ms "
        f"before the sync, wall {1e3 * wall:.1f} ms (profiled)"
    )
    print(summary, flush=True)
    return summary


def e2e_rows(
    device,
    quick: bool,
    steps: int = 4,
    shape: str = "llama8b_4l",
    impls=IMPLS[:3],
    profile: bool = False,
    options: dict | None = None,
) -> list[dict]:
    """options: KernelOptions overrides for the fastplug rows."""
    import transformers

    import fastplug

    from .micro import _liger

    device = torch.device(device)
    preset, batch, seq, shape_name = SHAPES[shape]
    config = transformers.LlamaConfig(**(QLORA_TINY if quick else MODELS[preset]["full"]), use_cache=False)
    if quick:
        batch, seq = 2, 16
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2)]
    shape = "tiny" if quick else shape_name
    rows, summaries = [], []
    # Every row trains a freshly built model (the same seed): rows sharing one model would start where the
    # previous row's optimizer steps left the adapters, and their losses would not compare.
    apply_liger = _liger("_apply_liger_kernel_to_instance")
    # Liger last: its instance patch also replaces functions and classes of transformers' Llama module (a fastplug
    # row built after it fused LoRA on 4 of 8 blocks), and every row here runs in this one process.
    order = sorted(
        (i for i in IMPLS if i in impls and (i != "liger" or apply_liger is not None)), key=lambda i: i == "liger"
    )
    model = None
    for impl in order:
        bf16 = impl == "fastplug-bf16"
        model = None  # the previous row's model goes before the next is built
        model = _build(config, device, quantize=not bf16)
        params = [p for p in model.parameters() if p.requires_grad]
        # freeze_gc and stack_projections as the trainer adapters (and the e2e bench) set them for their run
        fast = impl.startswith("fastplug")
        scoped = {
            "freeze_gc": True,
            "stack_projections": True,
            "cuda_graphs": impl.endswith("graphs"),
            "gradient_checkpointing": "auto" if "+auto" in impl else True,
            **(options or {}),
        }
        handle = fastplug.patch_model(model, **scoped) if fast else None
        if impl == "liger":
            apply_liger(model=model.get_base_model())
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, losses, host = [], [], []
        for step in range(steps + 2):  # two warm-up steps (Triton compiles, cuBLAS picks)
            start = time.perf_counter()
            loss = _step(model, optimizer, ids[step % 2])
            host.append(time.perf_counter() - start)
            losses.append(loss.item())  # syncs
            if step >= 2:
                times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        note = "" if handle is None else "lora_fused " + str(handle.counts.get("lora_fused", 0))
        note += f"; host {1e3 * statistics.median(host[2:]):.0f} ms before the sync"
        quant = "bf16" if bf16 else "NF4"
        rows.append(
            {
                "op": "e2e step",
                "shape": f"{shape}, {batch}x{seq} {quant}",
                "impl": impl,
                "ms": ms,
                "tok/s": batch * seq / ms * 1e3,
                "peak GiB": peak,
                "note": f"losses {losses[0]:.4f}.. {note}",
            }
        )
        if profile and device.type == "cuda" and handle is not None:
            summaries.append(_profile(model, optimizer, ids[0], device, f"{impl} {shape} {quant}"))
        if handle is not None:
            handle.restore()
        del optimizer
    for s in summaries:
        print(s)
    return rows


def _median_ms(fn, device) -> float:
    if device.type != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _host_us(fn, calls: int = 200) -> float:
    """Host microseconds a call (launch cost), on a warm path: the GPU queue absorbs the calls."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return host


def _graph_ms(fns) -> float:
    """Median milliseconds a call of one CUDA graph that calls fns[0], fns[1], ... in turn (each on its own copy
    of the weight, together larger than the L2 cache): device time, launch gaps of a graph only, none of the
    host's. None when the calls cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile, pick, allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    reps = max(1, 256 // len(fns))
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(fns)))
    del graph
    return statistics.median(times)


def gemv_rows(device, quick: bool, sweep: bool = False) -> list[dict]:
    """The 4-bit GEMV (NF4, double quant, bf16) at batch 1-8 against bitsandbytes' 4-bit inference matmul
    (`bnb.matmul_4bit`: its GEMV kernel at one row, dequantize + matmul above) and against fastplug's
    dequantize + matmul. `ms`: a CUDA graph of calls over enough copies of the weight to miss the L2 cache
    (device time); the note adds triton's do_bench (L2 flushed, launched from Python: the host shows where it is
    slower than the kernel) and the host microseconds a call. rel err against x @ W^T in fp32 (W unrounded).
    `sweep`: the word-wise loop's tiles of `_SWEEP`."""
    import bitsandbytes as bnb

    from ..kernels.quant import dequantize_4bit, dequantize_4bit_reference, gemv_4bit, gemv_config

    device = torch.device(device)
    shapes = (
        [(96, 64), (64, 96)]
        if quick
        else [(14336, 4096), (4096, 14336), (2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)]
    )
    batches = (1, 2) if quick else (1, 2, 4, 8)
    rows = []
    for out_f, in_f in shapes:
        torch.manual_seed(0)
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        copies = 1 if quick else max(2, min(64, -(-150 * 2**20 // (out_f * in_f // 2))))  # 150 MB of weights
        ps = [
            bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True).to(device)
            for _ in range(copies)
        ]
        p = ps[0]
        w32 = dequantize_4bit_reference(p, torch.float32)
        for m in batches:
            x = torch.randn(m, in_f, dtype=torch.bfloat16, device=device)
            ref = x.float() @ w32.t()
            shape = f"{m}x{in_f} @ [{out_f}x{in_f}]"

            def add(impl, call, note=""):
                """call(weight) -> output."""
                out = call(p)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row = {"op": "gemv_4bit", "shape": shape, "impl": impl, "rel err": err}
                row["ms"] = bench = _median_ms(lambda: call(p), device)
                if device.type == "cuda":
                    note = f"do_bench {1e3 * bench:.1f} us, host {_host_us(lambda: call(p)):.0f} us; " + note
                    try:
                        row["ms"] = _graph_ms([lambda q=q: call(q) for q in ps])
                    except Exception as error:  # a call that cannot be captured: ms is do_bench's
                        note = f"no graph ({type(error).__name__}: {str(error)[:80]}); " + note
                row["note"] = note
                rows.append(row)
                return row

            ref_row = add("bitsandbytes", lambda q: bnb.matmul_4bit(x, q.t(), quant_state=q.quant_state))
            add("dequant+matmul", lambda q: x @ dequantize_4bit(q, dtype=torch.bfloat16).t())
            cfg = gemv_config(m, out_f, in_f, p.quant_state.blocksize, device)
            fast = add("fastplug", lambda q: gemv_4bit(x, q), str(cfg))
            if ref_row.get("ms") and fast.get("ms"):
                fast["note"] = f"{ref_row['ms'] / fast['ms']:.2f}x bnb; " + fast["note"]
            if sweep:
                for over in _SWEEP:
                    try:
                        c = gemv_config(m, out_f, in_f, p.quant_state.blocksize, device, **over)
                    except ValueError as error:
                        rows.append({"op": "gemv_4bit", "shape": shape, "impl": "sweep", "note": str(error)})
                        continue
                    add("sweep", lambda q, c=c: gemv_4bit(x, q, c), str(c))
        p = ps = w32 = None  # free the copies before the next shape
    return rows


_SWEEP = [
    dict(block_n=bn, chunk=ch, num_warps=nw, lookup=lookup)
    for bn in (2, 4, 8, 16)
    for ch in (256, 512, 1024)
    for nw in (1, 2, 4, 8)
    for lookup in ("gather", "shfl")
    if 16 <= bn * ch // (32 * nw) <= 64
]


def main(argv=None) -> int:
    from .e2e import parse_options
    from .micro import qlora_rows

    parser = argparse.ArgumentParser(prog="python -m fastplug.bench.qlora")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-micro", action="store_true")
    parser.add_argument("--gemv", action="store_true", help="the GEMV rows at batch 1-8 (replaces the micro rows)")
    parser.add_argument("--gemv-sweep", action="store_true", help="--gemv, plus the GEMV's tile configurations")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b_4l", help="the end-to-end model")
    parser.add_argument("--impls", default=",".join(IMPLS[:3]), help=f"end-to-end rows, from {','.join(IMPLS)}")
    parser.add_argument("--steps", type=int, default=4, help="measured end-to-end steps (after 2 warm-up steps)")
    parser.add_argument("--profile", action="store_true", help="kernel table of one more step of each fastplug row")
    parser.add_argument(
        "--options",
        default="",
        metavar="NAME=VALUE,...",
        help="KernelOptions for the fastplug rows, e.g. stack_projections=false",
    )
    args = parser.parse_args(argv)
    options = parse_options(args.options, parser)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if any(i not in IMPLS for i in impls):
        parser.error(f"--impls: from {','.join(IMPLS)}; got {args.impls!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    gemv = args.gemv or args.gemv_sweep
    micro = None
    if gemv:
        micro = lambda: gemv_rows(device, args.quick, sweep=args.gemv_sweep)  # noqa: E731
    elif not args.no_micro:
        micro = lambda: qlora_rows(device, args.quick)  # noqa: E731
    parts = (
        micro,
        None
        if args.no_e2e
        else lambda: e2e_rows(device, args.quick, args.steps, args.shape, impls, args.profile, options),
    )
    for part in parts:
        if part is None:
            continue
        try:
            rows += part()
        except Exception as error:  # keep the rows measured so far
            rows.append({"op": "error", "note": f"{type(error).__name__}: {error}"[:300]})
        for r in rows:
            print({k: v for k, v in r.items()}, flush=True)
    columns = ("op", "shape", "impl", "ms", "tok/s", "peak MiB", "peak GiB", "rel err", "note")
    print(
        markdown_table(
            [
                {c: fmt(r.get(c)) if c not in ("op", "shape", "impl", "note") else r.get(c, "") for c in columns}
                for r in rows
            ],
            columns,
        )
    )
    return 1 if any(r["op"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
