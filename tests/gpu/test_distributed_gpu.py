"""Two GPUs (NCCL): the CPU checks of tests/integrations/test_distributed.py at GPU shapes with fastplug's
attention kernel, plus the HF Trainer and FastSFTTrainer under accelerate's FSDP2 and CUDA offload checkpointing;
the DDP trainers through `accelerate launch`, the rest through torchrun.

Each group of scenarios runs in one torchrun launch of tests/integrations/distributed_worker.py; one process on
cuda:0 (this one) computes the references. scripts/multi_gpu.sh runs this file (marker gpu2).
"""

import importlib.util
import re
import tempfile

import pytest

from tests.integrations import distributed_worker as worker

pytestmark = pytest.mark.gpu2

# fp32; the two runs differ only in the order of cross-rank and cross-row sums
TOL = 1e-4
# fastplug's kernels against TRL's own layers (torch's fp32 matmuls)
TRL_TOL = 2e-3
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAS_TRL = all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))


def _launch(scenarios, *extra, launcher="torchrun", nproc=2):
    # not pytest's tmp_path: a concurrent pytest session of the same user may prune it while the workers write
    with tempfile.TemporaryDirectory(prefix="fastplug_distributed_gpu_") as out_dir:
        return worker.launch(
            scenarios, out_dir, device="cuda", nproc=nproc, timeout=120, extra=extra, launcher=launcher
        )


@pytest.fixture(scope="module")
def torch_runs():
    # torch's wrappers and Lightning's strategies; the accelerate-based trainers run in launches of their own
    lightning = ["lightning_ddp", "lightning_fsdp"] if HAS_LIGHTNING else []
    return _launch(["ddp", "fsdp2", "fsdp2_bf16", "fsdp2_after", "ddp_offload", *lightning])


@pytest.fixture(scope="module")
def ddp_trainer_runs():
    # `accelerate launch` (the others: torchrun); offload checkpointing (pinned host memory, CUDA streams) in the
    # Trainer's DDP, which finds unused parameters
    scenarios = ["trainer"] + (["sft"] if HAS_TRL else [])
    return _launch(scenarios, "--checkpointing", "offload", launcher="accelerate")


@pytest.fixture(scope="module")
def fsdp_trainer_runs():
    # accelerate keeps one FSDP configuration per process: the FSDP2 trainers run in processes of their own
    # the presharded case last: a scenario that raises ends the launch, and the ones after it get no results
    return _launch(["trainer_fsdp2"] + (["sft_fsdp2"] if HAS_TRL else []) + ["trainer_fsdp2_presharded"])


@pytest.fixture(scope="module")
def one_process():
    return worker.reference_loop("cuda", device="cuda")


@pytest.fixture(scope="module")
def one_trainer_process():
    # a process of its own: the HF Trainer in this one would see both GPUs and split batches (DataParallel)
    return worker.ranks_of(_launch(["trainer"], nproc=1), "trainer")[0]


@pytest.mark.parametrize("scenario", ["ddp", "fsdp2", "fsdp2_bf16", "fsdp2_after", "ddp_offload"])
def test_torch_wrappers_match_one_process(torch_runs, one_process, scenario):
    ranks = worker.ranks_of(torch_runs, scenario)
    if scenario == "fsdp2_bf16":
        import torch

        worker.assert_bf16_loop_matches(ranks, worker.reference_loop("cuda", device="cuda", dtype=torch.bfloat16))
    else:
        worker.assert_loop_matches(ranks, one_process, TOL)
    for rank, got in enumerate(ranks):
        assert all(got["fused_head"]), f"rank {rank}: the fused LM-head loss did not run"
        assert got["restored"], f"rank {rank}: not restored"
        assert "attention: 2" in got["summary"] and "lora_fused: 4" in got["summary"], got["summary"]
        if (
            scenario != "ddp_offload"
        ):  # offload checkpointing runs eagerly; the others replay inside the wrappers' hooks
            assert re.search(r"\breplayed: [1-9]", got["summary"]), f"rank {rank}: {got['summary']}"


@pytest.mark.parametrize("scenario", ["trainer", "trainer_fsdp2"])
def test_hf_trainer_matches_one_process(request, one_trainer_process, scenario):
    runs = request.getfixturevalue("fsdp_trainer_runs" if scenario.endswith("fsdp2") else "ddp_trainer_runs")
    ranks = worker.ranks_of(runs, scenario)
    worker.assert_training_matches(ranks, one_trainer_process, TOL)
    for rank, got in enumerate(ranks):
        assert got["patched_before_wrap"], f"rank {rank}: not patched before accelerate wrapped the model"
        assert got["wrapped_at_begin"] == (scenario == "trainer_fsdp2"), f"rank {rank}: {got['fsdp_units']}"
        assert got["patched_steps"] == [True] * worker.STEPS, f"rank {rank}: {got['patched_steps']}"
        assert got["restored"], f"rank {rank}: not restored after train()"
        if scenario == "trainer":
            assert "offload" in got["summary"], got["summary"]
        print(f"rank {rank} {scenario}: FSDP units {got['fsdp_units']}")


def test_hf_trainer_fsdp2_keeps_a_model_sharded_per_layer_before_it(fsdp_trainer_runs, one_trainer_process):
    """A recipe for per-layer FSDP2 units with a PeftModel in the HF Trainer (see run_trainer): accelerate keeps
    the sharding, fastplug patches the sharded model, the numbers are one process'."""
    ranks = worker.ranks_of(fsdp_trainer_runs, "trainer_fsdp2_presharded")
    worker.assert_training_matches(ranks, one_trainer_process, TOL)
    for rank, got in enumerate(ranks):
        assert got["fsdp_units"].count("FSDPLlamaDecoderLayer") == 2, f"rank {rank}: {got['fsdp_units']}"
        assert got["patched_steps"] == [True] * worker.STEPS and got["restored"], f"rank {rank}"
        print(f"rank {rank} trainer_fsdp2_presharded: FSDP units {got['fsdp_units']}")


@pytest.mark.skipif(not HAS_TRL, reason="needs trl and datasets (scripts/multi_gpu.sh installs them from .whl/)")
@pytest.mark.parametrize("scenario", ["sft", "sft_fsdp2"])
def test_fast_sft_trainer_matches_trl(request, scenario):
    runs = request.getfixturevalue("fsdp_trainer_runs" if scenario.endswith("fsdp2") else "ddp_trainer_runs")
    for rank, got in enumerate(worker.ranks_of(runs, scenario)):
        assert got["fastplug"] == pytest.approx(got["trl"], rel=TRL_TOL), f"rank {rank}"
        assert got["restored"], f"rank {rank}: not restored after train()"


@pytest.mark.skipif(not HAS_LIGHTNING, reason="needs lightning")
@pytest.mark.parametrize("scenario", ["lightning_ddp", "lightning_fsdp"])
def test_lightning_strategies_match_one_process(torch_runs, scenario):
    ranks = worker.ranks_of(torch_runs, scenario)
    worker.assert_training_matches(ranks, worker.reference_lightning("cuda"), TOL)
    for rank, got in enumerate(ranks):
        assert got["sharded"] == (scenario == "lightning_fsdp")
        assert got["patched_steps"] == [True] * worker.STEPS and got["restored"], f"rank {rank}"
