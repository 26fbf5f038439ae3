"""Where the host time of a repeated HF Trainer step goes, by phase: `bench varlen`'s Trainer run, with each
phase of `Trainer._inner_training_loop` timed on the host (perf_counter, no added synchronisation).

    python scripts/trainer_step_phases.py --model gemma2 --run trainer_fastkernels

The plain Trainer synchronises once a step, right after `training_step` returns (`logging_nan_inf_filter`, on by
default, tests the loss with a host `bool()`; FastKernels runs that filter on the device instead): the GPU then
idles while the host runs the rest of the step (the gradient clipping, the optimizer, zero_grad, the FLOP count,
the next batch, `model.train()`, the loss path's batch preparation), unless the queued kernels outlast it.

Prints, for the measured steps that captured nothing (the bench's "repeat" steps), the median host ms of each
phase, of the step from the step-begin callback to the step-end one and of the whole cycle (logging and fetching
the next batch included). Phases nest as listed (training_step holds model.train, the forward and the backward).
A phase that waits for the device holds that wait. Run it on a GPU host (the device's numbers are the point);
`--tiny` runs the CPU smoke version.

`--timeline N` also traces N measured steps with torch.profiler (host ops and device kernels, the phases as
ranges) and prints where the GPU was idle: kernel-busy ms against the span, and the idle ms by the host phase
that ran meanwhile, with the host calls that waited for the device (synchronisations, blocking copies). That
tells a step the host sets the pace of from one the device does. Tracing the host ops slows the host severalfold,
so `--device-only` traces the kernels alone: the N steps' wall (synchronised at both ends) against their kernel
time, and the idle gaps by the kernels on either side.

Without any tracing, a CUDA event recorded where each step begins gives the device's own time per step (kernels
and the gaps between them, idle included), and `--host-delay MS` adds MS ms of host work to every step (a sleep in
the step-end callback), the device's work unchanged. Whether the host or the device sets the pace shows in the
cycle: where the device does, the host is ahead and the cycle stays as it was up to the delay the host can
spare; where the host does, the cycle grows by the delay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

# Each phase: its label (indented as phases nest) and what it times: (owner, attribute) for a method wrapped on its
# class, or None for the three `_instrument` wraps by hand (the outermost `model.train()`, `model.zero_grad()`,
# every `Tensor.__bool__`). Owners are named here and imported in `_instrument`.
TRAIN, ZERO_GRAD = "  model.train()", "model.zero_grad"
TENSOR_BOOL = "bool() of a tensor, anywhere (waits for the device)"
TIMED = (
    ("next batch (dataloader, collator)", ("Trainer", "get_batch_samples")),
    ("callbacks: step begin", ("CallbackHandler", "on_step_begin")),
    ("training_step", ("Trainer", "training_step")),
    (TRAIN, None),
    ("  forward (loss)", ("Trainer", "compute_loss")),
    ("    fastplug: batch padded/packed (a host sync unless collated by the trainer)", ("lm_head", "loss_only_inputs")),
    ("  backward (issue)", ("Accelerator", "backward")),
    (TENSOR_BOOL, None),
    ("FLOP count (model.num_parameters)", ("Trainer", "floating_point_ops")),
    ("gradient clipping", ("Trainer", "_clip_grad_norm")),
    ("optimizer.step", ("AcceleratedOptimizer", "step")),
    (ZERO_GRAD, None),
    ("callbacks: step end", ("CallbackHandler", "on_step_end")),
    ("logging (loss .item())", ("Trainer", "_maybe_log_save_evaluate")),
)
PHASES = tuple(label for label, _ in TIMED)


class PhaseClock:
    """Host seconds per phase, per step; `timed` wraps a callable so that each call adds to its phase."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}

    def timed(self, phase: str, fn):
        from torch.profiler import record_function

        clock = self

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                with record_function(phase):  # a range in --timeline's trace (next to nothing otherwise)
                    return fn(*args, **kwargs)
            finally:
                clock.current[phase] = clock.current.get(phase, 0.0) + time.perf_counter() - start

        return wrapper

    def next_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _instrument(clock: PhaseClock, stack: contextlib.ExitStack) -> None:
    """Wraps the Trainer's phases (classes, for this process only)."""
    import torch
    import transformers
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers.trainer_callback import CallbackHandler

    from fastplug.models import lm_head
    from fastplug.patch.module_walks import ModuleWalks

    owners = {
        "Trainer": transformers.Trainer,
        "CallbackHandler": CallbackHandler,
        "lm_head": lm_head,
        "Accelerator": Accelerator,
        "AcceleratedOptimizer": AcceleratedOptimizer,
    }
    for phase, target in TIMED:
        if target is not None:
            owner, name = target
            stack.enter_context(_patched(owners[owner], name, lambda fn, phase=phase: clock.timed(phase, fn)))
    # model.train() and model.zero_grad(): the outermost call only (they recurse through every module)
    depth = {"train": 0}

    def outer_train(fn):
        def train(self, mode=True):
            depth["train"] += 1
            try:
                if depth["train"] == 1:
                    return clock.timed(TRAIN, fn)(self, mode)
                return fn(self, mode)
            finally:
                depth["train"] -= 1

        return train

    # the patched model's own (fastplug's walks of its module list: fastplug/patch/module_walks.py) as well
    for owner in (torch.nn.Module, ModuleWalks):
        stack.enter_context(_patched(owner, "train", outer_train))
        stack.enter_context(_patched(owner, "zero_grad", lambda fn: clock.timed(ZERO_GRAD, fn)))
    # every bool() of a tensor: the plain Trainer's loss filter (`torch.isnan(loss) or torch.isinf(loss)`), and any
    # other host sync of that kind (transformers' check of a packed row's positions was one); nested in its phase
    stack.enter_context(_patched(torch.Tensor, "__bool__", lambda fn: clock.timed(TENSOR_BOOL, fn)))


