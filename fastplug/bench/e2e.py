"""`python -m fastplug.bench e2e`: LoRA fine-tuning steps of random-init models shaped as in
shared/BASELINES.md, with plain transformers, torch.compile, Liger-Kernel and fastplug.

Every (model, implementation) pair trains in a fresh worker process: the same seed gives the same weights,
LoRA init and data; nothing one implementation patches (Liger patches module globals) or leaves in the
allocator or compile caches reaches the next one; and a hard time limit can end a stuck run. The workers
report tokens/s (median step after warm-up, synchronized), peak memory (max_memory_allocated, weights
included) and the first losses, which must agree across implementations.

`--offload-max-seq` instead finds, at batch 1, the longest sequence that trains for plain transformers,
fastplug with checkpointing, and fastplug with checkpointing offloaded to CPU memory.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from ._report import fmt, grouped_bar_plot, markdown_table, short_error, write_csv
from .presets import ALL_LINEAR_LORA, MODELS  # noqa: F401 (scripts/fp8_gpu.py reads e2e.ALL_LINEAR_LORA)

# fastplug: the defaults (CUDA graphs within their memory cap); _eager: cuda_graphs=False; _auto:
# gradient_checkpointing="auto"; _compile: patched, then torch.compile (what TrainingArguments(torch_compile=True)
# does); _graphs: cuda_graphs=True (every shape up to the limit, no memory cap)
IMPLS = (
    "transformers",
    "transformers_fla",
    "compile",
    "liger",
    "fastplug",
    "fastplug_eager",
    "fastplug_auto",
    "fastplug_compile",
    "fastplug_auto_compile",
    "fastplug_graphs",
    "fastplug_auto_graphs",
    "fastplug_graphs_compile",
    "fastplug_auto_graphs_compile",
    "fastplug_fla",
)
DEFAULT_IMPLS = ("transformers", "compile", "liger", "fastplug")
# the longer MoE rows (LoRA on experts, Mixtral widths), Gemma 4 and gpt-oss run when asked for by name
DEFAULT_MODELS = ("llama", "qwen3_moe", "gemma2")
TINY_BATCH, TINY_SEQ = 2, 32
COLUMNS = (
    "model",
    "batch x seq",
    "impl",
    "tok/s",
    "vs transformers",
    "peak GiB",
    "step ms",
    "device ms",
    "wall/device",
    "first step s",
    "losses (steps 1-3)",
    "max loss diff",
    "note",
)
MAX_SEQ_COLUMNS = (
    "model",
    "impl",
    "longest seq that trains",
    "peak GiB there",
    "tok/s there",
    "first failure",
    "tried",
)
# Relative loss difference from plain transformers above which the row is flagged (bf16 rounding is ~1e-3).
LOSS_TOLERANCE = 1e-2


# --- the worker: one model, one implementation, in its own process --------------------------------


def build_model(name: str, tiny: bool, device, seed: int, adapter_dtype: str = "fp32"):
    """Random-init bf16 model with LoRA r=16 on its preset's targets and non-reentrant checkpointing.

    adapter_dtype "fp32" is what peft does by default (it upcasts adapters of a bf16 model, the set-up of
    shared/BASELINES.md); "bf16" keeps them in the weights' dtype."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fastplug.patch import checkpointing

    preset = MODELS[name]
    config = getattr(transformers, preset["config"])(**preset["tiny" if tiny else "full"])
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=preset["attn"])
    if preset.get("init"):
        preset["init"](model)
    checkpointing.enable_native(model)
    lora = LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=preset["lora"],
        task_type="CAUSAL_LM",
        target_parameters=preset.get("lora_parameters"),
    )
    torch.manual_seed(seed + 1)
    return get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype == "fp32")


