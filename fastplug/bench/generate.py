"""`python -m fastplug.bench.generate`: decoding speed of fastplug's `fast_generate` against transformers'
`generate`, on a random-init model of the Llama-3.2-1B shape (bf16), same process, same prompts.

Rows: transformers `generate` (dynamic cache), fastplug on the base model, fastplug with unmerged LoRA
adapters (r=16 on every linear layer, fp32 adapters as peft keeps them). Columns: decode tokens/s over
batch x new tokens (greedy, no EOS, so every row runs to the end), time to first token (prefill + one
token), peak memory above the weights, and whether the decode step ran as a CUDA graph. Each setting runs
once to warm up (compiles kernels, captures the graph) and is then timed once; tokens/s are wall-clock
over the whole call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ._report import fmt, markdown_table, short_error, write_csv

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=128, tie_word_embeddings=True)
IMPLS = ("fastplug", "fastplug_lora", "transformers")
COLUMNS = ["impl", "batch", "new_tokens", "tok_per_s", "ttft_ms", "peak_mib", "decode", "error"]


def _build(shape: dict, device: str):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


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


def _run(impl: str, model, ids, mask, new_tokens: int, device: str) -> dict:
    import torch

    from fastplug.generation import fast_generate, graph_status

    if impl == "transformers":
        def generate(n):
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
    else:
        def generate(n):
            return fast_generate(model, ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        generate(min(new_tokens, 8) if impl == "transformers" else new_tokens)  # warm-up (and graph capture)
        ttft, _ = _timed(lambda: generate(1), device)
        seconds, peak = _timed(lambda: generate(new_tokens), device)
    decode = graph_status(model) if impl != "transformers" else "dynamic cache"
    rows = ids.shape[0]
    return dict(tok_per_s=rows * new_tokens / seconds, ttft_ms=1000 * ttft, peak_mib=peak / 2**20, decode=decode)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastplug.bench.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row (default 128)")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per row (default 256)")
    parser.add_argument("--hf-new-tokens", type=int, default=None,
                        help="new tokens for transformers' rows (default: --new-tokens); its rate is per token")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--out", default="bench_out", help="folder for generate.csv")
    args = parser.parse_args(argv)

    import torch

    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown impls {unknown}; choose from {','.join(IMPLS)}")
    batches = [int(b) for b in args.batches.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _build(TINY if args.tiny else LLAMA_1B, device)
    lora_model = _with_lora(_build(TINY if args.tiny else LLAMA_1B, device)) if "fastplug_lora" in impls else None
    print(f"generate bench: {'tiny' if args.tiny else 'Llama-3.2-1B shape'}, {device}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, prompt {args.prompt}, greedy, no EOS",
          flush=True)
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (batch, args.prompt), generator=g).to(device)
        mask = torch.ones_like(ids)
        for impl in impls:
            new = args.hf_new_tokens or args.new_tokens if impl == "transformers" else args.new_tokens
            row = dict(impl=impl, batch=batch, new_tokens=new)
            try:
                row.update(_run(impl, lora_model if impl == "fastplug_lora" else model, ids, mask, new, device))
            except Exception as error:  # one failing setting must not hide the others
                row["error"] = short_error(error)
            rows.append(row)
            print({k: fmt(v) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    write_csv(os.path.join(args.out, "generate.csv"), rows, COLUMNS)
    table = [{k: fmt(v) if isinstance(v, float) else v for k, v in row.items()} for row in rows]
    print(markdown_table(table, COLUMNS))
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
