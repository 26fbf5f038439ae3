"""`python -m fastplug.bench frameworks`: LoRA SFT through TRL and a Lightning fit, with and without fastplug.

Runs on the Llama-shaped model of the e2e bench (random init, bf16, LoRA r=16 on every linear layer,
non-reentrant checkpointing, pre-packed rows of `--seq` random token ids):
  sft                    trl.SFTTrainer
  fast_sft               fastplug.integrations.trl.FastSFTTrainer (default KernelOptions)
  sft_packed, fast_sft_packed   the same on documents of random lengths that TRL packs (padding-free)
  trainer                transformers.Trainer on e2e's peft model
  trainer_fastkernels    the same with callbacks=[FastKernels()]
  trainer_compile, trainer_compile_fastkernels   both with TrainingArguments(torch_compile=True)
  trainer_fastkernels_graphs, trainer_compile_fastkernels_graphs   FastKernels(cuda_graphs=True)
  trainer_fastkernels_auto   FastKernels(gradient_checkpointing="auto")
  lightning              L.Trainer(strategy="auto"), the model's own checkpointing on
  lightning_fastkernels  L.Trainer(strategy="fastkernels")

Each run trains in a fresh worker process (e2e's `run_worker`). A callback synchronizes the device and times
every optimizer step; tokens/s = batch * seq / median step time after `--warmup` steps; peak memory is
max_memory_allocated from the start of training (weights included). TRL gets the plain model and wraps it
with peft itself (adapters in fp32, bf16 autocast); Lightning gets e2e's peft model and, with
precision "bf16-true", casts the adapters to bf16 too. So compare each fast run with its own baseline only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from ._report import short_error, write_csv
from .e2e import (
    LOSS_TOLERANCE,
    TINY_BATCH,
    TINY_SEQ,
    build_model,
    default_device,
    parse_list,
    print_table,
    run_worker,
    sync_device,
    token_batches,
    worker_deadline,
)
from .presets import MODELS

RUNS = (
    "sft",
    "fast_sft",
    "sft_packed",
    "fast_sft_packed",
    "trainer",
    "trainer_fastkernels",
    "trainer_compile",
    "trainer_compile_fastkernels",
    "trainer_fastkernels_graphs",
    "trainer_compile_fastkernels_graphs",
    "trainer_fastkernels_auto",
    "lightning",
    "lightning_fastkernels",
)
BASELINE = {
    "fast_sft": "sft",
    "fast_sft_packed": "sft_packed",
    "trainer_fastkernels": "trainer",
    "trainer_compile_fastkernels": "trainer_compile",
    "trainer_fastkernels_graphs": "trainer",
    "trainer_compile_fastkernels_graphs": "trainer_compile",
    "trainer_fastkernels_auto": "trainer",
    "lightning_fastkernels": "lightning",
}
MODEL = "llama"
COLUMNS = ("run", "batch x seq", "tok/s", "vs baseline", "peak GiB", "step ms", "losses (first 3)", "note")


# --- the worker: one run in its own process ---------------------------------------------------------


class StepTimer:
    """Synchronized wall time of each training step (and its loss, when given); says when the deadline passed."""

    def __init__(self, device, deadline: float):
        self.device, self.deadline = device, deadline
        self.times, self.losses = [], []
        self._start = None

    def begin(self) -> None:
        sync_device(self.device)
        self._start = time.perf_counter()

    def end(self, loss=None) -> bool:
        """Records the step; True when the run should stop to keep what it measured (the deadline passed)."""
        sync_device(self.device)
        self.times.append(time.perf_counter() - self._start)
        if loss is not None:
            self.losses.append(float(loss))
        return time.perf_counter() > self.deadline


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _tiny_tokenizer():
    """TRL wants a processing class with a pad token; the rows are token ids already, so nothing is tokenized."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
    )  # fmt: skip


