"""Patched + torch.compile on CUDA against the eager patched model: losses of the first steps for each
checkpointing mode, and with fastplug's kernels switched off one at a time (to find the one a compiled
graph computes differently). Llama-1B widths, 2 layers, LoRA r=16 with fp32 adapters, Inductor.

    python scripts/compile_gpu.py [--layers 2] [--batch 2] [--seq 1024] [--steps 3]
"""

import argparse

import torch

import fastplug
from fastplug.bench import e2e

KERNELS = ("rope", "rms_norm", "mlp", "attention", "cross_entropy", "lora")


def losses(compiled: bool, steps: int, args, **options):
    torch._dynamo.reset()
    e2e.MODELS["llama"]["full"]["num_hidden_layers"] = args.layers
    model = e2e.build_model("llama", False, torch.device("cuda"), seed=0)
    handle = None
    graph_break = options.pop("graph_break", False)
    if graph_break:  # what "auto"'s measuring hook does: a call Dynamo cannot trace, before the first layer
        layer = model.get_base_model().model.layers[0]
        layer.register_forward_pre_hook(lambda *_: torch.cuda.memory_allocated())
    if options.get("patch", True):
        options.pop("patch", None)
        handle = fastplug.patch_model(model, **{"freeze_gc": False, "stack_projections": True, **options})
    run = torch.compile(model) if compiled else model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batches = e2e.token_batches(model.config.vocab_size, args.batch, args.seq, steps, 0, torch.device("cuda"))
    out = []
    model.train()
    for ids in batches:
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    if handle is not None:
        handle.restore()
    del model, run, opt
    torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="leave out the rows with one kernel off")
    args = parser.parse_args()
    rows = [("transformers", False, {"patch": False})]
    for mode in (True, False, "auto"):
        rows += [
            (f"fastplug gc={mode}", False, {"gradient_checkpointing": mode}),
            (f"fastplug gc={mode} compiled", True, {"gradient_checkpointing": mode}),
        ]
    rows.append(
        ("fastplug auto compiled, no stacking", True, {"gradient_checkpointing": "auto", "stack_projections": False})
    )
    for stack in (True, False):
        rows.append(
            (
                f"fastplug gc=False compiled, graph break at layer 0, stacking {stack}",
                True,
                {"gradient_checkpointing": False, "graph_break": True, "stack_projections": stack},
            )
        )
    rows.append(
        (
            "fastplug gc=True compiled, graph break at layer 0",
            True,
            {"gradient_checkpointing": True, "graph_break": True},
        )
    )
    for kernel in () if args.quick else KERNELS:
        rows.append(
            (f"fastplug gc=False compiled, {kernel} off", True, {"gradient_checkpointing": False, kernel: False})
        )
    results = []
    for name, compiled, options in rows:
        try:
            got = losses(compiled, args.steps, args, **dict(options))
        except Exception as e:  # a failing row is reported, the others still run
            got = f"{type(e).__name__}: {str(e)[:200]}"
        results.append((name, got))
        print(name, got, flush=True)
    ref = results[0][1]
    print("\n| row | losses | step-1 rel. diff vs transformers |\n|---|---|---|")
    for name, got in results:
        if isinstance(got, str):
            print(f"| {name} | {got} | - |")
            continue
        rel = abs(got[0] - ref[0]) / abs(ref[0]) if isinstance(ref, list) else float("nan")
        print(f"| {name} | {', '.join(f'{x:.5f}' for x in got)} | {rel:.1e} |")


if __name__ == "__main__":
    main()
