"""Smoke runs of `python -m fastplug.bench` on CPU at tiny shapes: the plumbing works end to end.

Timings on CPU mean nothing and are not checked; what is checked is that every row ran, the fastplug
numbers agree with eager / plain transformers, and the CSV is written.
"""

import csv
import time

import pytest

from fastplug.bench import e2e, micro


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_micro_quick_on_cpu_writes_csv_with_agreeing_outputs(tmp_path, capsys):
    rc = micro.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = _read_csv(tmp_path / "micro.csv")
    assert rc == 0, out
    for op in micro.OPS:
        fast = next(r for r in rows if r["op"] == op and r["impl"] == "fastplug")
        assert float(fast["ms"]) > 0, fast
        assert float(fast["rel err out"]) < 2e-2 and float(fast["rel err grads"]) < 2e-2, fast
    for op in ("swiglu", "geglu", "rope"):  # reusing their inputs, on fresh copies as inside a model
        reuse = next(r for r in rows if r["op"] == op and r["impl"] == "fastplug_inplace")
        assert float(reuse["rel err out"]) < 2e-2 and float(reuse["rel err grads"]) < 2e-2, reuse
    assert "| op | shape | impl |" in out
    assert {r["timing"] for r in rows if r.get("ms")} == {"cpu"}


def test_micro_timing_option_is_checked_and_profile_is_skipped_on_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit):
        micro.main(["--quick", "--timing", "wall", "--out", str(tmp_path)])
    assert "--timing: invalid choice: 'wall'" in capsys.readouterr().err
    # A valid mode parses; on CPU it is ignored (plain median) and --profile says it needs CUDA.
    rc = micro.main(["--quick", "--ops", "rms_norm", "--timing", "launch", "--profile", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--profile needs CUDA" in out
    rows = _read_csv(tmp_path / "micro.csv")
    assert [(r["impl"], r["timing"]) for r in rows] == [("eager", "cpu"), ("fastplug", "cpu")]


def test_e2e_tiny_llama_losses_agree(tmp_path, capsys, monkeypatch):
    # The workers take fastplug's torch-reference path: this checks the plumbing (fresh processes, patching,
    # the loss comparison, the CSV) in seconds; tests/models checks the patched models under the interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc = e2e.main(
        [
            "--tiny",
            "--models",
            "llama",
            "--impls",
            "transformers,fastplug",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--time-limit",
            "240",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    rows = {r["impl"]: r for r in _read_csv(tmp_path / "e2e.csv")}
    assert rc == 0, out
    base = [float(x) for x in rows["transformers"]["losses (steps 1-3)"].split()]
    fast = [float(x) for x in rows["fastplug"]["losses (steps 1-3)"].split()]
    assert len(base) == len(fast) == 3
    for a, b in zip(fast, base):
        assert abs(a - b) <= 1e-2 * abs(b), (fast, base)
    assert float(rows["fastplug"]["tok/s"]) > 0


def test_e2e_row_past_its_time_limit_times_steady_steps(monkeypatch):
    """A time limit that falls inside the warm-up (a self-check, the first step's compiles) still gives the steady
    pace: two steps past it are timed, never the first step alone."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = dict(
        mode="throughput", model="llama", impl="transformers", tiny=True, device="cpu", seed=0, batch=2, seq=16,
        steps=2, warmup=3, adapter_dtype="fp32", profile=False, options=None, deadline=time.time(),
    )  # fmt: skip
    result = e2e.run_throughput(spec)
    assert len(result["all_step_ms"]) == 1  # the deadline stopped the loop after its first step
    assert result["measured_steps"] == 2
    assert result["tokens_per_s"] == pytest.approx(2 * 16 / (result["step_ms"] / 1e3))
