"""`python -m fastplug.bench multi`: the table's ratios and issue 17's target lines, from made-up launch results
(the launches themselves need GPUs; `--tiny` runs them on CPU, too slowly for CI with fastplug's kernels)."""

from fastplug.bench.multi import rows_for, targets


def _result(impl, tokens_per_s, peak):
    return {
        "model": "llama",
        "impl": impl,
        "step_s": 8192 / tokens_per_s,
        "host_s": 0.5 * 8192 / tokens_per_s,
        "tokens_per_s": tokens_per_s,
        "peak_gib": peak,
        "losses": [1.0],
        "note": "",
    }


def test_ratios_and_targets():
    results = {
        "single": [_result("transformers", 20000, 14.0), _result("fastplug", 40000, 4.0)],
        "ddp": [_result("transformers", 19000, 14.5), _result("fastplug", 38000, 4.2)],
        "fsdp2": [_result("transformers", 17000, 9.0), {"model": "llama", "impl": "fastplug", "error": "OOM"}],
    }
    rows = rows_for(results, ["llama"], ["transformers", "fastplug"], 2, 4, 2048, tiny=False)
    by = {(r["parallel"], r["impl"]): r for r in rows}
    assert by[("ddp", "fastplug")]["vs transformers"] == 2.0
    assert by[("ddp", "fastplug")]["vs 1 GPU"] == 0.95
    assert by[("ddp", "fastplug")]["host ms"] == 0.5 * by[("ddp", "fastplug")]["step ms"]
    assert by[("fsdp2", "fastplug")]["note"] == "OOM" and "tok/s per GPU" not in by[("fsdp2", "fastplug")]
    lines = targets(rows)
    assert any(line.startswith("met") and "DDP per GPU" in line for line in lines)
    assert any(line.startswith("met") and "ddp speedup 2.00x vs 1 GPU's 2.00x" in line for line in lines)
    assert not any("fsdp2 speedup" in line or "FSDP2 peak" in line for line in lines), "no FSDP2 fastplug row"


def test_a_launch_that_failed_marks_its_rows():
    results = {"single": [{"error": "launch timed out after 90 s"}]}
    rows = rows_for(results, ["llama"], ["fastplug"], 2, 4, 2048, tiny=False)
    assert rows[0]["note"] == "launch timed out after 90 s"
    assert targets(rows) == ["-       llama: no complete set of rows to check the targets"]
