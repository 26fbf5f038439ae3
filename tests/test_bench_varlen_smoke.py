"""Smoke run of `python -m fastplug.bench varlen --tiny` on CPU, its plain Trainer row and its Lightning rows (a
Lightning fit around the trainer rows' model, documents and collator, alone and with strategy="fastkernels"), in
worker processes. Timings on
CPU mean nothing and are not checked; what is checked is that both rows count exactly the real (non-pad) tokens of
the documents they trained on, and that fastplug's losses match Lightning's alone. The rows run with the GPU's
settings (precision="bf16-mixed", gradient_clip_val=1, the same optimizer): Lightning's checks of the optimizer under
AMP with clipping (a fused AdamW is refused) happen on CPU too.
"""

import math

import pytest

pytest.importorskip("lightning")

from fastplug.bench import varlen  # noqa: E402


def test_varlen_tiny_rows_count_real_tokens_profile_the_measured_batches_and_agree(monkeypatch):
    # The workers take fastplug's torch-reference path (tests/integrations checks the strategy under the interpreter)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    argv = ["--tiny", "--steps", "2", "--warmup", "1", "--min-len", "8", "--max-len", "48", "--time-limit", "240"]
    args = varlen.build_parser().parse_args(argv)
    runs = ["trainer", "lightning", "lightning_fastkernels"]
    rows = {r["run"]: r for r in varlen.varlen_rows(args, ["llama"], runs, "cpu", lambda rows: None)}
    assert set(rows) == set(runs)

    # The documents the workers trained on, built again here: the tokenizer fits the tiny model's vocabulary
    tokenizer, paths = varlen.build_tokenizer(128)
    assert len(tokenizer) <= 128
    batch = rows["lightning"]["batch"]
    docs = varlen.documents(tokenizer, paths, batch * (args.warmup + args.steps), args.min_len, args.max_len, args.seed)
    docs += docs[batch * args.warmup :]  # the profiled steps train on the measured steps' documents again
    assert len({len(d) for d in docs}) > 1, "documents of one length would need no padding"
    assert max(max(d) for d in docs) < 128
    for run, row in rows.items():
        assert "note" in row and "tok/s" in row, row
        assert "measured steps by cause (median wall): repeat 2 (" in row["note"], row["note"]  # CPU: no graphs
        assert row["real tokens"] == sum(len(d) for d in docs), row
        steps = args.warmup + 2 * args.steps
        # each profiled step's batch is its measured twin's (the same real tokens), taken in the dataset's order
        tokens = row["step tokens"]
        assert len(tokens) == steps and tokens[args.warmup : -args.steps] == tokens[-args.steps :], tokens
        assert sum(tokens[: args.warmup]) == sum(len(d) for d in docs[: batch * args.warmup]), tokens
        assert row["tok/s"] > 0 and len(row["losses"]) == steps and all(map(math.isfinite, row["losses"])), row
    fast, base = rows["lightning_fastkernels"], rows["lightning"]
    assert fast["note"].startswith("patched "), fast["note"]
    assert fast["vs baseline"] > 0
    assert f"of the baseline's over {steps} steps" in fast["note"], fast["note"]
    for a, b in zip(fast["losses"], base["losses"]):
        assert abs(a - b) <= 1e-3 * abs(b), (fast["losses"], base["losses"])


def test_meter_tells_each_step_by_what_it_did_beyond_a_repeated_one():
    """A step that timed MoE candidates, captured graphs or first saw a shape is told apart from a repeated one,
    in that order of precedence (the counts are cumulative: a step is what changed during it)."""
    import torch

    meter = varlen._Meter(torch.device("cpu"), warmup=1, steps=4, deadline=float("inf"))
    # (tuned, captured, first sightings) at each step's begin and end
    begin_end = [(0, 0, 0), (0, 0, 1), (0, 0, 1), (0, 2, 1), (0, 2, 1), (3, 4, 2), (3, 4, 2), (3, 4, 2)]
    counts = iter([*begin_end, (3, 4, 2), (3, 4, 3)])
    meter._events = lambda: next(counts)

    class Counter:
        def take_lazy(self):
            return torch.tensor(10)

    meter._counter = Counter()
    for _ in range(5):
        meter.begin_step()
        meter.end_step()
    assert meter.causes == ["first sighting", "capture", "MoE tuning", "repeat", "first sighting"]
    note = meter.result("patched")["note"]
    assert note.startswith("patched; measured steps by cause (median wall): ") and "first sighting 1" in note, note
    assert "capture 1" in note and "MoE tuning 1" in note and "repeat 1" in note, note


def test_meter_takes_each_measured_steps_kernel_time_from_its_profiled_twin():
    """The profiled steps train on the measured steps' batches again: each measured step gets its twin's kernel
    time. Where the twins' real tokens differ (packed rows), the kernel time is scaled by real tokens instead."""
    import torch

    meter = varlen._Meter(torch.device("cpu"), warmup=1, steps=3, deadline=float("inf"))
    meter.tokens = [50, 120, 30, 400, 120, 30, 400]
    meter.device_ms = [11.0, 4.0, 35.0]
    assert meter._device_ms_of_measured([120, 30, 400]) == ([11.0, 4.0, 35.0], "the same batches, profiled again")
    meter.tokens = [50, 120, 30, 400, 100, 50, 400]  # other batches of 550 real tokens in all
    device_ms, source = meter._device_ms_of_measured([120, 30, 400])
    assert source == "other batches', scaled by real tokens (3 profiled)"
    assert device_ms == pytest.approx([n * 50.0 / 550 for n in (120, 30, 400)])
    meter.tokens, meter.device_ms = [50, 120, 30, 400], []  # nothing profiled (CPU, or the deadline came first)
    assert meter._device_ms_of_measured([120, 30, 400]) == (None, "")


def test_meter_times_the_slow_steps_on_the_devices_timeline():
    """A step's host interval carries whatever wait the host met during it (the device still busy with the step
    before); the steps below half the median step's tok/s are told by their time between CUDA events recorded
    where each step begins, when there are such events."""
    import torch

    class Event:  # a CUDA event's elapsed_time, from a time of our own
        def __init__(self, seconds):
            self.seconds = seconds

        def elapsed_time(self, other):
            return 1e3 * (other.seconds - self.seconds)

    meter = varlen._Meter(torch.device("cpu"), warmup=0, steps=4, deadline=float("inf"))
    tokens = iter([1000, 1000, 1000, 1000])

    class Counter:
        def take_lazy(self):
            return torch.tensor(next(tokens))

    meter._counter = Counter()
    for _ in range(4):
        meter.begin_step()
        meter.end_step()
    # on the device: 0.1 s, 0.1 s, 0.5 s (slow), 0.1 s
    meter._marks = [Event(t) for t in (0.0, 0.1, 0.2, 0.7, 0.8)]
    result = meter.result("")
    assert "1 steps below half the median step's tok/s (device timeline) (real tokens, cause: 1000" in result["note"]
    assert [step[2] for step in result["per_step"]] == pytest.approx([100.0, 100.0, 500.0, 100.0])
    meter._marks = meter._marks[:3]  # not one per step: the host intervals
    assert "(device timeline)" not in meter.result("")["note"]
