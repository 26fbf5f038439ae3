"""`python -m fastplug.bench varlen`: LoRA SFT on variable-length real text, as users train.

Documents are cut from the Python standard library's sources (every machine has them) at lengths drawn
log-uniformly from --min-len to --max-len tokens, tokenised by a byte-level BPE trained on that text here
(nothing is downloaded). Runs, each in a fresh worker process, on e2e's random-init models (bf16, LoRA r=16 on
the preset's targets, non-reentrant checkpointing, the Trainer's default optimizer, fused AdamW):
  trainer                 transformers.Trainer, DataCollatorForLanguageModeling (pads each batch to its longest row)
  trainer_liger           the same with use_liger_kernel=True
  trainer_fastkernels     the same with callbacks=[FastKernels()] (the defaults: CUDA graphs within their
                          memory cap, rows padded on to a few lengths)
  trainer_fastkernels_eager    FastKernels(cuda_graphs=False) (no graphs, no buckets)
  trainer_fastkernels_graphs   FastKernels(cuda_graphs=True) (graphs without a memory cap)
  sft, fast_sft            trl.SFTTrainer / FastSFTTrainer, its collator padding each batch to its longest row
  sft_packed, fast_sft_packed  the same with packing=True (padding-free rows)
  lightning               a Lightning fit of a LightningModule around the same model, on the same documents and
                          collator, as Lightning users train: configure_optimizers' AdamW (unfused), linear decay,
                          gradient_clip_val=1, precision="bf16-mixed"
  lightning_fastkernels   the same with L.Trainer(strategy="fastkernels")
tokens/s counts real tokens only (the attention mask's ones) over the measured steps' wall time. "GPU ms" is the
kernel time of those same batches: the runs take the documents in order (sequential sampling, the documents
themselves in random order), and after the measured steps train once more on the measured steps' documents under
torch.profiler, one step at a time, synchronised (the tracing slows the host, so no wall is taken there). wall / GPU
says how far the host sets the pace. Where a profiled step's batch is not its measured twin's (packed rows, whose
packs depend on the whole dataset), the kernel time is scaled from the profiled steps' time per real token.
The note counts the measured steps by what they did beyond a repeated step (MoE autotuning, a CUDA graph capture,
a shape the graphs saw for the first time), with each kind's median wall time: where the host time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ._report import short_error, write_csv
from .e2e import build_model, default_device, parse_list, print_table, run_worker, worker_deadline
from .frameworks import _counts_note, _reset_peak, _training_args
from .presets import MODELS

RUNS = (
    "trainer",
    "trainer_liger",
    "trainer_fastkernels",
    "trainer_fastkernels_eager",
    "trainer_fastkernels_graphs",
    "sft",
    "fast_sft",
    "sft_packed",
    "fast_sft_packed",
    "lightning",
    "lightning_fastkernels",
)
BASELINE = {
    "trainer_liger": "trainer",
    "trainer_fastkernels": "trainer",
    "trainer_fastkernels_eager": "trainer",
    "trainer_fastkernels_graphs": "trainer",
    "fast_sft": "sft",
    "fast_sft_packed": "sft_packed",
    "lightning_fastkernels": "lightning",
}
COLUMNS = ("model", "run", "batch", "tok/s", "vs baseline", "peak GiB", "wall ms", "GPU ms", "wall/GPU", "note")
_TEXT_BYTES = 6_000_000


def build_tokenizer(vocab_size: int):
    """A byte-level BPE of at most `vocab_size` tokens trained on the standard library's sources (a few seconds),
    as a transformers tokenizer that pads on the right."""
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>"]
    # The alphabet alone (every character of the text) would outgrow a tiny model's vocabulary: cut to the most
    # frequent characters where it does not fit. A small vocabulary learns its merges from less text.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, limit_alphabet=vocab_size - len(specials), show_progress=False
    )
    tokenizer.train_from_iterator(_texts(paths, min(_TEXT_BYTES, 2_000 * vocab_size)), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>"), paths


def _texts(paths, limit: int):
    total = 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        yield text
        total += len(text)
        if total >= limit:
            return


def documents(tokenizer, paths, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`count` documents of the library's token stream at log-uniform lengths in [min_len, max_len]."""
    import math
    import random

    rng = random.Random(seed)
    stream: list[int] = []
    for text in _texts(paths, 4 * _TEXT_BYTES):
        stream += tokenizer(text)["input_ids"]
        if len(stream) >= count * max_len:
            break
    docs, at = [], 0
    for _ in range(count):
        n = int(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
        if at + n > len(stream):
            at = 0
        docs.append(stream[at : at + n])
        at += n
    return docs


# --- the worker -----------------------------------------------------------------------------------------------


def total_steps(spec: dict) -> int:
    """Warm-up, measured, then as many profiled steps: the measured steps' documents again, under the profiler."""
    return spec["warmup"] + 2 * spec["steps"]


class _Meter:
    """Real tokens (attention-mask ones) and the loss of each step, kept on the device; wall time of the measured
    steps; the kernel time of each profiled step (the `steps` after the measured ones, which train on the measured
    steps' documents again), each one traced alone by torch.profiler between two synchronisations; what each step
    did that a repeated step does not (`_events`). The trainers' callbacks (`callback()` for transformers',
    `lightning_callback()` for Lightning's) call begin_step, end_step and finish.

    The wall is taken as a user's run has it: the device is synchronised only where the measured steps begin and
    end, not at every step, which would idle the GPU while the host runs the step's edges (the Trainer's walks of
    the model, the next batch). A step's wall is the host's time from its begin to the next step's begin; they add
    up to the synchronised total, and a run that syncs once a step (the Trainer's loss filter, fastplug's row
    lengths) keeps the host within a step of the device."""

    def __init__(self, device, warmup: int, steps: int, deadline: float):
        self.device, self.warmup, self.steps, self.deadline = device, warmup, steps, deadline
        self.starts: list[float] = []  # each step's begin, host clock
        self.window_end = None  # the measured steps' end, after a sync
        self.tokens: list = []  # real tokens per step (device tensors until result())
        self.losses: list = []  # the model's loss per step (device tensors until result())
        self._counter = None  # the FastKernels callback's counter: attention-mask ones, summed lazily
        self._profile = None
        self.device_ms: list[float] = []  # kernel time of each profiled step, in order
        self.kernel_counts: list[int] = []  # device kernels (and copies) of each profiled step
        self._model = None
        self._before = (0, 0, 0)
        self.causes: list[str] = []  # per step: why it cost more host time than a repeated one, or "repeat"
        # CUDA events where each measured step begins and where the window ends: a step's time on the device's
        # timeline (idle included), where the host interval carries whatever wait the host met during it
        self._marks: list = []
        self._step_loss = None

    def attach(self, model) -> None:
        """Count the real tokens of `model`'s training forwards and keep the loss of the last one."""
        import torch

        from ..integrations.hf_trainer import _TokenCounter

        self._counter = _TokenCounter()
        self._counter.attach(model)
        self._model = model

        def keep_loss(module, args, output):
            loss = getattr(output, "loss", None) if module.training else None
            if isinstance(loss, torch.Tensor):
                self._step_loss = loss.detach()

        model.register_forward_hook(keep_loss)

    def _events(self) -> tuple[int, int, int]:
        """Counts so far of what makes a step cost the host more than a repeated one: grouped-GEMM shapes the MoE
        autotuner timed, forwards of the layer stack inside a CUDA graph capture, first sightings of a shape."""
        from ..patch.engine import active_handle
        from ..patch.layer_graphs import CAPTURING, FIRST_SIGHTING

        tuning = sys.modules.get("fastplug.kernels.moe.tuning")
        handle = active_handle(self._model) if self._model is not None else None
        eager = handle.graphs.eager if handle is not None and handle.graphs is not None else {}
        return len(tuning.TIMINGS) if tuning else 0, eager.get(CAPTURING, 0), eager.get(FIRST_SIGHTING, 0)

    def begin_step(self) -> None:
        from .e2e import sync_device

        step = len(self.starts)
        if step == self.warmup:
            sync_device(self.device)  # the measured steps start on an idle device
        if step >= self.warmup + self.steps and self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            sync_device(self.device)  # the trace holds this step's kernels and no other's
            self._profile = profile(activities=[ProfilerActivity.CUDA])
            self._profile.__enter__()
        self._before = self._events()
        self._step_loss = None
        self.starts.append(time.perf_counter())
        if self.warmup <= step < self.warmup + self.steps:
            self._mark()

    def _mark(self) -> None:
        if self.device.type == "cuda":
            import torch

            self._marks.append(torch.cuda.Event(enable_timing=True))
            self._marks[-1].record()

    def end_step(self, loss=None) -> bool:
        """Records the step (`loss`: the step's, where the trainer hands it over); True when the deadline passed
        (the run should stop)."""
        from .e2e import sync_device

        late = time.perf_counter() > self.deadline  # keep what was measured rather than lose it to the hard limit
        if self.window_end is None and (len(self.starts) == self.warmup + self.steps or late):
            self._mark()
            sync_device(self.device)
            self.window_end = time.perf_counter()
        self.tokens.append(self._counter.take_lazy())
        self.losses.append(loss.detach() if loss is not None else self._step_loss)
        if self._profile is not None:
            sync_device(self.device)
            self._profile.__exit__(None, None, None)
            kernels = [e for e in self._profile.key_averages() if e.device_type.name == "CUDA"]
            self.device_ms.append(sum(e.self_device_time_total for e in kernels) / 1e3)
            self.kernel_counts.append(sum(e.count for e in kernels))
            self._profile = None
        tuned, captured, first = (after - before for after, before in zip(self._events(), self._before))
        self.causes.append(
            "MoE tuning" if tuned else "capture" if captured else "first sighting" if first else "repeat"
        )
        return late

    def finish(self) -> None:
        if self._profile is not None:  # a step the trainer began and never ended
            self._profile.__exit__(None, None, None)
            self._profile = None

    def _device_ms_of_measured(self, tokens: list[int]) -> tuple[list[float] | None, str]:
        """Each measured step's kernel time, and how it was found: its profiled twin's (same real tokens), or, where
        the twins' batches differ (packed rows) or some are missing, the profiled steps' time per real token
        times the step's real tokens. None: no step was profiled (on CPU, or the deadline came first)."""
        profiled = self.tokens[self.warmup + self.steps :][: len(self.device_ms)]
        if not profiled:
            return None, ""
        if profiled[: len(tokens)] == tokens:
            return self.device_ms[: len(tokens)], "the same batches, profiled again"
        per_token = sum(self.device_ms[: len(profiled)]) / max(sum(profiled), 1)
        return [per_token * n for n in tokens], f"other batches', scaled by real tokens ({len(profiled)} profiled)"

    def callback(self):
        from transformers import TrainerCallback

        meter = self

        class Timing(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                _reset_peak(meter.device)

            def on_step_begin(self, args, state, control, **kwargs):
                meter.begin_step()

            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = meter.end_step() or control.should_training_stop

            def on_train_end(self, args, state, control, **kwargs):
                meter.finish()

        return Timing()

    def lightning_callback(self, notes: dict):
        """A Lightning callback; `notes["note"]` gets what the strategy patched (it restores at teardown)."""
        import lightning.pytorch as L

        meter = self

        class Timing(L.Callback):
            def on_train_start(self, trainer, pl_module):
                _reset_peak(meter.device)
                notes["note"] = _counts_note(getattr(trainer.strategy, "fast_kernel_handles", []))

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                meter.begin_step()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if meter.end_step(outputs["loss"]):
                    trainer.should_stop = True

            def on_train_end(self, trainer, pl_module):
                meter.finish()

        return Timing()

    def result(self, note: str) -> dict:
        import torch

        end = min(self.warmup + self.steps, len(self.starts))
        if self.window_end is None or end <= self.warmup:
            raise RuntimeError(f"only {len(self.starts)} steps ran, {self.warmup} of them warm-up")
        edges = [*self.starts[self.warmup + 1 : end], self.window_end]
        times = [after - before for after, before in zip(edges, self.starts[self.warmup : end])]
        self.tokens = [int(n) for n in self.tokens]
        tokens = self.tokens[self.warmup : end]
        wall_ms = 1e3 * sum(times) / len(times)
        device_ms, device_source = self._device_ms_of_measured(tokens)
        causes_measured = self.causes[self.warmup : end]
        by_cause: dict[str, list[float]] = {}
        for cause, seconds in zip(causes_measured, times):
            by_cause.setdefault(cause, []).append(seconds)
        causes = ", ".join(
            f"{cause} {len(t)} ({1e3 * statistics.median(t):.0f} ms)"
            for cause, t in sorted(by_cause.items(), key=lambda item: -len(item[1]))
        )
        # the steps far slower than a typical one, by their real tokens and what they did (small batches pay the
        # step's fixed host time on few tokens), each timed on the device's timeline where there is one
        on_device = [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        if len(on_device) != len(times):
            on_device = None
        per_step = [n / t for n, t in zip(tokens, on_device or times)]
        half = statistics.median(per_step) / 2
        slow = [i for i, rate in enumerate(per_step) if rate < half]
        timed = " (device timeline)" if on_device else ""
        slow_note = f"{len(slow)} steps below half the median step's tok/s{timed}" + (
            " (real tokens, cause: " + ", ".join(f"{tokens[i]} {causes_measured[i]}" for i in slow) + ")"
            if slow
            else ""
        )
        if slow and device_ms is not None:
            # below half even at the device's own pace: the step's kernels alone take that long for its tokens
            kernel_bound = [i for i in slow if tokens[i] / (device_ms[i] / 1e3) < half]
            slow_note += f", {len(kernel_bound)} of them below half in kernel time alone"
        return dict(
            tokens_per_s=sum(tokens) / sum(times),
            wall_ms=wall_ms,
            gpu_ms=sum(device_ms) / len(device_ms) if device_ms else None,
            gpu_ms_source=device_source,
            # each measured step: real tokens, wall ms (host clock, begin to next begin), ms on the device's timeline
            # (begin to next begin), kernel ms
            per_step=[
                (n, round(1e3 * t, 1), None if d is None else round(1e3 * d, 1), None if k is None else round(k, 1))
                for n, t, d, k in zip(
                    tokens, times, on_device or [None] * len(tokens), device_ms or [None] * len(tokens)
                )
            ],
            kernels_per_step=statistics.mean(self.kernel_counts) if self.kernel_counts else None,
            measured_steps=len(times),
            losses=[None if loss is None else float(loss) for loss in self.losses],  # every step's
            real_tokens=sum(self.tokens),  # every step's, warm-up and profiled ones too
            step_tokens=self.tokens,  # each step's, in order
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None,
            note=f"{note}; measured steps by cause (median wall): {causes}; {slow_note}".lstrip("; "),
        )


def _run_args(spec: dict, device, run: str) -> dict:
    """The Trainer's (and SFTConfig's) arguments: the frameworks bench's, for the profiled steps too, logging at
    the trainer's default interval (transformers' 500 steps, TRL's 10): a log reads the running loss on the host,
    a sync, and the meter keeps every step's loss without one."""
    args = _training_args(spec, device, run)
    args["max_steps"] = total_steps(spec)
    args["train_sampling_strategy"] = "sequential"  # the profiled steps see the measured steps' batches again
    del args["logging_steps"]
    return args


def _dataset(spec, tokenizer, paths):
    """The documents in the order the runs take them: the warm-up's, the measured steps', then the measured steps'
    again (`total_steps`)."""
    batch, warmup = spec["batch"], spec["warmup"]
    docs = documents(tokenizer, paths, batch * (warmup + spec["steps"]), spec["min_len"], spec["max_len"], spec["seed"])
    return docs + docs[batch * warmup :]


def _peft_model_and_rows(spec, device, tokenizer, paths):
    """e2e's peft model (checkpointing on; fp32 on CPU, where only the Lightning rows autocast), the documents as
    rows for the language-modelling collator, and a meter counting the model's real tokens."""
    model = build_model(spec["model"], spec["tiny"], device, spec["seed"])
    if device.type == "cpu":
        model = model.float()
    rows = [{"input_ids": doc} for doc in _dataset(spec, tokenizer, paths)]
    meter = _Meter(device, spec["warmup"], spec["steps"], worker_deadline(spec))
    meter.attach(model)
    return model, rows, meter


def run_trainer(spec: dict, device, tokenizer, paths, run: str) -> dict:
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model, rows, meter = _peft_model_and_rows(spec, device, tokenizer, paths)
    callbacks = [meter.callback()]
    if "fastkernels" in run:
        from ..integrations.hf_trainer import FastKernels

        graphs = True if run.endswith("_graphs") else False if run.endswith("_eager") else None
        callbacks.append(FastKernels(cuda_graphs=graphs))
    args = _run_args(spec, device, run)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**args, use_liger_kernel=run == "trainer_liger"),
        train_dataset=rows,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=callbacks,
    )
    trainer.train()
    note = _counts_note([callbacks[-1].handle]) if "fastkernels" in run else ""
    if "fastkernels" in run and callbacks[-1].handle is not None and callbacks[-1].handle.graphs is not None:
        note += f"; {callbacks[-1].handle.graphs}"
    return meter.result(note)


def run_lightning(spec: dict, device, tokenizer, paths, fast: bool) -> dict:
    """Lightning's fit of the trainer rows' model, documents and collator, set up as Lightning users do:
    configure_optimizers returns AdamW (lr 1e-4, no weight decay, torch's default foreach implementation) under a
    linear decay to zero; L.Trainer clips gradients to norm 1 under precision="bf16-mixed", on CPU too (the smoke
    test runs what the GPU runs). The documents come in the dataset's order, as in the Trainer runs (`_dataset`)."""
    import lightning.pytorch as L
    import torch
    from transformers import DataCollatorForLanguageModeling, get_linear_schedule_with_warmup

    model, rows, meter = _peft_model_and_rows(spec, device, tokenizer, paths)
    max_steps = total_steps(spec)

    class CausalLM(L.LightningModule):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def training_step(self, batch, batch_idx):
            return self.lm(**batch).loss

        def configure_optimizers(self):
            params = [p for p in self.parameters() if p.requires_grad]
            # Not fused: Lightning refuses gradient clipping under AMP for an optimizer that unscales internally
            optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
            schedule = get_linear_schedule_with_warmup(optimizer, 0, max_steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    notes = {}
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision="bf16-mixed", max_steps=max_steps,
        gradient_clip_val=1.0, strategy="fastkernels" if fast else "auto", callbacks=[meter.lightning_callback(notes)],
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(
        rows, batch_size=spec["batch"], shuffle=False,
        collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False), pin_memory=device.type == "cuda",
    )  # fmt: skip
    trainer.fit(CausalLM(model), loader)
    return meter.result(notes.get("note", "") if fast else "")


def run_sft(spec: dict, device, tokenizer, paths, fast: bool, packed: bool) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    model = build_model(spec["model"], spec["tiny"], device, spec["seed"]).unload()
    if device.type == "cpu":
        model = model.float()
    model.config.use_cache = False
    dataset = Dataset.from_dict({"input_ids": _dataset(spec, tokenizer, paths)})
    meter = _Meter(device, spec["warmup"], spec["steps"], worker_deadline(spec))
    meter.attach(model)
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=MODELS[spec["model"]]["lora"])
    args = _run_args(spec, device, "sft")
    config = SFTConfig(**args, packing=packed, max_length=spec["max_len"])
    kwargs = dict(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    if fast:
        from ..integrations.trl import FastSFTTrainer

        trainer = FastSFTTrainer(**kwargs, callbacks=[meter.callback()])
        note = _counts_note(trainer.fast_kernel_handles)
    else:
        trainer = SFTTrainer(**kwargs, callbacks=[meter.callback()])
        note = ""
    trainer.train()
    return meter.result(note)


def worker_main(spec_json: str, result_path: str) -> int:
    import torch

    spec = json.loads(spec_json)
    print(f"\n== varlen / {spec['model']} / {spec['run']} ==", flush=True)
    device = torch.device(spec["device"])
    try:
        tokenizer, paths = build_tokenizer(spec["vocab"])
        run = spec["run"]
        if run.startswith("trainer"):
            result = run_trainer(spec, device, tokenizer, paths, run)
        elif run.startswith("lightning"):
            result = run_lightning(spec, device, tokenizer, paths, fast=run == "lightning_fastkernels")
        else:
            result = run_sft(spec, device, tokenizer, paths, fast=run.startswith("fast"), packed=run.endswith("packed"))
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"error": short_error(exc)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# --- the parent -----------------------------------------------------------------------------------------------


def _loss_agreement(losses: list, baseline: list) -> str:
    """How far a run's per-step losses are from its baseline's, step by step (same batches, same seed)."""
    pairs = [(a, b) for a, b in zip(losses, baseline) if a is not None and b is not None]
    if not pairs:
        return ""
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    return f"losses within {100 * worst:.2g}% of the baseline's over {len(pairs)} steps; "


def varlen_rows(args, models, runs, device, save) -> list[dict]:
    rows = []
    for model in models:
        tiny = args.tiny
        vocab = min(args.vocab, MODELS[model]["tiny" if tiny else "full"]["vocab_size"])
        batch = args.batch or (2 if tiny else MODELS[model]["batch"])
        results = {}
        for run in runs:
            spec = dict(
                bench="varlen", run=run, model=model, tiny=tiny, device=device, seed=args.seed, batch=batch,
                steps=args.steps, warmup=args.warmup, min_len=args.min_len, max_len=args.max_len, vocab=vocab,
                seq=args.max_len,
            )  # fmt: skip
            started = time.time()
            res = run_worker(spec, args.time_limit)
            row = {"model": model, "run": run, "batch": batch}
            rows.append(row)
            if "error" in res:
                row["note"] = res["error"]
                save(rows)
                continue
            results[run] = res
            gpu = res["gpu_ms"]
            row.update(
                {"tok/s": res["tokens_per_s"], "peak GiB": res["peak_gib"], "wall ms": res["wall_ms"],
                 "GPU ms": gpu, "wall/GPU": res["wall_ms"] / gpu if gpu else None,
                 "real tokens": res["real_tokens"], "step tokens": res["step_tokens"],
                 "losses": res["losses"]}  # for callers; not in the table
            )  # fmt: skip
            base = results.get(BASELINE.get(run))
            agreement = ""
            if base:
                row["vs baseline"] = res["tokens_per_s"] / base["tokens_per_s"]
                agreement = _loss_agreement(res["losses"], base["losses"])
            source = f"GPU ms: {res['gpu_ms_source']}; " if res.get("gpu_ms_source") else ""
            took = f"{res['measured_steps']} steps, {time.time() - started:.0f} s"
            row["note"] = f"{res['note']}; {agreement}{source}{took}"
            columns = "real tokens, host ms, device-timeline ms, GPU kernel ms"
            print(f"{model} / {run}, per measured step ({columns}): {res['per_step']}", flush=True)
            row["note"] = row["note"].lstrip("; ")
            save(rows)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench varlen", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama", help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {','.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=30, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=10, help="steps before measuring (graph captures happen here)")
    parser.add_argument("--batch", type=int, default=None, help="rows per batch (default: the preset's)")
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary trained on the text")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per run (hard)")
    parser.add_argument("--tiny", action="store_true", help="e2e's tiny models (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out", help="folder for the CSV")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    models = parse_list(args.models, MODELS, "--models")
    runs = parse_list(args.runs, RUNS, "--runs")
    device = default_device()
    if device == "cpu" and not args.tiny:
        parser.error("without a GPU only --tiny runs")
    csv_path = os.path.join(args.out, "varlen.csv")
    rows = varlen_rows(args, models, runs, device, lambda rows: write_csv(csv_path, rows, COLUMNS))
    print(f"\ncsv: {csv_path}\n")
    print_table(rows, COLUMNS)
    return 0