def apply_impl(model, impl: str, checkpointing, options: dict | None = None):
    """Returns (callable model, note); options: KernelOptions overrides for the fastplug impls."""
    import torch

    if impl in ("transformers", "transformers_fla"):
        return model, ""
    if impl == "compile":
        return torch.compile(model), ""
    if impl == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model.get_base_model())
        return model, ""
    if impl in IMPLS and impl.startswith("fastplug"):
        import fastplug

        mode = "auto" if impl.startswith("fastplug_auto") else checkpointing
        # freeze_gc and stack_projections as the trainer adapters set them for their run
        handle = fastplug.patch_model(
            model,
            **{
                "gradient_checkpointing": mode,
                "freeze_gc": True,
                "stack_projections": True,
                "cuda_graphs": True if "_graphs" in impl else False if impl.endswith("_eager") else None,
                **(options or {}),
            },
        )
        print(handle.summary(), flush=True)
        note = "patched " + ", ".join(f"{k} {v}" for k, v in sorted(handle.counts.items()))
        note += f"; {len(handle.skipped)} skipped" if handle.skipped else ""
        return (torch.compile(model) if impl.endswith("_compile") else model), note
    raise ValueError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")


def token_batches(vocab: int, batch: int, seq: int, count: int, seed: int, device):
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    return [torch.randint(0, vocab, (batch, seq), generator=gen).to(device) for _ in range(count)]


