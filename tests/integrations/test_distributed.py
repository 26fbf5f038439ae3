"""Two processes on CPU (gloo): fastplug under torch's DDP and FSDP2 (`fully_shard`), the HF Trainer with
FastKernels (DDP), Lightning's fastkernels_ddp / fastkernels_fsdp and FastSFTTrainer give the losses and LoRA
gradients (or the weights after SGD steps) of one process on the same global batch; every rank is patched before
its model is wrapped and restored after.

All scenarios run in one torchrun launch (tests/integrations/distributed_worker.py): a launch costs imports and
process-group set-up, CI time that the scenarios themselves do not need.
"""

import importlib.util
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.helpers import rel_err
from tests.integrations import distributed_worker as worker

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

TOL = 1e-5  # fp32; only the order of the cross-rank sums differs from one process
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAS_TRL = all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))
SCENARIOS = ["ddp", "fsdp2", "fsdp2_bf16", "fsdp2_after", "ddp_offload", "trainer"]
SCENARIOS += ["lightning_ddp", "lightning_fsdp"] if HAS_LIGHTNING else []
SCENARIOS += ["sft", "grpo"] if HAS_TRL else []


@pytest.fixture(scope="module")
def runs():
    # not pytest's tmp_path: a concurrent pytest session of the same user may prune it while the workers write
    with tempfile.TemporaryDirectory(prefix="fastplug_distributed_") as out_dir:
        yield worker.launch(SCENARIOS, out_dir, timeout=400)


@pytest.fixture(scope="module")
def one_process():
    return worker.reference_loop("cpu")


@pytest.fixture(scope="module")
def one_lightning_process():
    return worker.reference_lightning("cpu")


def _patched_and_restored(ranks, fused_head=True):
    for rank, got in enumerate(ranks):
        assert got["restored"], f"rank {rank}: modules not restored"
        if fused_head:
            assert all(got["fused_head"]), f"rank {rank}: the fused LM-head loss did not run ({got['fused_head']})"


def _eager_inside_fsdp_hooks(ranks):
    """Each forward's layers went the CUDA graphs' routing (installed by the worker on CPU, where all of them run
    eagerly), inside FSDP2's hooks: the losses and gradients above show the hooks gathered and reduced once."""
    for rank, got in enumerate(ranks):
        assert got["layer_paths"] == {"a tensor off the GPU": worker.STEPS * worker.MICRO}, f"rank {rank}"


def _stacked_groups(ranks):
    return [got["stacked_groups"] for got in ranks]


def test_ddp_matches_one_process(runs, one_process):
    worker.assert_loop_matches(worker.ranks_of(runs, "ddp"), one_process, TOL)
    _patched_and_restored(worker.ranks_of(runs, "ddp"))
    assert all(_stacked_groups(worker.ranks_of(runs, "ddp"))), "DDP leaves the bases stacked (frozen, replicated)"


def test_fsdp2_matches_one_process_with_the_head_sharded_on_its_own(runs, one_process):
    """The LM head is an FSDP unit of its own (as accelerate makes it): the fused loss runs inside its call,
    where FSDP2 has gathered it."""
    worker.assert_loop_matches(worker.ranks_of(runs, "fsdp2"), one_process, TOL)
    _patched_and_restored(worker.ranks_of(runs, "fsdp2"))
    _eager_inside_fsdp_hooks(worker.ranks_of(runs, "fsdp2"))
    # FSDP2 refills each unit's storage at every gather: a stacked copy would keep the bases unsharded
    assert _stacked_groups(worker.ranks_of(runs, "fsdp2")) == [0, 0]


def test_patching_after_fsdp2_sharded_the_model(runs, one_process):
    """What a model_init model in the HF Trainer and a model sharded in Lightning's configure_model go through."""
    worker.assert_loop_matches(worker.ranks_of(runs, "fsdp2_after"), one_process, TOL)
    _patched_and_restored(worker.ranks_of(runs, "fsdp2_after"))
    _eager_inside_fsdp_hooks(worker.ranks_of(runs, "fsdp2_after"))


def test_fsdp2_bf16_base_with_fp32_adapters_matches_one_process(runs):
    """Fused LoRA casts the fp32 adapters to bf16 and caches the casts; FSDP2 frees each gathered adapter
    between uses, so the refresh must leave those alone."""
    one_process = worker.reference_loop("cpu", dtype=torch.bfloat16)
    worker.assert_bf16_loop_matches(worker.ranks_of(runs, "fsdp2_bf16"), one_process)
    _patched_and_restored(worker.ranks_of(runs, "fsdp2_bf16"))