def _model_and_rows(spec, device, peft: bool):
    """e2e's model (fp32 on CPU, where bf16 autocast is off) and warmup + steps batches of token ids (on CPU)."""
    model = build_model(MODEL, spec["tiny"], device, spec["seed"])
    if not peft:
        model = model.unload()  # the same base weights; TRL adds its own LoRA from peft_config
    if device.type == "cpu":
        model = model.float()
    count = spec["warmup"] + spec["steps"]
    batches = token_batches(model.config.vocab_size, spec["batch"], spec["seq"], count, spec["seed"], "cpu")
    return model, batches


def _documents(batches, seq: int, seed: int) -> list[list[int]]:
    """The rows' tokens cut into documents of random lengths (16 to seq tokens) for TRL to pack."""
    import torch

    tokens = torch.cat(batches).flatten().tolist()
    gen = torch.Generator().manual_seed(seed + 3)
    docs, at = [], 0
    while at < len(tokens):
        n = int(torch.randint(min(16, seq), seq + 1, (1,), generator=gen))
        docs.append(tokens[at : at + n])
        at += n
    return docs


def run_sft(spec: dict, device, fast: bool, packed: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from ..models.structure import unwrap

    model, batches = _model_and_rows(spec, device, peft=False)
    if packed:
        # Documents of random lengths, packed by TRL (bfd: padding-free rows, position_ids restarting per
        # document). No KV cache: with one, transformers would not look for the documents and would attend
        # across them, and the two runs' losses would not compare.
        dataset = Dataset.from_dict({"input_ids": _documents(batches, spec["seq"], spec["seed"])})
        model.config.use_cache = False
    else:
        # Pre-packed: every row is exactly seq tokens, so TRL neither tokenizes, packs nor pads.
        dataset = Dataset.from_dict({"input_ids": torch.cat(batches).tolist()})
    config = SFTConfig(**_training_args(spec, device, "sft"), packing=packed, max_length=spec["seq"])
    lora = LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, target_modules=MODELS[MODEL]["lora"], task_type="CAUSAL_LM"
    )  # every linear layer but the LM head, as in build_model
    timer = StepTimer(device, worker_deadline(spec))
    kwargs = dict(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=_tiny_tokenizer(),
        peft_config=lora,
        callbacks=[_timing_callback(timer, device)],
    )
    if fast:
        from ..integrations.trl import FastSFTTrainer

        trainer = FastSFTTrainer(**kwargs)
        note = _counts_note(trainer.fast_kernel_handles) + "; " + _loss_path_line(trainer.fast_kernels_summary)
    else:
        trainer = SFTTrainer(**kwargs)
        fused_head = "forward" in vars(unwrap(trainer.model))
        note = "loss path: " + ("TRL's fused LM head" if fused_head else "the model's own forward")
    return _result(spec, device, _train(trainer, timer), note)


def _training_args(spec: dict, device, name: str) -> dict:
    """The TrainingArguments (and SFTConfig) settings every Trainer run shares; optim left at its default,
    adamw_torch_fused, as users run it."""
    on_gpu = device.type == "cuda"
    return dict(
        output_dir=tempfile.mkdtemp(prefix=f"fastplug_bench_{name}_"), per_device_train_batch_size=spec["batch"],
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=on_gpu,
        use_cpu=not on_gpu, max_steps=spec["warmup"] + spec["steps"], logging_steps=1, report_to=[],
        save_strategy="no", learning_rate=1e-4, dataloader_num_workers=0, seed=spec["seed"], disable_tqdm=True,
    )  # fmt: skip


def _train(trainer, timer: StepTimer) -> StepTimer:
    """Runs a transformers/TRL trainer; the timer gets the losses it logged (every step)."""
    trainer.train()
    timer.losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return timer


def _timing_callback(timer: StepTimer, device):
    """A transformers TrainerCallback that times every optimizer step with `timer` (peak memory from the start)."""
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            _reset_peak(device)

        def on_step_begin(self, args, state, control, **kwargs):
            timer.begin()

        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = timer.end() or control.should_training_stop

    return Timing()


