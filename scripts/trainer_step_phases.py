"""Where the host time of a repeated HF Trainer step goes, by phase: `bench varlen`'s Trainer run, with each
phase of `Trainer._inner_training_loop` timed on the host (perf_counter, no added synchronisation).

    python scripts/trainer_step_phases.py --model gemma2 --run trainer_fastkernels

The Trainer synchronises once a step, right after `training_step` returns (`logging_nan_inf_filter`, on by
default, tests the loss with a host `bool()`): that wait is the device finishing the step's forward and
backward. Everything after it until the next step's layers run (the gradient clipping, the optimizer, zero_grad,
the FLOP count, logging, the next batch, `model.train()`, the loss path's batch preparation) is host time with
the GPU idle or nearly so, unless the optimizer's kernels outlast it. So a step's wall is roughly the wait plus
the host phases outside it, and the table says which of them set the pace beyond the device's.

Prints, for the measured steps that captured nothing (the bench's "repeat" steps), the median host ms of each
phase, of the step as the bench times it (from the step-begin callback to the step-end one, both synchronised)
and of the whole cycle (logging and fetching the next batch included). Phases nest as listed (training_step holds
model.train, the forward and the backward); the step-begin callbacks include the bench's own synchronise. Run it
on a GPU host (the device's numbers are the point); `--tiny` runs the CPU smoke version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

PHASES = (
    "next batch (dataloader, collator)",
    "callbacks: step begin",
    "training_step",
    "  model.train()",
    "  forward (loss)",
    "    fastplug: batch padded/packed (one host sync)",
    "  backward (issue)",
    "loss sync (waits for the device)",
    "FLOP count (model.num_parameters)",
    "gradient clipping",
    "optimizer.step",
    "model.zero_grad",
    "callbacks: step end",
    "logging (loss .item())",
)


class PhaseClock:
    """Host seconds per phase, per step; `timed` wraps a callable so that each call adds to its phase."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}

    def timed(self, phase: str, fn):
        clock = self

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
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

    trainer = transformers.Trainer
    wraps = [
        (trainer, "get_batch_samples", "next batch (dataloader, collator)"),
        (CallbackHandler, "on_step_begin", "callbacks: step begin"),
        (trainer, "training_step", "training_step"),
        (trainer, "compute_loss", "  forward (loss)"),
        (lm_head, "loss_only_inputs", "    fastplug: batch padded/packed (one host sync)"),
        (Accelerator, "backward", "  backward (issue)"),
        (trainer, "floating_point_ops", "FLOP count (model.num_parameters)"),
        (trainer, "_clip_grad_norm", "gradient clipping"),
        (AcceleratedOptimizer, "step", "optimizer.step"),
        (CallbackHandler, "on_step_end", "callbacks: step end"),
        (trainer, "_maybe_log_save_evaluate", "logging (loss .item())"),
    ]
    for owner, name, phase in wraps:
        stack.enter_context(_patched(owner, name, lambda fn, phase=phase: clock.timed(phase, fn)))
    # model.train() and model.zero_grad(): the outermost call only (they recurse through every module)
    depth = {"train": 0}

    def outer_train(fn):
        def train(self, mode=True):
            depth["train"] += 1
            try:
                if depth["train"] == 1:
                    return clock.timed("  model.train()", fn)(self, mode)
                return fn(self, mode)
            finally:
                depth["train"] -= 1

        return train

    stack.enter_context(_patched(torch.nn.Module, "train", outer_train))
    stack.enter_context(_patched(torch.nn.Module, "zero_grad", lambda fn: clock.timed("model.zero_grad", fn)))
    # the one host sync of a step outside the loss path: `torch.isnan(loss) or torch.isinf(loss)`
    stack.enter_context(
        _patched(torch.Tensor, "__bool__", lambda fn: clock.timed("loss sync (waits for the device)", fn))
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma2")
    parser.add_argument("--run", default="trainer_fastkernels", help="a bench varlen Trainer run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="e2e's tiny model on CPU (a smoke run)")
    args = parser.parse_args(argv)

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
    starts = []

    def begin_step(meter):
        begin(meter)  # synchronises: the GPU is idle from here
        starts.append(time.perf_counter())
        if len(starts) > 1:  # a cycle runs from one step's begin to the next's (logging and the next batch in it)
            cycles.append(starts[-1] - starts[-2])
            clock.next_step()
        clock.current = {}

    def end_step(meter, loss=None):
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
    repeats = [i for i in measured if causes[i] == "repeat"]
    if not repeats:
        print("no repeated step among the measured ones")
        return 1
    print(f"\n{args.model} / {args.run}: {len(repeats)} repeated steps of {len(measured)} measured")
    print("| phase | host ms (median) |\n|---|---|")
    for phase in PHASES:
        values = [clock.steps[i].get(phase, 0.0) for i in repeats]
        print(f"| {phase} | {1e3 * statistics.median(values):.1f} |")
    print(
        f"| the step as the bench times it (step begin to step end, synchronised) | "
        f"{1e3 * statistics.median(walls[i] for i in repeats):.1f} |"
    )
    print(f"| the whole cycle (to the next step's begin) | {1e3 * statistics.median(cycles[i] for i in repeats):.1f} |")
    print(f"GPU ms per step (profiler, all measured steps' mean): {outcome.get('gpu_ms') or 0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
