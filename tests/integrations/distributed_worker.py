"""One rank of the multi-process tests (tests/integrations/test_distributed.py on CPU with gloo,
tests/gpu/test_distributed_gpu.py on 2 GPUs with NCCL):

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.integrations.distributed_worker \
        SCENARIO[,SCENARIO...] OUT_DIR [--device cuda] [--checkpointing offload]

Scenarios: ddp, fsdp2 (patch_model, then torch's DDP / FSDP2 `fully_shard`), fsdp2_bf16 (a bf16 base with fp32
adapters: gathered parameters that FSDP2 frees again, and fused LoRA's cached casts), fsdp2_after (patched after
sharding), ddp_offload (checkpointing "offload" under DDP with find_unused_parameters=True), trainer,
trainer_fsdp2 (HF Trainer + FastKernels, through accelerate), trainer_fsdp2_presharded (the model sharded per
layer before the Trainer), lightning_ddp, lightning_fsdp (fastplug's strategies), sft, sft_fsdp2 (FastSFTTrainer
and TRL's own SFTTrainer), grpo (FastGRPOTrainer and TRL's own GRPOTrainer under DDP). Each rank saves
OUT_DIR/SCENARIO.rank<R>.pt; the tests compare it with one process on the same global batch (`reference_*` below,
run in the test's process), or the fastplug trainer with TRL's own in the same processes (sft, grpo).

The model is a small Llama with peft LoRA on every linear layer (fused LoRA path), fp32 so that distributed and
single-process numbers agree to rounding; gradient accumulation over 2 micro-batches whose ranks hold different
numbers of label tokens, so the loss scaling by `num_items_in_batch` across ranks is what makes them agree.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from fastplug import FastKernels, KernelOptions
from fastplug.models import stacking
from fastplug.patch.engine import active_handle, patch_model
from tests.models.tiny import tiny_model

STEPS = 2
MICRO = 2  # micro-batches per optimizer step
GLOBAL_ROWS = 4  # rows per micro-batch over all ranks (2 per rank with 2 processes, 4 in one)
LR = 0.5  # SGD: large enough that a wrong gradient shows in the second step's loss
# CPU runs the Triton interpreter: the tiny model; on GPUs a bigger one with fastplug's attention kernel.
SHAPES = {
    "cpu": dict(overrides={}, seq=12),
    "cuda": dict(
        overrides=dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            vocab_size=1024,
            max_position_embeddings=512,
        ),
        seq=192,
    ),
}
# transformers 5.17 and 5.23 both read "version" (default 2); fsdp=True, the string form is deprecated
FSDP2_CONFIG = {"version": 2, "reshard_after_forward": True}
SCENARIOS = (
    "ddp",
    "fsdp2",
    "fsdp2_bf16",
    "fsdp2_after",
    "ddp_offload",
    "trainer",
    "trainer_fsdp2",
    "trainer_fsdp2_presharded",
    "lightning_ddp",
    "lightning_fsdp",
    "sft",
    "sft_fsdp2",
    "grpo",
)


def options(kind: str, checkpointing=True) -> KernelOptions:
    # the interpreter runs the attention kernel too slowly for CI; on GPUs it is part of what is tested.
    # Stacked q/k/v and gate/up bases, as the trainer adapters run (never inside FSDP2 units).
    return KernelOptions(attention=kind == "cuda", gradient_checkpointing=checkpointing, stack_projections=True)


def lora_llama(kind: str, device="cpu", dtype=torch.float32):
    """dtype bfloat16: a bf16 base with peft's default fp32 adapters (fused LoRA then casts them per step)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", **SHAPES[kind]["overrides"]).to(dtype)
    # init_lora_weights=False: a random lora_B, so lora_A gets gradients from the first step
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, config).to(device)