def run_trainer(spec: dict, device, fast: bool, compiled: bool, options: dict | None = None) -> dict:
    """transformers' Trainer on e2e's peft model (adapters in fp32, bf16 autocast), the default collator and
    optimizer (fused AdamW); fast adds callbacks=[FastKernels(**options)], compiled sets torch_compile=True."""
    import torch
    from transformers import Trainer, TrainingArguments

    model, batches = _model_and_rows(spec, device, peft=True)  # build_model turned checkpointing on
    dataset = [{"input_ids": row, "labels": row} for row in torch.cat(batches)]
    args = TrainingArguments(**_training_args(spec, device, "trainer"), torch_compile=compiled)
    timer = StepTimer(device, worker_deadline(spec))
    callbacks = [_timing_callback(timer, device)]
    if fast:
        from ..integrations.hf_trainer import FastKernels

        callbacks.append(FastKernels(**(options or {})))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    _train(trainer, timer)
    note = _counts_note([callbacks[-1].handle]) if fast else "model's own checkpointing and loss"
    return _result(spec, device, timer, note + ("; torch_compile=True" if compiled else ""))


def run_lightning(spec: dict, device, fast: bool) -> dict:
    import lightning.pytorch as L
    import torch

    model, batches = _model_and_rows(spec, device, peft=True)  # build_model turned checkpointing on
    timer = StepTimer(device, worker_deadline(spec))
    patched = {}

    class CausalLM(L.LightningModule):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def training_step(self, batch, batch_idx):
            return self.lm(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Timing(L.Callback):
        def on_train_start(self, trainer, pl_module):
            _reset_peak(device)
            # The strategy restores the model in teardown: read what it patched while training.
            patched["note"] = _counts_note(getattr(trainer.strategy, "fast_kernel_handles", []))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            timer.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if timer.end(outputs["loss"].item()):
                trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision="bf16-true" if device.type == "cuda" else "32-true", max_steps=spec["warmup"] + spec["steps"],
        strategy="fastkernels" if fast else "auto", callbacks=[Timing()], enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    # batch_size=None: each item already is a [batch, seq] batch.
    trainer.fit(CausalLM(model), torch.utils.data.DataLoader(batches, batch_size=None))
    return _result(spec, device, timer, patched.get("note", "") if fast else "model's own checkpointing and loss")


def _counts_note(handles) -> str:
    counts = {}
    for handle in handles:
        for name, n in handle.counts.items():
            counts[name] = counts.get(name, 0) + n
    skipped = sum(len(h.skipped) for h in handles)
    note = "patched " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "nothing patched"
    return note + (f"; {skipped} skipped" if skipped else "")


def _loss_path_line(summary: str) -> str:
    """The summary's "loss path:" line, up to its first clause (the rest explains it)."""
    line = next((s.strip() for s in summary.splitlines() if "loss path:" in s), "loss path: ?")
    return line.split(" (")[0]


def _result(spec, device, timer: StepTimer, note: str) -> dict:
    import torch

    if not timer.times:
        raise RuntimeError("no training step ran")
    measured = timer.times[spec["warmup"] :] or timer.times[-1:]
    median = statistics.median(measured)
    return dict(
        step_ms=median * 1e3, tokens_per_s=spec["batch"] * spec["seq"] / median, losses=timer.losses[:3],
        measured_steps=len(measured), all_step_ms=[round(t * 1e3, 1) for t in timer.times], note=note,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    )  # fmt: skip


def worker_main(spec_json: str, result_path: str) -> int:
    import torch

    spec = json.loads(spec_json)
    print(f"\n== frameworks / {spec['run']} ==", flush=True)
    device = torch.device(spec["device"])
    try:
        run = spec["run"]
        if run in ("sft", "fast_sft", "sft_packed", "fast_sft_packed"):
            result = run_sft(spec, device, fast=run.startswith("fast"), packed=run.endswith("packed"))
        elif run.startswith("trainer"):
            options = {"graphs": dict(cuda_graphs=True), "auto": dict(gradient_checkpointing="auto")}
            result = run_trainer(
                spec,
                device,
                fast="fastkernels" in run,
                compiled="compile" in run,
                options=options.get(run.rpartition("_")[2]),
            )
        else:
            result = run_lightning(spec, device, fast=run == "lightning_fastkernels")
        print(f"step ms: {result['all_step_ms']}\nlosses: {result['losses']}", flush=True)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"error": short_error(exc)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# --- the parent: one worker per run, then the table -------------------------------------------------


def _rel_loss_diff(losses, base) -> float:
    n = min(len(losses), len(base))
    return max((abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses[:n], base[:n])), default=0.0)


