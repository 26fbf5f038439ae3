"""`python -m fastplug.bench grpo`: one GRPO training step, TRL's GRPOTrainer against fastplug's FastGRPOTrainer.

Random-init bf16 models of the Llama-3.2-1B and Qwen3-1.7B shapes, LoRA r=16 on every linear layer (TRL wraps
them from peft_config), prompts cut from the Python standard library's sources (32 to 96 characters, so rows of
different lengths are batched), a character tokenizer built locally whose vocabulary spans the model's, and a
local reward (the completion's length close to half of `--new-tokens`): nothing is downloaded. Each step
generates 8 completions for each of 8 prompts (`--prompts`, `--generations`), sampled at temperature 1, up to
`--new-tokens` tokens (random weights rarely sample EOS: the completions run to the end), and trains on them in
micro-batches of 8 rows (gradient accumulation over the generation batch), with a KL term (beta 0.04) so that the
reference pass runs too.

Implementations, each in its own process:
  trl           trl.GRPOTrainer: transformers' generate, TRL's log-prob passes (1.16: its chunked LM head)
  trl_liger     the same with use_liger_kernel=True (when liger-kernel is installed)
  fastplug      fastplug.integrations.trl.FastGRPOTrainer (default KernelOptions): fast_generate rollouts with
                the live adapters, fused log-probs, fastplug's kernels in the layers
  fastplug_trl_generate   FastGRPOTrainer(fast_generation=False): the kernels and log-probs, TRL's generation

Columns: seconds per optimizer step (median of `--steps` after `--warmup`) split into generation (the rollout),
log-probs (every per-token log-prob pass: reference, old policy and the policy's forward) and training (the rest:
backward, optimizer, rewards, bookkeeping); generated tokens per second of the rollout; peak GPU memory from the
start of training (weights included); mean completion length. `--find-max L1,L2,...` instead runs one step per
completion length, in increasing order, until a run fails (out of memory) or exceeds the time limit, and reports
the longest that fit for each implementation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from ._report import short_error, write_csv
from .e2e import default_device, parse_list, print_table, run_worker, sync_device, worker_deadline
from .presets import ALL_LINEAR_LORA, GRPO_TINY, QWEN3_1_7B
from .presets import MODELS as PRESETS

MODELS = {
    "llama": ("Llama-3.2-1B shape", "LlamaConfig", PRESETS["llama"]["full"]),
    "qwen3": ("Qwen3-1.7B shape", "Qwen3Config", QWEN3_1_7B),
}
IMPLS = ("trl", "trl_liger", "fastplug", "fastplug_trl_generate")
DEFAULT_IMPLS = IMPLS[:3]
BASELINE = "trl"
COLUMNS = (
    "model", "impl", "new tokens", "step s", "vs trl", "generation s", "log-probs s", "training s", "gen tok/s",
    "peak GiB", "mean length", "note",
)  # fmt: skip
MAX_COLUMNS = ("model", "impl", "longest fitting", "tried", "first failure")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


# --- the worker: one implementation, one model, one length, in its own process ----------------------------------


def bench_tokenizer(vocab_size: int):
    """Characters as tokens for the prompts, then filler tokens up to the model's vocabulary, so that every id a
    model samples decodes (the reward reads the text)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    names = SPECIALS + chars
    names += [f"<t{i}>" for i in range(len(names), vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def prompts(count: int, seed: int) -> list[str]:
    """`count` snippets of the standard library's sources, 32 to 96 characters each."""
    import random

    from .text import stdlib_bytes

    text = bytes(stdlib_bytes(200_000).tolist()).decode("ascii", errors="ignore")
    text = "".join(c if c.isprintable() else " " for c in text)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start, length = rng.randrange(0, len(text) - 100), rng.randrange(32, 97)
        out.append(text[start : start + length])
    return out


def length_reward(target: int):
    """Reward: minus the distance of the completion's length (in tokens) from `target`, relative to it."""

    def reward(completions, completion_ids=None, **kwargs):
        lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(c) for c in completions]
        return [-abs(n - target) / target for n in lengths]

    return reward


class _Clock:
    """Synchronized seconds spent inside wrapped calls since the last `take()`."""

    def __init__(self, device):
        self.device, self.seconds = device, 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            sync_device(self.device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync_device(self.device)
                self.seconds += time.perf_counter() - start

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _timing_callback(device, deadline, generation: _Clock, log_probs: _Clock, steps: list):
    import torch
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kwargs):
            sync_device(device)
            generation.take(), log_probs.take()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync_device(device)
            total = time.perf_counter() - self.start
            steps.append(dict(total=total, generation=generation.take(), log_probs=log_probs.take()))
            if time.perf_counter() > deadline:
                control.should_training_stop = True

    return Timing()


def run_grpo(spec: dict) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    device = torch.device(spec["device"])
    on_gpu = device.type == "cuda"
    _, config_name, shape = MODELS[spec["model"]]
    config = getattr(transformers, config_name)(**(GRPO_TINY if spec["tiny"] else shape))
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if on_gpu else torch.float32, attn_implementation="sdpa"
        )
    tokenizer = bench_tokenizer(config.vocab_size)
    for name in ("pad", "eos", "bos"):
        setattr(model.config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
        setattr(model.generation_config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
    generations, micro = spec["generations"], spec["micro_batch"]
    rows = spec["prompts"] * generations
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="fastplug_bench_grpo_"), max_steps=spec["warmup"] + spec["steps"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro, num_generations=generations,
        max_completion_length=spec["new_tokens"], temperature=1.0, beta=0.04, learning_rate=1e-5,
        gradient_checkpointing=True, bf16=on_gpu, use_cpu=not on_gpu, logging_steps=1, report_to=[],
        save_strategy="no", seed=spec["seed"], disable_tqdm=True, use_liger_kernel=spec["impl"] == "trl_liger",
    )  # fmt: skip
    generation, log_probs, steps = _Clock(device), _Clock(device), []
    kwargs = dict(
        model=model,
        reward_funcs=length_reward(max(1, spec["new_tokens"] // 2)),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts(spec["prompts"] * (args.max_steps + 1), spec["seed"])}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=ALL_LINEAR_LORA),
        callbacks=[_timing_callback(device, worker_deadline(spec), generation, log_probs, steps)],
    )
    note = ""
    if spec["impl"].startswith("fastplug"):
        from ..integrations.trl import FastGRPOTrainer

        trainer = FastGRPOTrainer(**kwargs, fast_generation=spec["impl"] == "fastplug")
        # the summary's path lines, up to their first clause: "rollouts: fastplug fast_generate; per-token ..."
        paths = [line.strip() for line in trainer.fast_kernels_summary.splitlines() if line.strip().startswith(
            ("rollouts:", "per-token log-probs:"))]  # fmt: skip
        note = "; ".join(line.split(" (")[0] for line in paths)
    else:
        trainer = GRPOTrainer(**kwargs)
    trainer._generate_single_turn = generation.wrap(trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = log_probs.wrap(trainer._get_per_token_logps_and_entropies)
    trainer.train()
    if not steps:
        raise RuntimeError("no training step ran")
    measured = steps[spec["warmup"] :] or steps[-1:]
    median = {k: statistics.median(s[k] for s in measured) for k in ("total", "generation", "log_probs")}
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    mean_length = statistics.mean(lengths[spec["warmup"] :] or lengths) if lengths else None
    return dict(
        step_s=median["total"], generation_s=median["generation"], log_probs_s=median["log_probs"],
        training_s=median["total"] - median["generation"] - median["log_probs"], mean_length=mean_length,
        gen_tok_per_s=rows * mean_length / median["generation"] if mean_length and median["generation"] else None,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None, measured_steps=len(measured),
        all_steps=[{k: round(v, 3) for k, v in s.items()} for s in steps], note=note,
    )  # fmt: skip


def worker_main(spec_json: str, result_path: str) -> int:
    spec = json.loads(spec_json)
    print(f"\n== grpo / {spec['model']} / {spec['impl']} / {spec['new_tokens']} new tokens ==", flush=True)
    try:
        if spec["impl"] == "trl_liger":
            import importlib.util

            if importlib.util.find_spec("liger_kernel") is None:
                raise RuntimeError("liger-kernel is not installed")
        result = run_grpo(spec)
        print(f"steps (s): {result['all_steps']}", flush=True)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"error": short_error(exc)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# --- the parent: one worker per (model, length, implementation), then the table ---------------------------------


def _spec(args, model: str, impl: str, new_tokens: int, steps: int, warmup: int) -> dict:
    # "bench" routes the `_worker` command of fastplug.bench to this module's worker_main.
    return dict(
        bench="grpo", model=model, impl=impl, new_tokens=new_tokens, tiny=args.tiny, device=args.device,
        seed=args.seed, prompts=args.prompts, generations=args.generations, micro_batch=args.micro_batch,
        steps=steps, warmup=warmup,
    )  # fmt: skip


def step_rows(args, models, impls, lengths, save) -> list[dict]:
    rows = []
    for model in models:
        for new_tokens in lengths:
            base = None
            for impl in impls:
                res = run_worker(_spec(args, model, impl, new_tokens, args.steps, args.warmup), args.time_limit)
                row = {"model": model, "impl": impl, "new tokens": new_tokens}
                rows.append(row)
                if "error" in res:
                    row["note"] = res["error"]
                    save(rows)
                    continue
                row.update(
                    {
                        "step s": res["step_s"],
                        "generation s": res["generation_s"],
                        "log-probs s": res["log_probs_s"],
                        "training s": res["training_s"],
                        "gen tok/s": res["gen_tok_per_s"],
                        "peak GiB": res["peak_gib"],
                        "mean length": res["mean_length"],
                    }
                )
                notes = [res["note"]]
                if res["measured_steps"] < args.steps:
                    notes.append(f"only {res['measured_steps']} measured steps (time limit)")
                if impl == BASELINE:
                    base = res
                elif base is not None:
                    row["vs trl"] = base["step_s"] / res["step_s"]
                    if base["peak_gib"] and res["peak_gib"]:
                        notes.append(f"memory {res['peak_gib'] / base['peak_gib']:.2f}x trl's")
                row["note"] = "; ".join(n for n in notes if n)
                save(rows)
    return rows


def max_rows(args, models, impls, lengths, save) -> list[dict]:
    rows = []
    for model in models:
        for impl in impls:
            row = {"model": model, "impl": impl, "tried": ""}
            rows.append(row)
            for new_tokens in lengths:
                res = run_worker(_spec(args, model, impl, new_tokens, steps=1, warmup=0), args.time_limit)
                row["tried"] = (row["tried"] + f" {new_tokens}").strip()
                if "error" in res:
                    row["first failure"] = f"{new_tokens}: {res['error']}"
                    break
                row["longest fitting"] = f"{new_tokens} ({res['peak_gib']:.1f} GiB)" if res["peak_gib"] else new_tokens
                save(rows)
            save(rows)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    parser.add_argument("--new-tokens", default="256,1024", help="completion lengths, comma-separated")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per training micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before measuring")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per worker (hard)")
    parser.add_argument("--find-max", default="", metavar="L1,L2,...", help="longest completion length that fits")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same families (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out", help="folder for the CSV")
    args = parser.parse_args(argv)

    models = parse_list(args.models, MODELS, "--models")
    impls = parse_list(args.impls, IMPLS, "--impls")
    args.device = default_device()
    if args.device == "cpu" and not args.tiny:
        parser.error("without a GPU only --tiny runs")
    if (args.prompts * args.generations) % args.micro_batch:
        parser.error("--micro-batch must divide --prompts x --generations")
    print(
        f"grpo bench on {args.device}: {args.prompts} prompts x {args.generations} generations, LoRA r=16, "
        f"micro-batches of {args.micro_batch}; impls {', '.join(impls)}",
        flush=True,
    )
    if args.find_max:
        lengths = sorted(int(n) for n in args.find_max.split(","))
        csv_path = os.path.join(args.out, "grpo_max.csv")
        rows = max_rows(args, models, impls, lengths, lambda rows: write_csv(csv_path, rows, MAX_COLUMNS))
        print(f"\ncsv: {csv_path}\n")
        print_table(rows, MAX_COLUMNS)
        return 0
    lengths = [int(n) for n in args.new_tokens.split(",")]
    csv_path = os.path.join(args.out, "grpo.csv")
    rows = step_rows(args, models, impls, lengths, lambda rows: write_csv(csv_path, rows, COLUMNS))
    print(f"\ncsv: {csv_path}\n")
    print_table(rows, COLUMNS)
    bad = [r for r in rows if r["impl"] == "fastplug" and "step s" not in r]
    return 1 if bad else 0