WAITING_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
)


def _innermost(ranges: list[tuple[float, float, str]], t: float) -> str:
    """The shortest phase range holding host time t ("outside the phases" if none)."""
    holding = [(end - start, name) for start, end, name in ranges if start <= t < end]
    return min(holding)[1] if holding else "outside the phases"


def _short(kernel: str) -> str:
    return kernel.split("(")[0].split("<")[0][:60]


def idle_report(trace_path: str, steps: int, wall_s: float) -> None:
    """GPU idle time of a torch.profiler chrome trace, by the host phase running meanwhile where the trace holds
    the phases, else by the kernels on either side of each gap (module docstring)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["name"] in PHASES]
    if not device:
        print("the trace holds no kernels")
        return
    busy, gaps, (run_start, run_end, last) = 0.0, [], device[0]
    for start, end, name in device[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((run_end, start, last, name))
            run_start = start
        if end > run_end:
            run_end, last = end, name
    busy += run_end - run_start
    per_step = steps * 1e3
    print(
        f"\ntimeline of {steps} steps: wall {wall_s * 1e3 / steps:.1f} ms a step (synchronised at both ends), GPU busy"
        f" {busy / per_step:.1f} ms a step (kernel union): wall / busy {wall_s * 1e6 / busy:.2f}"
    )
    if not phases:
        by_kernels: dict[str, list[float]] = {}
        for start, end, before, after in gaps:
            by_kernels.setdefault(f"{_short(before)} -> {_short(after)}", []).append(end - start)
        print("| idle gap (kernel before -> after) | gaps a step | idle ms a step |\n|---|---|---|")
        for where, durations in sorted(by_kernels.items(), key=lambda item: -sum(item[1]))[:12]:
            print(f"| {where} | {len(durations) / steps:.1f} | {sum(durations) / per_step:.2f} |")
        return
    idle: dict[str, float] = {}
    for start, end, _, _ in gaps:  # each idle gap, split at 0.1 ms grains by the innermost phase the host was in
        t = start
        while t < end:
            grain = min(100.0, end - t)
            phase = _innermost(phases, t)
            idle[phase] = idle.get(phase, 0.0) + grain
            t += grain
    print("| host phase while the GPU idled | idle ms a step |\n|---|---|")
    for phase, us in sorted(idle.items(), key=lambda item: -item[1]):
        if us / steps >= 50:
            print(f"| {phase} | {us / 1e3 / steps:.1f} |")
    waits: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"] in WAITING_CALLS and e["dur"] >= 200:
            waits.setdefault(f"{e['name']} in {_innermost(phases, e['ts'])}", []).append(e["dur"])
    print("| host call that waited >= 0.2 ms | calls a step | ms a step |\n|---|---|---|")
    for where, durations in sorted(waits.items(), key=lambda item: -sum(item[1])):
        print(f"| {where} | {len(durations) / steps:.1f} | {sum(durations) / 1e3 / steps:.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma2")
    parser.add_argument("--run", default="trainer_fastkernels", help="a bench varlen Trainer run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="e2e's tiny model on CPU (a smoke run)")
    parser.add_argument("--timeline", type=int, default=0, help="trace this many measured steps (docstring)")
    parser.add_argument("--device-only", action="store_true", help="--timeline traces the kernels alone")
    parser.add_argument("--host-delay", type=float, default=0.0, help="ms of host work added to each step (sleep)")
    args = parser.parse_args(argv)
    if args.timeline >= args.steps:
        parser.error("--timeline must be below --steps (the bench profiles the steps after the measured ones)")

    from fastplug.bench import varlen
    from fastplug.bench.presets import MODELS

    tiny = args.tiny
    spec = dict(
        bench="varlen", run=args.run, model=args.model, tiny=tiny, device="cpu" if tiny else "cuda", seed=0,
        batch=2 if tiny else MODELS[args.model]["batch"], steps=args.steps, warmup=args.warmup, min_len=64,
        max_len=256 if tiny else 4096, vocab=min(32000, MODELS[args.model]["tiny" if tiny else "full"]["vocab_size"]),
        seq=4096, deadline=time.time() + 3600,
    )  # fmt: skip
    clock, walls, cycles, causes = PhaseClock(), [], [], []
    begin, end, result = varlen._Meter.begin_step, varlen._Meter.end_step, varlen._Meter.result
    starts = []  # each step's begin, host time

    trace = {"path": "/tmp/trainer_step_timeline.json", "profile": None, "started": 0.0, "wall": 0.0}

    def begin_step(meter):
        if args.timeline and len(starts) == args.warmup + args.timeline:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            trace["wall"] = time.perf_counter() - trace["started"]
            trace["profile"].__exit__(None, None, None)
            trace["profile"].export_chrome_trace(trace["path"])
            trace["profile"] = None
        begin(meter)  # synchronises where the measured steps begin
        if args.timeline and len(starts) == args.warmup:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CUDA] if args.device_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            trace["profile"] = profile(activities=activities)
            trace["profile"].__enter__()
            trace["started"] = time.perf_counter()
        starts.append(time.perf_counter())
        if len(starts) > 1:  # a cycle runs from one step's begin to the next's (logging and the next batch in it)
            cycles.append(starts[-1] - starts[-2])
            clock.next_step()
        clock.current = {}

    def end_step(meter, loss=None):
        if args.host_delay:
            time.sleep(args.host_delay / 1e3)
        walls.append(time.perf_counter() - starts[-1])
        return end(meter, loss)

    def report(meter, note):
        causes.extend(meter.causes)
        return result(meter, note)

    # the meter's begin/end run inside the step-begin and step-end callbacks: their own time is the bench's
    varlen._Meter.begin_step, varlen._Meter.end_step, varlen._Meter.result = begin_step, end_step, report
    with contextlib.ExitStack() as stack:
        _instrument(clock, stack)
        varlen.worker_main(json.dumps(spec), "/tmp/trainer_step_phases.json")
    with open("/tmp/trainer_step_phases.json") as f:
        outcome = json.load(f)
    if "error" in outcome:
        print(outcome["error"])
        return 1
    measured = range(args.warmup, min(args.warmup + args.steps, len(cycles), len(causes)))
    traced = range(args.warmup, args.warmup + args.timeline)  # the profiler slowed their host
    repeats = [i for i in measured if causes[i] == "repeat" and i not in traced]
    if not repeats:
        print("no repeated step among the measured ones")
        return 1
    print(f"\n{args.model} / {args.run}: {len(repeats)} repeated steps of {len(measured)} measured")
    print("| phase | host ms (median) |\n|---|---|")
    for phase in PHASES:
        values = [clock.steps[i].get(phase, 0.0) for i in repeats]
        print(f"| {phase} | {1e3 * statistics.median(values):.1f} |")
    print(
        f"| the step, from its begin callback to its end callback | "
        f"{1e3 * statistics.median(walls[i] for i in repeats):.1f} |"
    )
    print(f"| the whole cycle (to the next step's begin) | {1e3 * statistics.median(cycles[i] for i in repeats):.1f} |")
    # each measured step's ms on the device's timeline, from the meter's CUDA events (None off the GPU)
    on_device = [step[2] for step in outcome["per_step"]]
    spans = [on_device[i - args.warmup] for i in repeats if on_device[i - args.warmup] is not None]
    if spans:
        print(
            f"| the device's time per step, between its begin events (idle included) | {statistics.median(spans):.1f} |"
        )
    if args.host_delay:
        print(f"(each step's end callback slept {args.host_delay:g} ms)")
    print(f"GPU ms per step (profiler, all measured steps' mean): {outcome.get('gpu_ms') or 0:.1f}")
    if outcome.get("kernels_per_step"):
        print(f"device kernels per profiled step: {outcome['kernels_per_step']:.0f}")
    if args.timeline:
        idle_report(trace["path"], args.timeline, trace["wall"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