def test_offload_checkpointing_under_ddp_finding_unused_parameters(runs, one_process):
    """find_unused_parameters=True is the HF Trainer's choice for a PeftModel; offload's recompute in backward
    used to make DDP mark the LoRA parameters ready twice."""
    worker.assert_loop_matches(worker.ranks_of(runs, "ddp_offload"), one_process, TOL)
    _patched_and_restored(worker.ranks_of(runs, "ddp_offload"))


def test_trainer_ddp_matches_one_process_and_patches_before_wrapping(runs):
    ranks = worker.ranks_of(runs, "trainer")
    one_process = worker.run_trainer("cpu", world=1, fsdp=False, checkpointing=True)
    worker.assert_training_matches(ranks, one_process, TOL)
    for rank, got in enumerate(ranks):
        assert got["patched_before_wrap"], f"rank {rank}: not patched at the end of Trainer.__init__"
        assert got["patched_steps"] == [True] * worker.STEPS
        assert got["restored"], f"rank {rank}: not restored after train()"
        assert "lm_head_loss: 1" in got["summary"] and "lora_fused: 4" in got["summary"]


def test_trainer_fsdp2_runs_on_gpus_only():
    pytest.skip(
        "accelerate shards with FSDP only on GPUs (with use_cpu=True the Trainer falls back to DDP); "
        "tests/gpu/test_distributed_gpu.py runs the Trainer with FSDP2 on 2 GPUs"
    )


@pytest.mark.skipif(not HAS_LIGHTNING, reason="needs lightning")
@pytest.mark.parametrize(
    ("scenario", "base"), [("lightning_ddp", "DDPStrategy"), ("lightning_fsdp", "ModelParallelStrategy")]
)
def test_lightning_strategies_match_one_process(runs, one_lightning_process, scenario, base):
    ranks = worker.ranks_of(runs, scenario)
    worker.assert_training_matches(ranks, one_lightning_process, TOL)
    for rank, got in enumerate(ranks):
        assert base in got["strategy_bases"]
        assert got["sharded"] == (scenario == "lightning_fsdp"), f"rank {rank}: FSDP2 units {got['sharded']}"
        assert got["patched_steps"] == [True] * worker.STEPS, f"rank {rank}: {got['patched_steps']}"
        assert got["restored"], f"rank {rank}: not restored at teardown"


@pytest.mark.skipif(not HAS_TRL, reason="needs trl and datasets")
def test_fast_sft_trainer_ddp_matches_trl(runs):
    for rank, got in enumerate(worker.ranks_of(runs, "sft")):
        assert got["fastplug"] == pytest.approx(got["trl"], rel=TOL), f"rank {rank}"
        assert got["restored"], f"rank {rank}: not restored after train()"
        assert "lora_fused: 4" in got["summary"]


@pytest.mark.skipif(not HAS_TRL, reason="needs trl and datasets")
def test_fast_grpo_trainer_ddp_matches_trl(runs):
    """Each rank rolls out its own prompts (fast_generate, greedy) as TRL's GRPOTrainer does on that rank; the logged
    losses and rewards, and the LoRA weights after DDP's averaged steps, are TRL's."""
    ranks = worker.ranks_of(runs, "grpo")
    for rank, got in enumerate(ranks):
        ours, theirs = got["fastplug"], got["trl"]
        assert len(ours["rollouts"]) == 2 and ours["rollouts"] == theirs["rollouts"], f"rank {rank}"
        assert ours["rollouts"][1] != ours["rollouts"][0], f"rank {rank}: the second rollout has the new adapters"
        for key in ("loss", "reward"):
            assert rel_err(ours[key], theirs[key]) < 1e-5, f"rank {rank}: {key}"
        assert ours["weights"].keys() == theirs["weights"].keys()
        for name, weight in ours["weights"].items():
            assert rel_err(weight, theirs["weights"][name]) < 1e-4, f"rank {rank}: {name}"
        assert got["restored"] and "rollouts: fastplug fast_generate" in got["summary"], f"rank {rank}"
    for step, (first, second) in enumerate(zip(*(got["fastplug"]["rollouts"] for got in ranks))):
        assert not first.keys() & second.keys(), f"rollout {step}: the ranks roll out different prompts"
    for name, weight in ranks[0]["fastplug"]["weights"].items():
        assert torch.equal(weight, ranks[1]["fastplug"]["weights"][name]), f"DDP keeps {name} equal on both ranks"
