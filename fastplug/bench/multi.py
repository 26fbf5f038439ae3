"""`python -m fastplug.bench multi --nproc 2`: LoRA training on several GPUs of one host, plain transformers
against fastplug, under DDP and FSDP2, beside the same training on one GPU.

Per GPU: tokens/s (median step after warm-up, the slowest rank's), the host's share of that step (the median
step's host time before the loop synchronises at its end, the slowest rank's: where it nears the step's wall, the
host sets the pace) and peak memory (max_memory_allocated, the largest rank's). Models, per-GPU batch and the
step are e2e's (`fastplug.bench.e2e`: random-init bf16 weights, peft's fp32 LoRA r=16 on every linear layer,
non-reentrant checkpointing, fused AdamW): Llama-1B shape (`llama`) and Llama-8B widths with 4 layers
(`llama8b_4l`), 4x2048 tokens per GPU, each rank on its own data. DDP is torch's DistributedDataParallel; FSDP2
is `fully_shard` per decoder layer, untied LM head and input embedding, then the model
(`fastplug.integrations.fsdp.shard_model`), applied after patching.

Each parallel mode is one torchrun launch whose ranks build a fresh model for every (model, impl) in turn;
fastplug's patches are per instance, so nothing of one run reaches the next. `--tiny` runs tiny configs on CPU
with gloo (a smoke run of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..patch.engine import active_handle
from ._report import fmt, markdown_table, short_error, write_csv
from .e2e import TINY_BATCH, TINY_SEQ, apply_impl, build_model, token_batches, train_steps
from .presets import MODELS

DEFAULT_MODELS = ("llama", "llama8b_4l")
IMPLS = ("transformers", "fastplug")
PARALLEL = ("single", "ddp", "fsdp2")  # single: one GPU, the baseline
COLUMNS = (
    "model",
    "batch x seq per GPU",
    "parallel",
    "GPUs",
    "impl",
    "tok/s per GPU",
    "vs transformers",
    "vs 1 GPU",
    "peak GiB per GPU",
    "step ms",
    "host ms",
    "losses (rank 0, steps 1-3)",
    "note",
)


# --- the worker: every rank of one launch -----------------------------------------------------------


def _run_one(spec: dict, name: str, impl: str, rank: int, world: int, device) -> dict:
    import torch
    import torch.distributed as dist

    tiny = spec["tiny"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(name, tiny, device, spec["seed"])
    runner, note = apply_impl(model, impl, True)  # patched before wrapping
    if spec["parallel"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(runner, device_ids=[device.index] if device.type == "cuda" else None)
    elif spec["parallel"] == "fsdp2":
        from ..integrations.fsdp import shard_model

        shard_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    # each rank its own data, as a sampler deals it out
    batches = token_batches(model.config.vocab_size, spec["batch"], spec["seq"], 4, spec["seed"] + rank, device)
    deadline = time.perf_counter() + (spec["deadline"] - time.time())
    host_times = []  # each step's host time before its final synchronisation: the host's share of the step
    times, losses = train_steps(runner, params, batches, spec["warmup"] + spec["steps"], device, deadline, host_times)
    step = statistics.median(times[spec["warmup"] :] or times[-1:])
    host = statistics.median(host_times[spec["warmup"] :] or host_times[-1:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    if world > 1:  # the slowest rank sets the pace; memory: the fullest GPU
        stats = torch.tensor([step, host, peak], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        step, host, peak = stats.tolist()
    handle = active_handle(model)
    graphs = handle.graphs if handle is not None else None
    if graphs is not None:  # rank 0's layer forwards by path: whether the step replayed under DDP's or FSDP2's hooks
        note = "; ".join(
            filter(None, [note, "layer forwards: " + ", ".join(f"{why} {n}" for why, n in graphs.eager.items())])
        )
    if handle is not None:  # before the next row: a patch that holds the collector frozen keeps the model alive
        handle.restore()
    del runner, model, params, batches, handle
    return {
        "model": name,
        "impl": impl,
        "step_s": step,
        "host_s": host,
        "tokens_per_s": spec["batch"] * spec["seq"] / step,
        "peak_gib": peak if device.type == "cuda" else None,
        "losses": losses[:3],
        "note": note,
        "measured_steps": max(len(times) - spec["warmup"], 0),
    }


def worker_main(spec_json: str, result_path: str) -> int:
    import gc
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    spec = json.loads(spec_json)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if spec["device"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=300))

    def say(text):  # the parent shows rank 0's progress lines; everything else stays in the launch's log
        if rank == 0:
            print(f"multi: {text}", flush=True)

    results = []
    for name in spec["models"]:
        for impl in spec["impls"]:
            say(f"{spec['parallel']} x{world} {name} / {impl}")
            try:
                res = _run_one(spec, name, impl, rank, world, device)
                say(
                    f"{name} / {impl}: {res['tokens_per_s']:.0f} tok/s per GPU, peak {fmt(res['peak_gib'])} GiB "
                    f"per GPU, step {res['step_s'] * 1e3:.0f} ms, losses {[round(x, 4) for x in res['losses']]}"
                )
            except Exception as exc:  # one failed row (an OOM, ...) must not cost the others
                import traceback

                traceback.print_exc()
                res = {"model": name, "impl": impl, "error": short_error(exc)}
                say(f"{name} / {impl}: {res['error']}")
            results.append(res)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)
    if world > 1:
        dist.destroy_process_group()
    return 0


# --- the parent: one launch per parallel mode, then the table -------------------------------------


def _stop(proc, stopped: list) -> None:
    stopped.append(True)
    proc.terminate()  # torchrun passes it on to its workers; a kill would leave them on the GPUs
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_launch(spec: dict, nproc: int, time_limit: float, log_path: str) -> list[dict]:
    """One torchrun launch of `nproc` ranks; their output goes to `log_path`, rank 0's "multi:" lines through.
    The ranks stop measuring at 85% of `time_limit` and report; at the limit a stuck launch is stopped."""
    import threading

    spec = dict(spec, deadline=time.time() + 0.85 * time_limit)
    fd, result_path = tempfile.mkstemp(prefix="fastplug_multi_", suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "fastplug.bench",
        "_multi_worker",
        json.dumps(spec),
        result_path,
    ]
    stopped: list = []
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            watchdog = threading.Timer(time_limit, _stop, (proc, stopped))
            watchdog.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    if line.startswith("multi:"):
                        print(f"  {line.rstrip()}", flush=True)
                proc.wait()
            finally:
                watchdog.cancel()
        with open(result_path) as f:
            text = f.read()
        if text:
            return json.loads(text)
        why = f"timed out after {time_limit:.0f} s" if stopped else f"exited with code {proc.returncode}"
        return [{"error": f"launch {why} and left no result (log: {log_path})"}]
    finally:
        os.unlink(result_path)


def rows_for(results: dict, models, impls, nproc: int, batch: int, seq: int, tiny: bool) -> list[dict]:
    """Table rows with the ratios: vs transformers in the same mode, vs the same impl on one GPU."""
    by_key = {(mode, r.get("model"), r.get("impl")): r for mode, rs in results.items() for r in rs}
    rows = []
    for name in models:
        for mode in results:
            for impl in impls:
                res = by_key.get((mode, name, impl))
                if res is None:
                    err = next((r["error"] for r in results[mode] if "model" not in r), "not run")
                    res = {"error": err}
                row = {
                    "model": name + (" (tiny)" if tiny else ""),
                    "batch x seq per GPU": f"{batch}x{seq}",
                    "parallel": mode,
                    "GPUs": 1 if mode == "single" else nproc,
                    "impl": impl,
                }
                rows.append(row)
                if "error" in res:
                    row["note"] = res["error"]
                    continue
                row.update(
                    {
                        "tok/s per GPU": res["tokens_per_s"],
                        "peak GiB per GPU": res["peak_gib"],
                        "step ms": res["step_s"] * 1e3,
                        "host ms": res["host_s"] * 1e3,
                        "losses (rank 0, steps 1-3)": " ".join(f"{x:.4f}" for x in res["losses"]),
                        "note": res.get("note", ""),
                    }
                )
                base = by_key.get((mode, name, "transformers"), {})
                if "tokens_per_s" in base:
                    row["vs transformers"] = res["tokens_per_s"] / base["tokens_per_s"]
                single = by_key.get(("single", name, impl), {})
                if mode != "single" and "tokens_per_s" in single:
                    row["vs 1 GPU"] = res["tokens_per_s"] / single["tokens_per_s"]
    return rows


def targets(rows: list[dict]) -> list[str]:
    """The multi-GPU targets, one line each: DDP per-GPU throughput >= 90% of one GPU (fastplug); fastplug's
    speedup over transformers within 10% of one GPU's under DDP and FSDP2; FSDP2's peak below DDP's."""
    get = {(r["model"], r["parallel"], r["impl"]): r for r in rows}
    lines = []
    for name in dict.fromkeys(r["model"] for r in rows):
        fast = {mode: get.get((name, mode, "fastplug"), {}) for mode in PARALLEL}
        checks = []
        if "vs 1 GPU" in fast["ddp"]:
            checks.append(("DDP per GPU >= 0.90 of 1 GPU", fast["ddp"]["vs 1 GPU"], fast["ddp"]["vs 1 GPU"] >= 0.9))
        one = fast["single"].get("vs transformers")
        for mode in ("ddp", "fsdp2"):
            speedup = fast[mode].get("vs transformers")
            if one and speedup:
                ratio = speedup / one
                checks.append((f"{mode} speedup {speedup:.2f}x vs 1 GPU's {one:.2f}x (>= 0.90)", ratio, ratio >= 0.9))
        ddp_peak, fsdp_peak = fast["ddp"].get("peak GiB per GPU"), fast["fsdp2"].get("peak GiB per GPU")
        if ddp_peak and fsdp_peak:
            checks.append(
                (f"FSDP2 peak {fsdp_peak:.2f} GiB < DDP {ddp_peak:.2f} GiB", fsdp_peak / ddp_peak, fsdp_peak < ddp_peak)
            )
        for text, value, ok in checks:
            lines.append(f"{'met ' if ok else 'MISSED'}  {name}: {text} [{value:.3f}]")
        if not checks:
            lines.append(f"-       {name}: no complete set of rows to check the targets")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench multi", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="GPUs (processes) for DDP and FSDP2")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    parser.add_argument("--parallel", default=",".join(PARALLEL), help=f"comma-separated, from {','.join(PARALLEL)}")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="per GPU (default 4, --tiny 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (--tiny 32)")
    parser.add_argument("--time-limit", type=float, default=150.0, help="seconds per launch (hard)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU with gloo (smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out", help="folder for the CSV and the launches' logs")
    args = parser.parse_args(argv)

    def parse(text, valid, what):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in valid]
        if bad:
            parser.error(f"{what}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
        return items

    models = parse(args.models, MODELS, "--models")
    impls = parse(args.impls, IMPLS, "--impls")
    modes = parse(args.parallel, PARALLEL, "--parallel")
    import torch

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and torch.cuda.device_count() < args.nproc:
        parser.error(f"--nproc {args.nproc} needs as many GPUs; found {torch.cuda.device_count()} (--tiny runs on CPU)")
    batch = args.batch or (TINY_BATCH if args.tiny else MODELS["llama"]["batch"])
    seq = args.seq or (TINY_SEQ if args.tiny else MODELS["llama"]["seq"])
    os.makedirs(args.out, exist_ok=True)
    print(
        f"multi bench on {device}: {', '.join(modes)} with {args.nproc} processes; models {', '.join(models)}; "
        f"{batch}x{seq} per GPU, LoRA r=16, checkpointing, fused AdamW, bf16",
        flush=True,
    )
    spec = dict(
        models=models,
        impls=impls,
        tiny=args.tiny,
        device=device,
        seed=args.seed,
        batch=batch,
        seq=seq,
        steps=args.steps,
        warmup=args.warmup,
    )
    results = {}
    for mode in modes:
        start = time.time()
        log_path = os.path.join(args.out, f"multi_{mode}.log")
        print(f"launch: {mode} ({'1 process' if mode == 'single' else f'{args.nproc} processes'})", flush=True)
        results[mode] = run_launch(
            dict(spec, parallel=mode), 1 if mode == "single" else args.nproc, args.time_limit, log_path
        )
        print(f"launch: {mode} done in {time.time() - start:.0f} s (log: {log_path})", flush=True)
    rows = rows_for(results, models, impls, args.nproc, batch, seq, args.tiny)
    csv_path = os.path.join(args.out, "multi.csv")
    write_csv(csv_path, rows, COLUMNS)
    text_columns = {"model", "batch x seq per GPU", "parallel", "GPUs", "impl", "losses (rank 0, steps 1-3)", "note"}
    print(f"\ncsv: {csv_path}\ntargets (issue 17):")
    for line in targets(rows):
        print(f"  {line}")
    print()
    print(
        markdown_table(
            [{c: r.get(c, "") if c in text_columns else fmt(r.get(c)) for c in COLUMNS} for r in rows], COLUMNS
        )
    )
    failed = [r for r in rows if "tok/s per GPU" not in r]
    return 1 if failed else 0