def frameworks_rows(args, runs, device, save) -> list[dict]:
    preset = MODELS[MODEL]
    batch = args.batch or (TINY_BATCH if args.tiny else preset["batch"])
    seq = args.seq or (TINY_SEQ if args.tiny else preset["seq"])
    rows, results = [], {}
    for run in runs:
        # "bench" routes the `_worker` command of fastplug.bench to this module's worker_main.
        spec = dict(
            bench="frameworks",
            run=run,
            tiny=args.tiny,
            device=device,
            seed=args.seed,
            batch=batch,
            seq=seq,
            steps=args.steps,
            warmup=args.warmup,
        )
        res = run_worker(spec, args.time_limit)
        row = {"run": run, "batch x seq": f"{batch}x{seq}" + (" (tiny)" if args.tiny else "")}
        rows.append(row)
        if "error" in res:
            row["note"] = res["error"]
            save(rows)
            continue
        results[run] = res
        row.update(
            {
                "tok/s": res["tokens_per_s"],
                "peak GiB": res["peak_gib"],
                "step ms": res["step_ms"],
                "losses": res["losses"],
                "losses (first 3)": " ".join(f"{x:.4f}" for x in res["losses"]),
            }
        )
        notes = [res["note"]]
        if res["measured_steps"] < args.steps:
            notes.append(f"only {res['measured_steps']} measured steps (time limit)")
        base = results.get(BASELINE.get(run))
        if base:
            row["vs baseline"] = res["tokens_per_s"] / base["tokens_per_s"]
            diff = _rel_loss_diff(res["losses"], base["losses"])
            notes.append(f"loss diff {diff:.1e}")
            if not diff <= LOSS_TOLERANCE:
                notes.append("LOSSES DISAGREE")
        row["note"] = "; ".join(n for n in notes if n)
        save(rows)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench frameworks", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {','.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument("--batch", type=int, default=None, help=f"batch size (default {MODELS[MODEL]['batch']})")
    parser.add_argument("--seq", type=int, default=None, help=f"tokens per packed row (default {MODELS[MODEL]['seq']})")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per run (hard)")
    parser.add_argument("--tiny", action="store_true", help="e2e's tiny Llama (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out", help="folder for the CSV")
    args = parser.parse_args(argv)

    runs = parse_list(args.runs, RUNS, "--runs")
    device = default_device()
    if device == "cpu" and not args.tiny:
        parser.error("without a GPU only --tiny runs")
    print(f"frameworks bench on {device}: {MODEL} LoRA r=16, checkpointing, runs {', '.join(runs)}", flush=True)

    csv_path = os.path.join(args.out, "frameworks.csv")
    rows = frameworks_rows(args, runs, device, lambda rows: write_csv(csv_path, rows, COLUMNS))
    print(f"\ncsv: {csv_path}\n")
    print_table(rows, COLUMNS)
    bad = [r for r in rows if r["run"] in BASELINE and ("tok/s" not in r or "DISAGREE" in r.get("note", ""))]
    return 1 if bad else 0
