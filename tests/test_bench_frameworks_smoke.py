"""Smoke run of `python -m fastplug.bench frameworks --tiny` on CPU: TRL SFT, the HF Trainer and a Lightning fit,
each with and without fastplug, in worker processes. Timings on CPU mean nothing and are not checked; what is checked
is that every run trained, reported tokens/s and finite losses, and that fastplug's losses match its baseline's.
"""

import csv
import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("lightning")

from fastplug.bench import frameworks  # noqa: E402


def test_frameworks_tiny_all_runs_train_with_agreeing_losses(tmp_path, capsys, monkeypatch):
    # The workers take fastplug's torch-reference path (seconds, not minutes under the interpreter): this checks
    # the plumbing; tests/integrations checks the adapters themselves.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # the packed TRL pair, the HF Trainer pair and the Lightning pair (the unpacked TRL pair runs the same
    # plumbing minus packing; the compiled Trainer pair, the same plus torch_compile=True)
    runs = ("sft_packed", "fast_sft_packed", "trainer", "trainer_fastkernels", "lightning", "lightning_fastkernels")
    rc = frameworks.main(
        [
            "--tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--time-limit",
            "240",
            "--out",
            str(tmp_path),
            "--runs",
            ",".join(runs),
        ]
    )
    out = capsys.readouterr().out
    with open(tmp_path / "frameworks.csv", newline="") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rc == 0, out
    assert set(rows) == set(runs), out
    losses = {}
    for run, row in rows.items():
        assert float(row["tok/s"]) > 0, row
        losses[run] = [float(x) for x in row["losses (first 3)"].split()]
        assert len(losses[run]) == 3 and all(math.isfinite(x) for x in losses[run]), row
    for fast, base in ((f, b) for f, b in frameworks.BASELINE.items() if f in runs):
        assert float(rows[fast]["vs baseline"]) > 0, rows[fast]
        for a, b in zip(losses[fast], losses[base]):
            assert abs(a - b) <= 1e-3 * abs(b), (fast, losses[fast], losses[base])
    assert "| run | batch x seq | tok/s |" in out