def sync_device(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class _GcClock:
    """Time spent in Python's garbage collector (gc.callbacks), which a sampling profiler charges to whatever
    line happened to allocate: a full collection over the objects of torch, transformers and a model takes
    0.3 s on an H100 host."""

    def __init__(self):
        self.seconds, self.collections, self._start = 0.0, collections.Counter(), None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def close(self):
        gc.callbacks.remove(self._callback)

    def report(self, steps: int) -> str:
        per_gen = ", ".join(f"gen{g} x{n}" for g, n in sorted(self.collections.items())) or "no collections"
        return f"{self.seconds * 1e3 / max(steps, 1):.1f} ms per step ({per_gen})"


def train_steps(model, params, batches, steps: int, device, deadline: float, host_times: list | None = None):
    """The manual loop: forward with labels, backward, fused AdamW step, zero_grad. Returns (step seconds, losses).
    host_times, if given, receives each step's host seconds before its final synchronisation."""
    import torch

    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the HF Trainer's and TRL's default optimizer
    times, losses = [], []
    host_times = [] if host_times is None else host_times
    gc_clock = None  # from the second step on: the first one compiles kernels, whose garbage says nothing
    for step in range(steps):
        ids = batches[step % len(batches)]
        sync_device(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        host_times.append(time.perf_counter() - start)  # Python's share, when nothing in the step syncs
        sync_device(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        del loss
        if gc_clock is None:
            gc_clock = _GcClock()
        if time.perf_counter() > deadline:  # keep what was measured rather than lose it to the hard limit
            break
    collector = "-"
    if gc_clock is not None:
        gc_clock.close()
        collector = gc_clock.report(len(times) - 1)
    print(
        f"host ms per step (before the sync): {[round(t * 1e3, 1) for t in host_times]}; "
        f"Python's garbage collector after the first step: {collector}",
        flush=True,
    )
    return times, losses


def run_throughput(spec: dict) -> dict:
    import statistics

    import torch

    from ._fla import select

    device = torch.device(spec["device"])
    batch, seq = spec["batch"], spec["seq"]
    result = {}
    fla = select(spec["impl"].endswith("_fla"))  # before transformers imports the model's modeling module
    model = build_model(spec["model"], spec["tiny"], device, spec["seed"], spec["adapter_dtype"])
    runner, result["note"] = apply_impl(model, spec["impl"], True, spec.get("options"))
    if spec["impl"].endswith("_fla"):
        result["note"] = "; ".join(n for n in (fla, result["note"]) if n)
    if getattr(model.config, "_experts_implementation", None):  # MoE models: after patching, which one runs
        result["experts"] = model.config._experts_implementation
    params = [p for p in model.parameters() if p.requires_grad]
    batches = token_batches(model.config.vocab_size, batch, seq, 4, spec["seed"], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = train_steps(runner, params, batches, spec["warmup"] + spec["steps"], device, worker_deadline(spec))
    measured = times[spec["warmup"] :]
    if not measured:
        # the time limit fell inside the warm-up (a self-check, a first step's compiles and MoE autotuning): two
        # more steps past a fresh optimizer's first, so the row gives the steady pace, not a first step's (which read
        # as 300x slower)
        measured = train_steps(runner, params, batches, 3, device, float("inf"))[0][1:]
    if spec.get("profile"):
        _print_profile(runner, params, batches, device)
    if device.type == "cuda":
        result["device_ms"] = device_ms_per_step(runner, params, batches, device)
        if spec["impl"].startswith("fastplug_auto") or "_graphs" in spec["impl"]:
            from fastplug.patch.engine import active_handle

            print(active_handle(model).summary(), flush=True)
    result.update(
        step_ms=statistics.median(measured) * 1e3,
        tokens_per_s=batch * seq / statistics.median(measured),
        first_step_s=times[0],
        losses=losses[:3],
        measured_steps=len(measured),
        all_step_ms=[round(t * 1e3, 1) for t in times],
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    )
    return result


def device_ms_per_step(model, params, batches, device, steps: int = 2) -> float:
    """GPU kernel time per step (torch.profiler's sum of CUDA kernel time over `steps` more steps): the step
    time if the host kept up. Wall over this ratio says how far the host sets the pace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_steps(model, params, batches, steps, device, float("inf"))
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return kernel_us / 1e3 / steps


def _print_profile(model, params, batches, device, rows: int = 25):
    """Two more steps: where the GPU time goes, by kernel (torch.profiler), and Python's (cProfile)."""
    import collections
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_steps(model, params, batches, 1, device, float("inf"))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60), flush=True)
    # Host syncs inside a step stall the GPU behind Python: list the ones this step makes.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_steps(model, params, batches, 1, device, float("inf"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"host syncs in one step: {dict(syncs) or 'none'}", flush=True)
    host = cProfile.Profile()
    host.runcall(train_steps, model, params, batches, 1, device, float("inf"))
    stats = pstats.Stats(host)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats("fastplug|transformers|peft", rows)


def run_max_seq(spec: dict) -> dict:
    """Batch 1: double the sequence until a step fails (OOM), then try once halfway back (e.g. 49152 after
    65536 failed), within the time budget. Returns the longest length that trained and what failed."""
    import gc

    import torch

    device = torch.device(spec["device"])
    impl, checkpointing = spec["impl"], True
    if impl == "fastplug_offload":
        impl, checkpointing = "fastplug", "offload"
    model = build_model(spec["model"], spec["tiny"], device, spec["seed"])
    runner, _ = apply_impl(model, impl, checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    deadline = worker_deadline(spec)
    result = {"tried": [], "longest": None, "failure": None}
    seq, failed_at, last_step_s = spec["start_seq"], None, 0.0
    # A step at twice the length costs up to 4x (attention is quadratic), and it runs 2 steps: stop before
    # a length that cannot finish in time, so the worker reports what it measured instead of timing out.
    while seq <= spec["max_seq"] and time.perf_counter() + 8 * last_step_s < deadline:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            batches = token_batches(model.config.vocab_size, 1, seq, 1, spec["seed"], device)
            times, _ = train_steps(runner, params, batches, 2, device, deadline)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            last_step_s = times[-1]
            result["longest"] = {"seq": seq, "peak_gib": peak, "tokens_per_s": seq / times[-1]}
            result["tried"].append(f"{seq} ok")
            print(f"  seq {seq}: ok, peak {fmt(peak)} GiB, {seq / times[-1]:.0f} tok/s", flush=True)
        except Exception as exc:  # OOM (or anything else) at this length
            failed_at = failed_at or seq
            result["failure"] = result["failure"] or f"{seq}: {short_error(exc)}"
            result["tried"].append(f"{seq} {short_error(exc, 40)}")
            print(f"  seq {seq}: {short_error(exc)}", flush=True)
        finally:
            batches = None
            for p in params:  # a step that failed half-way leaves grads behind
                p.grad = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if failed_at is None:
            seq *= 2
            continue
        longest = result["longest"]["seq"] if result["longest"] else 0
        halfway = (longest + failed_at) // 2 // 1024 * 1024
        if seq == failed_at and longest < halfway < failed_at:
            seq = halfway
            continue
        break
    return result


def worker_deadline(spec) -> float:
    """The parent's wall-clock deadline for this worker as a perf_counter time: stop measuring by then."""
    return time.perf_counter() + (spec["deadline"] - time.time())


def worker_main(spec_json: str, result_path: str) -> int:
    spec = json.loads(spec_json)
    print(f"\n== {spec['model']} / {spec['impl']} ==", flush=True)
    try:
        result = run_max_seq(spec) if spec["mode"] == "max_seq" else run_throughput(spec)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"error": short_error(exc)}
    if "all_step_ms" in result:
        print(f"step ms: {result['all_step_ms']}", flush=True)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# --- the parent: one worker per (model, implementation), then the table ---------------------------


def run_worker(spec: dict, time_limit: float) -> dict:
    """Runs one worker process; its output streams through. A crash or timeout becomes an error entry."""
    # The worker stops taking steps at 85% of the limit and reports; the hard limit is for a stuck worker.
    spec = dict(spec, deadline=time.time() + 0.85 * time_limit)
    fd, result_path = tempfile.mkstemp(prefix="fastplug_e2e_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "fastplug.bench", "_worker", json.dumps(spec), result_path]
    try:
        proc = subprocess.run(cmd, timeout=time_limit)
        with open(result_path) as f:
            text = f.read()
        if text:
            return json.loads(text)
        return {"error": f"worker exited with code {proc.returncode} and no result"}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {time_limit:.0f} s"}
    finally:
        os.unlink(result_path)


def parse_options(text: str, parser) -> dict:
    """'a=true,b=0.8' -> {'a': True, 'b': 0.8}; names checked against KernelOptions."""
    from fastplug.options import KernelOptions

    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in KernelOptions.field_names():
            parser.error(f"--options: unknown option {name!r}; valid: {', '.join(KernelOptions.field_names())}")
        lowered = value.strip().lower()
        if lowered in ("true", "false", "none"):
            options[name] = {"true": True, "false": False, "none": None}[lowered]
        else:
            try:
                options[name] = float(value)
            except ValueError:
                options[name] = value.strip()
    return options


def parse_list(text: str, valid, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad:
        raise SystemExit(f"error: {what}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
    return items


def throughput_rows(args, models, impls, device, save) -> list[dict]:
    rows = []
    for model in models:
        base_losses, base_tps = None, None
        preset = MODELS[model]
        batch = args.batch or (TINY_BATCH if args.tiny else preset["batch"])
        seq = args.seq or (TINY_SEQ if args.tiny else preset["seq"])
        for impl in impls:
            spec = dict(
                mode="throughput",
                model=model,
                impl=impl,
                tiny=args.tiny,
                device=device,
                seed=args.seed,
                batch=batch,
                seq=seq,
                steps=args.steps,
                warmup=args.warmup,
                adapter_dtype=args.adapter_dtype,
                profile=args.profile,
                options=args.options if impl.startswith("fastplug") else None,
            )
            res = run_worker(spec, args.time_limit)
            label = impl + (f" ({args.options_text})" if spec["options"] else "")
            row = {"model": model + (" (tiny)" if args.tiny else ""), "impl": label, "batch x seq": f"{batch}x{seq}"}
            rows.append(row)
            if "error" in res:
                row["note"] = res["error"]
                save(rows)
                continue
            device_ms = res.get("device_ms")
            row.update(
                {
                    "tok/s": res["tokens_per_s"],
                    "peak GiB": res["peak_gib"],
                    "step ms": res["step_ms"],
                    "device ms": device_ms,
                    "wall/device": res["step_ms"] / device_ms if device_ms else None,
                    "first step s": res["first_step_s"],
                    "losses": res["losses"],
                    "losses (steps 1-3)": " ".join(f"{x:.4f}" for x in res["losses"]),
                }
            )
            notes = [res.get("note") or ""]
            if res.get("experts"):
                notes.append(f"experts: {res['experts']}")
            if res["measured_steps"] < args.steps:
                notes.append(f"only {res['measured_steps']} measured steps (time limit)")
            if impl == "transformers":
                base_losses, base_tps = res["losses"], res["tokens_per_s"]
            if base_tps:
                row["vs transformers"] = res["tokens_per_s"] / base_tps
            if base_losses:
                n = min(len(base_losses), len(res["losses"]))
                diff = max(
                    (abs(a - b) / max(abs(b), 1e-6) for a, b in zip(res["losses"][:n], base_losses[:n])), default=0.0
                )
                row["max loss diff"] = diff
                if not diff <= LOSS_TOLERANCE:
                    notes.append(f"LOSSES DISAGREE (rel diff {diff:.2e})")
            row["note"] = "; ".join(n for n in notes if n)
            save(rows)
    return rows


def max_seq_rows(args, models, device, save) -> list[dict]:
    rows = []
    for model in models:
        for impl in ("transformers", "fastplug", "fastplug_offload"):
            spec = dict(
                mode="max_seq",
                model=model,
                impl=impl,
                tiny=args.tiny,
                device=device,
                seed=args.seed,
                start_seq=args.start_seq,
                max_seq=args.max_seq,
            )
            res = run_worker(spec, args.time_limit)
            label = {"fastplug": "fastplug (checkpointing)", "fastplug_offload": "fastplug (offload)"}.get(impl, impl)
            row = {"model": model, "impl": label}
            rows.append(row)
            if "error" in res:
                row["first failure"] = res["error"]
                save(rows)
                continue
            longest = res["longest"] or {}
            row.update(
                {
                    "longest seq that trains": longest.get("seq"),
                    "peak GiB there": longest.get("peak_gib"),
                    "tok/s there": longest.get("tokens_per_s"),
                    "first failure": res["failure"] or "-",
                    "tried": ", ".join(res["tried"]),
                }
            )
            save(rows)
    return rows


def print_table(rows, columns):
    text_columns = {"model", "impl", "batch x seq", "losses (steps 1-3)", "note", "first failure", "tried"}
    print(
        markdown_table(
            [{c: r.get(c, "") if c in text_columns else fmt(r.get(c)) for c in columns} for r in rows], columns
        )
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench e2e", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated, from {','.join(MODELS)} (default {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (compile happens here)")
    parser.add_argument("--batch", type=int, default=None, help="override the preset batch size")
    parser.add_argument("--seq", type=int, default=None, help="override the preset sequence length")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per model and impl (hard)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same families (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--adapter-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="LoRA weights' dtype: fp32 is peft's default for a bf16 model",
    )
    parser.add_argument("--profile", action="store_true", help="print a kernel-time table of one more step")
    parser.add_argument(
        "--options",
        default="",
        metavar="NAME=VALUE,...",
        help="KernelOptions for the fastplug impls, e.g. stack_projections=false,attention=false",
    )
    parser.add_argument("--out", default="bench_out", help="folder for the CSV and PNG")
    parser.add_argument(
        "--offload-max-seq",
        action="store_true",
        help="longest sequence at batch 1: transformers vs fastplug with and without offload",
    )
    parser.add_argument("--start-seq", type=int, default=8192, help="--offload-max-seq: first length tried")
    parser.add_argument("--max-seq", type=int, default=524288, help="--offload-max-seq: longest length tried")
    args = parser.parse_args(argv)

    models = parse_list(args.models, MODELS, "--models")
    impls = parse_list(args.impls, IMPLS, "--impls")
    args.options_text, args.options = args.options, parse_options(args.options, parser)
    device = default_device()
    if device == "cpu" and not args.tiny:
        parser.error("without a GPU only --tiny runs")
    print(f"e2e bench on {device}: models {', '.join(models)}; LoRA r=16, checkpointing, AdamW, bf16", flush=True)

    # The CSV is rewritten after every worker, so a run cut short still leaves what it measured.
    if args.offload_max_seq:
        csv_path = os.path.join(args.out, "e2e_max_seq.csv")
        rows = max_seq_rows(args, models, device, lambda rows: write_csv(csv_path, rows, MAX_SEQ_COLUMNS))
        print(f"\ncsv: {csv_path}\n")
        print_table(rows, MAX_SEQ_COLUMNS)
        return 0

    csv_path = os.path.join(args.out, "e2e.csv")
    rows = throughput_rows(args, models, impls, device, lambda rows: write_csv(csv_path, rows, COLUMNS))
    groups = list(dict.fromkeys(r["model"] for r in rows))
    plot_msg = grouped_bar_plot(
        os.path.join(args.out, "e2e.png"),
        groups,
        impls,
        [
            ("LoRA training throughput", "tokens/s", {(r["model"], r["impl"]): r.get("tok/s") for r in rows}),
            ("peak memory (weights included)", "GiB", {(r["model"], r["impl"]): r.get("peak GiB") for r in rows}),
        ],
    )
    print(f"\ncsv: {csv_path}\n{plot_msg}\n")
    print_table(rows, COLUMNS)
    bad = [r for r in rows if r["impl"] == "fastplug" and ("tok/s" not in r or "DISAGREE" in r.get("note", ""))]
    return 1 if bad else 0


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
