"""`python -m fastplug.bench.generate`: decoding speed of fastplug's `fast_generate` against transformers'
`generate`, on random-init models of the Llama-3.2-1B and Gemma2-2B shapes (bf16), same process, same prompts.

Rows: transformers `generate` (dynamic cache), transformers with a static cache (which `generate` compiles with
torch.compile, mode reduce-overhead), fastplug on the base model (decode kernels + CUDA graph), fastplug's
per-op decode step (cuBLAS projections, the path before the decode kernels; for comparison), fastplug with
unmerged LoRA adapters (r=16 on every linear layer, fp32 adapters as peft keeps them). Columns: tokens/s over
batch x new tokens for the whole call (greedy, no EOS, so every row runs to the end), decode tokens/s (the call
less its time to first token), time to first token (prefill + one token), peak memory above the weights, and
how the decode step ran. Each setting runs once to warm up (compiles kernels, captures the graph) and is then
timed `--repeats` times (median).

`--profile`: a torch.profiler kernel table of fastplug's decode steps, inside the CUDA graph and eager, for the
decode kernels and the per-op path. `--kernels`: the decode GEMV's block configurations against cuBLAS on the
model's shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ._report import fmt, markdown_table, short_error, write_csv
from .presets import MODELS as PRESETS

MODELS = {
    "llama": ("Llama-3.2-1B shape", "LlamaConfig", "LlamaForCausalLM", PRESETS["llama"]["full"]),
    "gemma2": ("Gemma2-2B shape", "Gemma2Config", "Gemma2ForCausalLM", PRESETS["gemma2"]["full"]),
}
TINY = PRESETS["llama"]["tiny"]
IMPLS = ("fastplug", "fastplug_lora", "fastplug_perop", "transformers", "transformers_compile")
COLUMNS = [
    "model",
    "impl",
    "batch",
    "new_tokens",
    "tok_per_s",
    "decode_tok_per_s",
    "ttft_ms",
    "peak_mib",
    "decode",
    "error",
]


def _build(shape: dict, device: str, model: str = "llama", nf4: bool = False):
    import torch
    import transformers

    torch.manual_seed(0)
    _, config_name, model_name, _ = MODELS[model]
    config = getattr(transformers, config_name)(**shape, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = getattr(transformers, model_name)(config)
    finally:
        torch.set_default_dtype(default)
    if nf4:
        model = _nf4(model, device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _nf4(model, device: str):
    """The model reloaded with 4-bit NF4 bases (double quantization, bf16 compute), as QLoRA users load it."""
    import tempfile

    import torch
    import transformers

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return type(model).from_pretrained(tmp, quantization_config=config, dtype=model.dtype, device_map=device)


def _with_lora(model):
    import peft

    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(call, device: str):
    """(seconds, peak bytes above what was allocated before) of one call."""
    import torch

    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    call()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    return seconds, peak


def _run(impl: str, model, ids, mask, new_tokens: int, device: str, repeats: int = 3) -> dict:
    import torch

    from fastplug.generate import decoder
    from fastplug.generate.api import fast_generate, graph_status

    if impl.startswith("transformers"):
        extra = dict(cache_implementation="static") if impl == "transformers_compile" else {}

        def generate(n):
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
    else:

        def generate(n):
            return fast_generate(
                model, ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )

    decoder.FAST_DECODE = impl != "fastplug_perop"
    try:
        with torch.no_grad():
            generate(min(new_tokens, 8) if impl == "transformers" else new_tokens)  # warm-up (and graph capture)
            if impl == "transformers_compile":
                generate(new_tokens)  # the compiled graphs settle on their second call
                ttft = None  # a 1-token call would size a new static cache and recompile
            else:
                ttft, _ = _timed(lambda: generate(1), device)
            runs = [_timed(lambda: generate(new_tokens), device) for _ in range(repeats)]
    finally:
        decoder.FAST_DECODE = True
    seconds = sorted(r[0] for r in runs)[len(runs) // 2]
    peak = max(r[1] for r in runs)
    decode = {"transformers": "dynamic cache", "transformers_compile": "static cache + torch.compile"}.get(impl)
    rows = ids.shape[0]
    decode_rate = rows * (new_tokens - 1) / (seconds - ttft) if ttft is not None and new_tokens > 1 else None
    return dict(
        tok_per_s=rows * new_tokens / seconds,
        decode_tok_per_s=decode_rate,
        ttft_ms=None if ttft is None else 1000 * ttft,
        peak_mib=peak / 2**20,
        decode=decode or graph_status(model),
    )


def _profile(model, ids, mask, steps: int = 32) -> None:
    """Kernel tables of `steps` decode steps (a call of steps + 1 tokens less a 1-token call's prefill)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastplug.generate import decoder
    from fastplug.generate.api import fast_generate

    def call(n, graph):
        return fast_generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            cuda_graph=graph,
        )

    for fast in (True, False):
        decoder.FAST_DECODE = fast
        for graph in (True, False):
            call(steps + 1, graph)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call(steps + 1, graph)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            events = sorted(events, key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events)
            launches = sum(e.count for e in events)
            print(
                f"\n## profile: {'decode kernels' if fast else 'per-op'}, {'CUDA graph' if graph else 'eager'}: "
                f"{steps} steps + prefill, GPU time {total / 1000:.2f} ms, {launches} kernels "
                f"(~{launches / (steps + 1):.0f} per step)"
            )
            print("| kernel | calls/step | us/step | share |\n|---|---|---|---|")
            for e in events[:14]:
                print(
                    f"| {e.key[:70]} | {e.count / (steps + 1):.1f} | {e.device_time_total / (steps + 1):.1f} | "
                    f"{100 * e.device_time_total / max(total, 1):.1f}% |"
                )
    decoder.FAST_DECODE = True


