"""The host's share of a patched LoRA training step, measured on a machine without a GPU: every Triton launch is
compiled for an H100 (sm_90) and skipped, so what is timed is the Python and dispatch work the step asks of the
host (fastplug's wrappers, autograd, Triton's launcher up to the driver call; torch ops run on CPU tensors).

The question it answers: did a change add host work to the step? The GPU's e2e wall time mixes the host's
speed, which differs between machines and runs, with ours. Run two trees in alternating fresh processes:

    python scripts/host_step_without_gpu.py --trees .before . --rounds 5

Each tree is put first on PYTHONPATH in its own process (so `.before` can be `git archive <commit>`). The model
is a bench e2e preset (`--model`, default llama: Llama-1B) with its full layer stack (count, layer types) at the
preset's tiny widths, LoRA r=16 on the preset's targets, fused AdamW as the Trainer's default, in fp32 (a CPU's
bf16 matmuls would swamp the host's work), since the host's work per step depends on the number of ops, not their
size or dtype. `--top N` prints the N functions with the most host time of one step (cProfile).

`--lengths 64-700` asks what a new batch length costs the host: each timed step takes two rows of a random length
in that range, the second right-padded (the collator's dynamic padding, its pads' labels ignored). The table then
gives the median host ms of the steps that compiled nothing and the Triton compiles the new lengths caused, by
kernel (a new specialisation: about a second each on a GPU host, the first time). The warm-up steps, one of them
padded, compile the kernels first (cached by Triton for later rounds). `--buckets` pads the rows on to bucket
lengths, as the default does on a GPU (there with the layer graphs, which a CPU cannot run).

Prints a table: median host ms per step per tree, Python function calls per step, Triton launches per step. The
calls and launches are exact; the ms are as noisy as the machine is busy (CPU matmuls run for real).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import time

from decode_ptx import kernels_take_cpu_tensors, stand_in_sm90_driver  # this script's folder is on sys.path


def _stand_in_h100() -> dict:
    """A driver that targets sm_90 and never launches; returns a counter of launches by kernel name."""
    from triton.runtime.jit import JITFunction

    stand_in_sm90_driver()
    run, launches = JITFunction.run, {}

    def compile_and_skip(self, *args, grid, warmup, **kwargs):
        launches[self.fn.__name__] = launches.get(self.fn.__name__, 0) + 1
        if kwargs.get("PRECISION") == "upcast":  # chosen for the interpreter by a CPU tensor; a GPU gets "tf32"
            kwargs["PRECISION"] = "tf32"
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_and_skip
    return launches


def _count_compiles() -> list:
    """A list of the kernels Triton compiles from now on, by name: JITFunction's in-memory cache misses
    (`_do_compile`, Triton 3.4 on), else calls of `triton.compiler.compile` ("?": no name at hand)."""
    import triton.compiler
    from triton.runtime.jit import JITFunction

    compiled = []
    owner, name = (JITFunction, "_do_compile") if hasattr(JITFunction, "_do_compile") else (triton.compiler, "compile")
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        fn = getattr(args[0], "fn", None) if args else None
        compiled.append(getattr(fn, "__name__", "?"))
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    return compiled


def measure(
    steps: int, model_name: str, layers: int | None, top: int = 0, lengths: str = "", buckets: bool = False
) -> dict:
    import cProfile
    import inspect
    import pstats

    launches = _stand_in_h100()
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    import fastplug
    import fastplug.kernels  # noqa: F401  (imports the kernel modules whose use_triton is replaced)
    from fastplug.bench.presets import MODELS

    kernels_take_cpu_tensors()
    torch.set_num_threads(1)  # CPU matmuls spinning on threads that other processes hold would swamp the host's work
    preset = MODELS[model_name]
    # the preset's tiny widths with its full layer stack (count, layer types, shared KV layers), in fp32
    stack = {
        k: v for k, v in preset["full"].items() if k in ("num_hidden_layers", "layer_types", "num_kv_shared_layers")
    }
    config = getattr(transformers, preset["config"])(**{**preset["tiny"], **stack, "use_cache": False})
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = (config.layer_types * layers)[:layers]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=preset["attn"]
    )
    if preset.get("init"):
        preset["init"](model)
    lora = LoraConfig(
        r=16, lora_alpha=16, target_modules=preset["lora"], target_parameters=preset.get("lora_parameters"),
        task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(model, lora)
    options = dict(freeze_gc=True, stack_projections=True)  # as the trainer adapters patch
    if buckets:
        options["bucket_lengths"] = True
    if "self_check" in inspect.signature(fastplug.KernelOptions).parameters:
        options["self_check"] = False  # its comparisons would read the skipped kernels' empty outputs
    fastplug.patch_model(model, **options)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rng = random.Random(0)

    def step(length: int = 64, pads: int = 0):
        ids = torch.randint(0, config.vocab_size, (2, length))
        mask, labels = torch.ones_like(ids), ids.clone()
        mask[1, length - pads :], labels[1, length - pads :] = 0, -100
        loss = model(input_ids=ids, attention_mask=mask if pads else None, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # compiles
    step(64, 8)  # and a padded batch's path
    launches.clear()
    compiles = _count_compiles()
    lo, hi = map(int, lengths.split("-")) if lengths else (64, 64)
    times, compiled = [], []
    for _ in range(steps):
        length = rng.randint(lo, hi)
        before, start = len(compiles), time.perf_counter()
        step(length, rng.randint(1, length // 2) if lengths else 0)
        (compiled if len(compiles) > before else times).append(time.perf_counter() - start)
    launched = sum(launches.values()) / steps
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    calls = pstats.Stats(profiler).total_calls
    if top:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(top)
    result = {
        "host_ms": statistics.median(times) * 1e3 if times else float("nan"),
        "calls": calls,
        "launches": launched,
    }
    if lengths:
        by_kernel = sorted(collections.Counter(compiles).items())
        result.update(compiles=", ".join(f"{k} {n}" for k, n in by_kernel) or "none", compile_steps=len(compiled))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=["."], help="source trees to compare, each put on PYTHONPATH")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per tree, alternating")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="llama", help="a bench e2e preset (llama, gemma4, gemma4_moe, ...)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's full count)")
    parser.add_argument("--top", type=int, default=0, help="print the N functions with the most host time")
    parser.add_argument("--lengths", default="", help="MIN-MAX: random batch lengths, right-padded (see above)")
    parser.add_argument("--buckets", action="store_true", help="rows padded on to bucket lengths (see above)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.steps, args.model, args.layers, args.top, args.lengths, args.buckets)))
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the kernels are compiled for the GPU, not interpreted")
    results = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            command = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--model", args.model]
            command += ["--layers", str(args.layers)] if args.layers else []
            command += ["--top", str(args.top)] if args.top and round_ == 0 else []
            command += ["--lengths", args.lengths] if args.lengths else []
            command += ["--buckets"] if args.buckets else []
            out = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/")
            if out.returncode:
                sys.exit(f"{tree}: worker failed\n{out.stderr[-3000:]}")
            if args.top and round_ == 0:
                print(out.stderr[-20000:])
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[tree].append(result)
            print(f"round {round_}  {tree:<12} host {result['host_ms']:.1f} ms", flush=True)
    varlen = " | steps that compiled | Triton compiles (kernel, count)" if args.lengths else ""
    header = "host ms per step (median of rounds; each round's) | Python calls per step | Triton launches"
    print(f"\n| tree | {header}{varlen} |")
    print("|---|---|---|---|" + ("---|---|" if args.lengths else ""))
    for tree, rows in results.items():
        each = " ".join(f"{r['host_ms']:.1f}" for r in rows)
        median = statistics.median(r["host_ms"] for r in rows)
        extra = f" | {rows[0]['compile_steps']} of {args.steps} | {rows[0]['compiles']}" if args.lengths else ""
        print(f"| {tree} | {median:.1f} ({each}) | {rows[-1]['calls']} | {rows[-1]['launches']:.0f}{extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