def rows(kind: str, count: int, uniform: bool = False, seed: int = 5, right_pad: bool = False) -> dict:
    """`count` rows: input_ids, attention_mask, labels. Left padding of different lengths (unless `uniform`), so
    that ranks holding different rows hold different numbers of label tokens. right_pad: the same pads at the
    end (bf16 on CUDA: a left pad's query rows see no key, and SDPA's bf16 backward turns such fully masked
    rows into NaN gradients, in plain transformers as well)."""
    seq, vocab = SHAPES[kind]["seq"], SHAPES[kind]["overrides"].get("vocab_size", 128)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (count, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    if not uniform:
        for i in range(count):  # even rows (rank 0's, rows are dealt rank::world) are padded much more
            pad = seq // 2 if i % 2 == 0 else i % 3
            padded = slice(seq - pad, seq) if right_pad else slice(0, pad)
            attention_mask[i, padded] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, seq // 3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def micro_batches(kind: str, dtype=torch.float32) -> list[dict]:
    """MICRO global micro-batches of GLOBAL_ROWS rows each; rank r of `world` takes rows r::world. Right-padded
    rows for a bf16 model (see `rows`)."""
    data = rows(kind, MICRO * GLOBAL_ROWS, right_pad=dtype == torch.bfloat16)
    return [{k: v[i * GLOBAL_ROWS : (i + 1) * GLOBAL_ROWS] for k, v in data.items()} for i in range(MICRO)]


def full(t: torch.Tensor) -> torch.Tensor:
    """A gathered CPU copy of a tensor (DTensor shards included: a collective, every rank calls it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def train_loop(model, call, micro, rank: int, world: int, device, no_sync=None) -> dict:
    """STEPS optimizer steps of MICRO micro-batches: each rank's loss is its sum over the global label count
    (`num_items_in_batch`, as the Trainer passes it), times `world` because DDP and FSDP2 average gradients."""
    params = lora_params(model)
    optimizer = torch.optim.SGD(list(params.values()), lr=LR)
    out = {"losses": [], "grads": [], "fused_head": []}
    for _ in range(STEPS):
        n_items = torch.tensor(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro), device=device)
        total = torch.zeros((), device=device)
        for i, mb in enumerate(micro):
            local = {k: v[rank::world].to(device) for k, v in mb.items()}
            last = i == len(micro) - 1
            with no_sync() if no_sync is not None and not last else nullcontext():
                result = call(**local, num_items_in_batch=n_items)
                (result.loss * world).backward()
            total += result.loss.detach()
            out["fused_head"].append(result.logits is None)
        if world > 1:
            dist.all_reduce(total)
        out["losses"].append(total.item())
        out["grads"].append({n: full(p.grad) for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def no_instance_forward(model) -> bool:
    return not any("forward" in vars(m) for m in model.modules())


def reference_loop(kind: str, device="cpu", dtype=torch.float32) -> dict:
    """One process, the whole global batch: what every distributed run must reproduce."""
    model = lora_llama(kind, device, dtype)
    model.train()
    with patch_model(model, options(kind)):
        return train_loop(model, model, micro_batches(kind, dtype), 0, 1, torch.device(device))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    scenarios: list[str],
    out_dir,
    device: str = "cpu",
    nproc: int = 2,
    timeout: float = 300,
    extra: tuple = (),
    launcher: str = "torchrun",
) -> dict:
    """Runs the scenarios in `nproc` fresh processes; returns {scenario: [rank 0's result, rank 1's, ...]}, or
    for a scenario without results what went wrong (the end of the log): one failing scenario does not hide the
    ones that ran before it. launcher "torchrun" (--standalone picks a free port) or "accelerate" (`accelerate
    launch --multi_gpu`, GPUs only: on CPU it starts one process)."""
    import subprocess

    worker = ["-m", "tests.integrations.distributed_worker", ",".join(scenarios), str(out_dir), "--device", device,
              *extra]  # fmt: skip
    if launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
               f"--main_process_port={_free_port()}", *worker]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *worker]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = proc.communicate(timeout=timeout)
        problem = f"exited with {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes it on to its workers; a kill would leave them holding the devices
        try:
            log = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()
        problem = f"timed out after {timeout:.0f} s"
    results = {}
    for s in scenarios:
        paths = [os.path.join(out_dir, f"{s}.rank{r}.pt") for r in range(nproc)]
        if all(os.path.exists(path) for path in paths):
            results[s] = [torch.load(path) for path in paths]
        else:
            results[s] = f"{s}: no results; {' '.join(cmd)} {problem or 'wrote none'}:\n{_tail(*log)}"
    return results


def ranks_of(runs: dict, scenario: str) -> list[dict]:
    """The per-rank results of a scenario from `launch`, or the test fails with the launch's log."""
    got = runs[scenario]
    if isinstance(got, str):
        raise AssertionError(got)
    return got


def assert_close_dicts(got: dict, want: dict, what: str, tol: float) -> None:
    from tests.helpers import rel_err

    assert got.keys() == want.keys(), f"{what}: parameters differ"
    errors = {name: rel_err(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, f"{what}: {worst} relative error {errors[worst]:.2e} >= {tol:.0e}"


def assert_loop_matches(ranks: list[dict], reference: dict, tol: float) -> None:
    """Every rank: the global losses and LoRA gradients of each step are one process' (train_loop results)."""
    from tests.helpers import rel_err

    for rank, got in enumerate(ranks):
        err = rel_err(torch.tensor(got["losses"]), torch.tensor(reference["losses"]))
        assert err < tol, f"rank {rank}: losses {got['losses']} vs one process {reference['losses']}"
        for step, (grads, ref) in enumerate(zip(got["grads"], reference["grads"])):
            assert_close_dicts(grads, ref, f"rank {rank}, step {step + 1}, LoRA gradients", tol)


def assert_bf16_loop_matches(ranks: list[dict], reference: dict) -> None:
    """bf16: the first step's gradients within bf16 rounding, every step's loss within 1e-3. After an SGD step
    of LR the rounding differences of two row splits grow past bf16's tolerance (DDP and FSDP2 agree with each
    other, not with one process); a stale adapter cast would move the second loss by about 1e-2."""
    from tests.helpers import rel_err

    for rank, got in enumerate(ranks):
        err = rel_err(torch.tensor(got["losses"]), torch.tensor(reference["losses"]))
        assert err < 1e-3, f"rank {rank}: losses {got['losses']} vs one process {reference['losses']}"
        # bf16's bound for gradients (tests/helpers.TOL x 2.5, the self-check's policy): two row splits' sums
        # round apart by 2.0e-2 on lora_A of a v_proj (2026-11-26, torch 2.13 CPU)
        assert_close_dicts(got["grads"][0], reference["grads"][0], f"rank {rank}, step 1, LoRA gradients", 2.5e-2)


def assert_training_matches(ranks: list[dict], reference: dict, tol: float) -> None:
    """Every rank: the logged losses and the LoRA weights after training are one process' (trainer results)."""
    from tests.helpers import rel_err

    for rank, got in enumerate(ranks):
        assert len(got["losses"]) == len(reference["losses"]) == STEPS
        err = rel_err(torch.tensor(got["losses"]), torch.tensor(reference["losses"]))
        assert err < tol, f"rank {rank}: losses {got['losses']} vs one process {reference['losses']}"
        assert_close_dicts(got["weights"], reference["weights"], f"rank {rank}, LoRA weights after training", tol)


def _tail(*texts, limit: int = 6000) -> str:
    text = "\n".join(t if isinstance(t, str) else (t or b"").decode(errors="replace") for t in texts)
    lines = [line for line in text.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    return "\n".join(lines)[-limit:]


# ------------------------------------------------------------------------------------------ scenarios
def _offload_on_cpu(model) -> None:
    """What checkpointing "offload" installs (it needs CUDA; its autograd function runs on CPU tensors too)."""
    from fastplug.patch import checkpointing

    offload = checkpointing.OffloadCheckpoint()
    for layer in checkpointing.decoder_layers(model):
        layer._gradient_checkpointing_func = offload


def _layer_graphs_on_cpu(model):
    """The CUDA graphs' routing of the decoder layers, which patch_model installs on GPUs only: on CPU every
    layer call goes the graphs' eager way (a tensor off the GPU), inside FSDP2's hooks, as a first sighting
    does on a GPU."""
    from fastplug.models.structure import decoder_layers, decoder_stack
    from fastplug.patch.layer_graphs import LayerGraphs

    return LayerGraphs(decoder_stack(model), decoder_layers(model))


def run_torch(kind, device, rank, world, how, checkpointing) -> dict:
    from fastplug.integrations.fsdp import shard_model

    dtype = torch.bfloat16 if how == "fsdp2_bf16" else torch.float32
    model = lora_llama(kind, device, dtype)
    model.train()
    offload = how == "ddp_offload"
    if how == "fsdp2_after":  # a model_init model in the HF Trainer, or one sharded in configure_model
        shard_model(model)
    handle = patch_model(model, options(kind, "offload" if offload else checkpointing))  # else before wrapping
    if offload and kind == "cpu":
        _offload_on_cpu(model)
    if how.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # find_unused_parameters=True: what the HF Trainer passes for a PeftModel
        wrapped = DDP(
            model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=offload
        )
        out = train_loop(model, wrapped, micro_batches(kind, dtype), rank, world, device, no_sync=wrapped.no_sync)
    else:
        shard_model(model)  # a no-op for fsdp2_after
        graphs = _layer_graphs_on_cpu(model) if device.type == "cpu" else None
        out = train_loop(model, model, micro_batches(kind, dtype), rank, world, device)
        if graphs is not None:
            out["layer_paths"] = dict(graphs.eager)
            graphs.remove()
    out["summary"] = handle.summary()
    out["stacked_groups"] = sum(g.stacked is not None for g in stacking._GROUPS.values())
    handle.restore()
    out["restored"] = active_handle(model) is None and no_instance_forward(model)
    return out


def _probe():
    """A TrainerCallback that records whether the model is sharded at train begin and patched at each step."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self):
            self.patched, self.wrapped_at_begin = [], None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.wrapped_at_begin = _is_wrapped(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.patched.append(active_handle(model) is not None)

    return Probe()


def _fsdp_units(model) -> list[str]:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return [type(m).__name__ for m in model.modules() if fsdp is not None and isinstance(m, fsdp.FSDPModule)]


def _is_wrapped(model) -> bool:
    return bool(_fsdp_units(model))


def trainer_dataset(kind: str) -> list[dict]:
    data = rows(kind, STEPS * MICRO * GLOBAL_ROWS)
    return [{k: v[i] for k, v in data.items()} for i in range(len(data["input_ids"]))]


def trainer_args(kind: str, out_dir: str, per_device: int, fsdp: bool):
    from transformers import TrainingArguments

    fsdp_args = dict(fsdp=True, fsdp_config=FSDP2_CONFIG) if fsdp else {}
    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=MICRO,
        max_steps=STEPS, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=kind == "cpu", seed=0, disable_tqdm=True, train_sampling_strategy="sequential",
        ddp_timeout=120, **fsdp_args,
    )  # fmt: skip


def run_trainer(kind, world, fsdp, checkpointing, preshard_on=None) -> dict:
    """The HF Trainer with FastKernels; with world=1 (one process, GLOBAL_ROWS per device) the reference: each
    optimizer step sees the same samples (sequential sampling; accelerate deals batches to ranks in turn).

    preshard_on (a device): the model is sharded per decoder layer before the Trainer sees it. For a PeftModel the
    Trainer hands accelerate peft's FSDP1 wrap policy, which accelerate's FSDP2 cannot apply (no decoder-layer
    units: the whole decoder is gathered at once); accelerate keeps a model that is sharded already."""
    from transformers import Trainer

    model = lora_llama(kind)
    if preshard_on is not None:
        from fastplug.integrations.fsdp import shard_model

        shard_model(model.to(preshard_on))
    fast, probe = FastKernels(options(kind, checkpointing)), _probe()
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(
            model=model,
            args=trainer_args(kind, out_dir, GLOBAL_ROWS // world, fsdp),
            train_dataset=trainer_dataset(kind),
            callbacks=[fast, probe],
        )
        patched_before_wrap = active_handle(model) is not None and not _is_wrapped(model)
        trainer.train()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": {n: full(p) for n, p in lora_params(model).items()},
        "patched_before_wrap": patched_before_wrap,
        "wrapped_at_begin": probe.wrapped_at_begin,
        "fsdp_units": _fsdp_units(model),
        "patched_steps": probe.patched,
        "summary": fast.summary,
        "restored": fast.handle is not None and not fast.handle.is_active and no_instance_forward(model),
    }


def lightning_module(kind: str):
    import lightning.pytorch as L

    class LoraLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = lora_llama(kind)
            self.losses, self.patched = [], []

        def training_step(self, batch, batch_idx):
            self.patched.append(active_handle(self.lm) is not None)
            loss = self.lm(**batch).loss
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

    return LoraLM()


def lightning_fit(kind: str, strategy, devices: int, batch_size: int, checkpointing=True):
    """Lightning's per-rank loss is the mean over its rows: rows of equal label counts make the DDP average of
    those means the global mean."""
    import lightning.pytorch as L

    data = rows(kind, STEPS * GLOBAL_ROWS, uniform=True)
    samples = [{k: v[i] for k, v in data.items()} for i in range(len(data["input_ids"]))]
    module = lightning_module(kind)
    if isinstance(strategy, str) and strategy.startswith("fastkernels"):
        from lightning.pytorch import strategies

        from fastplug.integrations.lightning import strategy_classes

        strategy = strategy_classes(strategies)[strategy](options=options(kind, checkpointing))
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if kind == "cuda" else "cpu", devices=devices, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    # Lightning's own distributed sampler shuffles; rows in order (rank r: r::world) match one process' batches
    sampler = torch.utils.data.DistributedSampler(samples, shuffle=False) if devices > 1 else None
    trainer.fit(module, torch.utils.data.DataLoader(samples, batch_size=batch_size, sampler=sampler))
    return module, trainer


def run_lightning(kind, world, strategy_name, checkpointing) -> dict:
    module, trainer = lightning_fit(kind, strategy_name, world, GLOBAL_ROWS // world, checkpointing)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return {
        "losses": (losses / world).tolist(),
        "weights": {n: full(p) for n, p in lora_params(module.lm).items()},
        "patched_steps": module.patched,
        "strategy_bases": [c.__name__ for c in type(trainer.strategy).__mro__],
        "summary": trainer.strategy.fast_kernels_summary,
        "sharded": _is_wrapped(module.lm),
        "restored": active_handle(module.lm) is None and no_instance_forward(module.lm),
    }


def reference_lightning(kind: str) -> dict:
    module, _ = lightning_fit(kind, "fastkernels", 1, GLOBAL_ROWS)
    return {
        "losses": [x.item() for x in module.losses],
        "weights": {n: full(p) for n, p in lora_params(module.lm).items()},
    }


def run_sft(kind, world, fsdp, checkpointing) -> dict:
    """FastSFTTrainer, then TRL's SFTTrainer, on the same data: the same losses (TRL computes the loss in its own
    fused LM head; fastplug patches the layers underneath)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from fastplug.integrations.trl import FastSFTTrainer
    from tests.integrations.test_trl import TOKENIZER  # pad 0 as the model's; the data is tokenized already

    data = rows(kind, STEPS * GLOBAL_ROWS, uniform=True)
    dataset = Dataset.from_dict({"input_ids": data["input_ids"].tolist()})
    results = {}
    for name, cls in (("fastplug", FastSFTTrainer), ("trl", SFTTrainer)):
        model = lora_llama(kind)
        extra = {"options": options(kind, checkpointing)} if cls is FastSFTTrainer else {}
        fsdp_args = dict(fsdp=True, fsdp_config=FSDP2_CONFIG) if fsdp else {}
        with tempfile.TemporaryDirectory() as out_dir:
            args = SFTConfig(
                output_dir=out_dir, per_device_train_batch_size=GLOBAL_ROWS // world, max_steps=STEPS,
                learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=kind == "cpu",
                seed=0, disable_tqdm=True, bf16=False, gradient_checkpointing=True,
                train_sampling_strategy="sequential", ddp_timeout=120, **fsdp_args,
            )  # fmt: skip
            trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=TOKENIZER, **extra)
            trainer.train()
        results[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if cls is FastSFTTrainer:
            results["summary"] = trainer.fast_kernels_summary
            results["restored"] = not trainer.fast_kernel_handles and active_handle(model) is None
    return results


def run_grpo() -> dict:
    """FastGRPOTrainer, then TRL's GRPOTrainer, under DDP on the same prompts: each rank's rollouts (its own prompts'
    completions, from fast_generate with the live adapters), the logged losses and rewards (gathered across ranks by
    TRL) and the LoRA weights after the steps (DDP's averaged gradients)."""
    from trl import GRPOTrainer

    from fastplug.integrations.trl import FastGRPOTrainer
    from tests.integrations.test_grpo import ROLLOUTS_ONLY, grpo_args, logged, train

    results = {}
    for name, cls in (("fastplug", FastGRPOTrainer), ("trl", GRPOTrainer)):
        torch.manual_seed(0)
        extra = {"options": ROLLOUTS_ONLY} if cls is FastGRPOTrainer else {}
        with tempfile.TemporaryDirectory() as out_dir:
            # fp32: the second rollout, with the stepped adapters, must match token for token, and under bf16 the
            # two first updates round apart and the greedy tokens after them with them (as in test_grpo)
            args = grpo_args(out_dir, per_device_train_batch_size=2, bf16=False)
            trainer, recorded = train(cls, args, **extra)
        results[name] = {
            "rollouts": recorded.rollouts,
            "loss": logged(trainer, "loss"),
            "reward": logged(trainer, "reward"),
            "weights": {n: full(p) for n, p in lora_params(trainer.model).items()},
        }
        if cls is FastGRPOTrainer:
            results["summary"] = trainer.fast_kernels_summary
            results["restored"] = active_handle(trainer.model) is None
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", help=f"comma-separated, run in turn in these processes: {', '.join(SCENARIOS)}")
    parser.add_argument("out_dir")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--checkpointing", default="on", choices=("on", "off", "offload"))
    args = parser.parse_args(argv)
    checkpointing = {"on": True, "off": False, "offload": "offload"}[args.checkpointing]
    kind = args.device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    # The trainers join this process group (accelerate and Lightning reuse an initialized one).
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", timeout=timedelta(seconds=120))
    for s in args.scenarios.split(","):
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
        torch.manual_seed(0)
        if s in ("ddp", "fsdp2", "fsdp2_bf16", "fsdp2_after", "ddp_offload"):
            result = run_torch(kind, device, rank, world, s, checkpointing)
        elif s.startswith("trainer"):
            preshard_on = device if s == "trainer_fsdp2_presharded" else None
            result = run_trainer(kind, world, s != "trainer", checkpointing, preshard_on)
        elif s in ("lightning_ddp", "lightning_fsdp"):
            result = run_lightning(kind, world, "fastkernels_" + s.split("_")[1], checkpointing)
        elif s == "grpo":
            result = run_grpo()
        else:
            result = run_sft(kind, world, s == "sft_fsdp2", checkpointing)
        torch.save(result, os.path.join(args.out_dir, f"{s}.rank{rank}.pt"))
        print(f"distributed_worker: rank {rank} finished {s}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