def _graph_time(fn, calls: int) -> float:
    """Median milliseconds of one of `calls` back-to-back fn(i) calls, replayed from a CUDA graph (no launch
    overhead, as in the decode step's graph)."""
    import torch
    from triton.testing import do_bench

    for i in range(calls):  # compile and warm up outside the capture
        fn(i)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return do_bench(graph.replay, return_mode="median") / calls


def _kernels(model_name: str) -> None:
    """The decode GEMV's configurations against cuBLAS (F.linear) on one model's projection shapes, timed in
    CUDA graphs over enough weight copies that L2 holds none of them (as in a decode step)."""
    import torch
    import torch.nn.functional as F

    from fastplug.kernels.decode import _gemv_config, gemv

    shape = MODELS[model_name][3]
    hidden, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * hd
    cases = {
        "qkv+norm": ([qkv], hidden, None, True),
        "o+res": ([hidden], shape["num_attention_heads"] * hd, None, False),
        "gate_up+norm": ([inter, inter], hidden, "silu", True),
        "down+res": ([hidden], inter, None, False),
        "head+norm": ([shape["vocab_size"]], hidden, None, True),
    }
    configs = {
        1: [
            (False, 1, 4, 1024, 4),
            (False, 1, 8, 512, 4),
            (False, 1, 8, 1024, 8),
            (False, 1, 16, 256, 4),
            (False, 1, 16, 512, 8),
            (False, 1, 2, 2048, 4),
        ],
        8: [
            (True, 16, 16, 128, 4),
            (True, 16, 32, 128, 4),
            (True, 16, 32, 256, 4),
            (True, 16, 64, 128, 4),
            (True, 16, 16, 256, 4),
            (True, 16, 16, 512, 8),
        ],
    }
    print(
        f"\n## decode GEMV configs, {MODELS[model_name][0]} (us per call in a CUDA graph, median; weights not in "
        "L2; cuBLAS = F.linear per weight, + the add for res)"
    )
    print("| proj | rows | cuBLAS | default | " + " | ".join(f"cfg{i}" for i in range(6)) + " | GB/s best |")
    print("|---|---|---|---|" + "---|" * 7)
    for name, (ns, k, act, norm) in cases.items():
        nbytes = sum(ns) * k * 2
        copies = max(1, -(-160 * 2**20 // nbytes))
        sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in ns] for _ in range(copies)]
        calls = max(copies, 8)
        nw = (torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5, 0.0) if norm else None
        res = name.endswith("+res")
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(m, sum(ns), device="cuda", dtype=torch.bfloat16)
            ref = _graph_time(
                lambda i: [h.add_(F.linear(x, w)) if res else F.linear(x, w) for w in sets[i % copies]], calls
            )
            kw = dict(activation=act, norm=nw, residual=h if res else None, out=h if res else None)
            times = [_graph_time(lambda i: gemv(x, sets[i % copies], **kw), calls)]
            for cfg in configs[m]:
                try:
                    times.append(_graph_time(lambda i: gemv(x, sets[i % copies], config=cfg, **kw), calls))
                except Exception as error:
                    print(f"  config {cfg}: {short_error(error)}")
                    times.append(float("nan"))
            best = min(t for t in times if t == t)
            cells = " | ".join(f"{1000 * t:.1f}" for t in times[1:])
            default = _gemv_config(m, max(ns), k, act is not None)
            print(
                f"| {name} {ns}x{k} | {m} | {1000 * ref:.1f} | {1000 * times[0]:.1f} {default} | {cells} | "
                f"{nbytes / best / 1e6:.0f} |",
                flush=True,
            )
        sets = None  # frees the weight copies before the next shape (lambdas above read it)
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama", help=f"comma-separated, of {','.join(MODELS)} (default llama)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row (default 128)")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per row (default 256)")
    parser.add_argument(
        "--hf-new-tokens",
        type=int,
        default=None,
        help="new tokens for transformers' dynamic-cache rows (default: --new-tokens); its rate is per token",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per setting (median; default 3)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}")
    parser.add_argument(
        "--plan",
        default=None,
        help="model:batch:impl+impl;... (overrides --models/--batches/--impls), e.g. "
        "'llama:1:fastplug+transformers;gemma2:1:fastplug'",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument(
        "--nf4", action="store_true", help="4-bit NF4 bases (bitsandbytes, double quantization): QLoRA models"
    )
    parser.add_argument("--profile", action="store_true", help="print kernel tables of the decode steps")
    parser.add_argument("--kernels", action="store_true", help="time the decode GEMV's configurations")
    parser.add_argument("--out", default="bench_out", help="folder for generate.csv")
    args = parser.parse_args(argv)

    import torch

    if args.plan:
        plan = []
        for part in args.plan.split(";"):
            name, batch, impls = part.split(":")
            plan.append((name, int(batch), impls.split("+")))
    else:
        impls = [i.strip() for i in args.impls.split(",") if i.strip()]
        plan = [(name, int(b), impls) for name in args.models.split(",") for b in args.batches.split(",")]
    unknown = sorted({i for _, _, impls in plan for i in impls} - set(IMPLS))
    unknown_models = sorted({name for name, _, _ in plan} - set(MODELS))
    if unknown or unknown_models:
        parser.error(
            f"unknown impls {unknown} / models {unknown_models}; choose from {','.join(IMPLS)} / {','.join(MODELS)}"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    g = torch.Generator().manual_seed(0)
    for name in dict.fromkeys(n for n, _, _ in plan):
        if args.kernels and device == "cuda" and not args.tiny:
            _kernels(name)
        shape = TINY if args.tiny else MODELS[name][3]
        model = _build(shape, device, name, args.nf4)
        wanted = [(b, impls) for n, b, impls in plan if n == name]
        lora_model = None
        print(
            f"generate bench: {'tiny' if args.tiny else MODELS[name][0]}{', NF4' if args.nf4 else ''}, {device}, "
            f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, prompt {args.prompt}, greedy, no EOS",
            flush=True,
        )
        for batch, impls in wanted:
            vocab = model.config.vocab_size
            ids = torch.randint(1, vocab, (batch, args.prompt), generator=g).to(device)
            mask = torch.ones_like(ids)
            if args.profile and device == "cuda" and batch == 1:
                _profile(model, ids, mask)
            for impl in impls:
                new = (args.hf_new_tokens or args.new_tokens) if impl == "transformers" else args.new_tokens
                row = dict(model=name, impl=impl, batch=batch, new_tokens=new)
                try:
                    if impl == "fastplug_lora" and lora_model is None:
                        lora_model = _with_lora(_build(shape, device, name, args.nf4))
                    row.update(
                        _run(
                            impl, lora_model if impl == "fastplug_lora" else model, ids, mask, new, device, args.repeats
                        )
                    )
                except Exception as error:  # one failing setting must not hide the others
                    row["error"] = short_error(error)
                rows.append(row)
                print({k: fmt(v) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del model, lora_model
        if device == "cuda":
            torch.cuda.empty_cache()
    write_csv(os.path.join(args.out, "generate.csv"), rows, COLUMNS)
    table = [{k: fmt(v) if isinstance(v, float) or v is None else v for k, v in row.items()} for row in rows]
    print(markdown_table(table, COLUMNS))
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
