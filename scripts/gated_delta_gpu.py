"""GPU: Gated DeltaNet (Qwen3.5's linear-attention layer) at real widths, forward + backward, with and without
flash-linear-attention (fla): is fla worth depending on, and how far does fastplug's own scan get?

    python scripts/gated_delta_gpu.py                       # both parts, Qwen3.5-2B-class widths, 4 x 2048 tokens
    python scripts/gated_delta_gpu.py --widths 35b-a3b --batch 2 --seq 4096
    FASTPLUG_BENCH_FLA=/tmp/site-fla python scripts/gated_delta_gpu.py   # where the fla wheels are unpacked

1. The delta rule alone (q, k, v, g, beta -> o, bf16 inputs): transformers' `torch_chunk_gated_delta_rule` (its
   path without fla), fla's `chunk_gated_delta_rule`, fastplug's (`kernels.delta_rule`, Triton scan). Median
   ms of forward + backward (triton.testing.do_bench), peak memory above the inputs, and the relative error of
   the output and of the five input gradients against the same maths in float64 (chunked, in torch).
2. One linear-attention layer (`Qwen3_5GatedDeltaNet`, bf16, LoRA r=16 on its five projections): transformers
   without and with fla, fastplug patched without and with fla. Median ms, peak memory, and the output's and
   input gradient's relative difference from transformers' own (no fla) on the same weights and inputs.

Each row runs in its own process: transformers picks fla when its modeling module is imported, and a row
without fla must not see it (fastplug/bench/_fla.py). Rows whose implementation cannot run say why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WIDTHS = {  # hidden, linear q/k heads, linear value heads, their head dim; tiny: the CPU smoke run (--tiny)
    "2b": dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=16, head=128),
    "35b-a3b": dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, head=128),
    "9b": dict(hidden_size=4096, linear_num_key_heads=16, linear_num_value_heads=32, head=128),
    "tiny": dict(hidden_size=64, linear_num_key_heads=1, linear_num_value_heads=2, head=16),
}
RULE_IMPLS = ("transformers", "fla", "fastplug")
LAYER_IMPLS = ("transformers", "transformers_fla", "fastplug", "fastplug_fla")
PROJECTIONS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def _config(args):
    from transformers import Qwen3_5TextConfig

    widths = dict(WIDTHS[args["widths"]])
    head = widths.pop("head")
    return Qwen3_5TextConfig(
        **widths,
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        vocab_size=1024,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
    )


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _bench(fn, grads_of):
    import time

    import torch

    if not torch.cuda.is_available():  # the CPU smoke run: wall time of a few calls, no memory figure
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) / 2 * 1e3, 0.0
    from triton.testing import do_bench

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = do_bench(fn, warmup=5, rep=30, grad_to_none=grads_of)
    return ms, peak


def _rule_inputs(args, seed=0):
    import torch

    torch.manual_seed(seed)
    w = WIDTHS[args["widths"]]
    b, t, hk, h, d = args["batch"], args["seq"], w["linear_num_key_heads"], w["linear_num_value_heads"], w["head"]
    dev = _device()
    q, k = (torch.randn(b, t, hk, d, device=dev) for _ in range(2))
    v = torch.randn(b, t, h, d, device=dev)
    g = -torch.nn.functional.softplus(torch.randn(b, t, h, device=dev)) * torch.rand(h, device=dev) * 4
    beta = torch.rand(b, t, h, device=dev)
    return [q, k, v, g, beta]


def rule_worker(args):
    import torch

    from fastplug.kernels import delta_rule

    impl = args["impl"]
    inputs = [t.to(torch.bfloat16 if i < 3 else t.dtype) for i, t in enumerate(_rule_inputs(args))]
    inputs[4] = inputs[4].to(torch.bfloat16)  # beta as the layer makes it (sigmoid of a bf16 projection)
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    if impl == "transformers":
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        def rule(q, k, v, g, beta):
            return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    else:
        chosen = "fla" if impl == "fla" else "triton"

        def rule(q, k, v, g, beta):
            return delta_rule.gated_delta_rule(q, k, v, g, beta, implementation=chosen)[0]

    do = torch.randn(leaves[2].shape, device=leaves[2].device, dtype=torch.bfloat16)

    def step():
        rule(*leaves).backward(do)

    ms, peak = _bench(step, leaves)
    for t in leaves:
        t.grad = None
    out = rule(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    # the truth: the same chunked maths in float64 (fastplug's torch stages, checked against the token-by-token
    # recurrence in tests/kernels/test_linear_attention.py)
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    parts = delta_rule._prepare(*exact).parts
    o, _ = delta_rule._scan_reference(parts, False)
    ref = delta_rule._finish(o, exact[0].shape[0], exact[0].shape[1], torch.float64)
    ref_grads = torch.autograd.grad(ref, exact, do.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    errors = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
    return dict(ms=ms, peak_mib=peak, errors=errors)


def layer_worker(args, out_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(_config(args)).to(_device(), torch.bfloat16)
    torch.manual_seed(1)
    lora = LoraConfig(r=16, lora_alpha=16, target_modules=PROJECTIONS, init_lora_weights=False)
    model = get_peft_model(model, lora)
    note = ""
    if args["impl"].startswith("fastplug"):
        from fastplug.patch.engine import patch_model

        handle = patch_model(model, gradient_checkpointing=False, self_check=False, stack_projections=True)
        note = next((taken for path, taken in handle.paths if path.endswith("linear_attn")), "")
    layer = model.base_model.model.model.layers[0].linear_attn
    torch.manual_seed(2)
    shape = (args["batch"], args["seq"], model.config.hidden_size)
    hidden = torch.randn(shape, device=_device(), dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(shape, device=_device(), dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        layer(hidden).backward(dy)

    ms, peak = _bench(step, [hidden, *params])
    hidden.grad = None
    out = layer(hidden)
    (dh,) = torch.autograd.grad(out, [hidden], dy)
    torch.save({"out": out.detach().cpu(), "dh": dh.cpu()}, out_path)
    return dict(ms=ms, peak_mib=peak, note=note)


def worker_main(spec: str) -> int:
    args = json.loads(spec)
    from fastplug.bench import _fla

    uses_fla = args["impl"] == "fla" or args["impl"].endswith("_fla")
    try:
        fla_note = _fla.select(uses_fla)
        result = rule_worker(args) if args["part"] == "rule" else layer_worker(args, args["out_path"])
        result["fla"] = fla_note
    except Exception as exc:  # report the row, run the others
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _run(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, timeout=900
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    return {"error": f"worker exited with code {proc.returncode}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="2b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--parts", default="rule,layer")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and sizes: a CPU smoke run of the script")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)
    if args.tiny:
        args.widths, args.batch, args.seq = "tiny", 1, 70
    base = dict(widths=args.widths, batch=args.batch, seq=args.seq)
    print(f"Gated DeltaNet, {args.widths} widths {WIDTHS[args.widths]}, {args.batch} x {args.seq} tokens, bf16")
    if "rule" in args.parts:
        errors = "rel. error vs float64: o, dq, dk, dv, dg, dbeta"
        print(f"\n| delta rule | ms fwd+bwd | vs transformers | peak MiB | {errors} |")
        print("|---|---|---|---|---|")
        baseline = None
        for impl in RULE_IMPLS:
            res = _run(dict(base, part="rule", impl=impl))
            if "error" in res:
                print(f"| {impl} | - | - | - | {res['error']} |")
                continue
            baseline = baseline or res["ms"]
            errors = ", ".join(f"{e:.1e}" for e in res["errors"])
            print(f"| {impl} | {res['ms']:.2f} | {baseline / res['ms']:.2f}x | {res['peak_mib']:.0f} | {errors} |")
    if "layer" in args.parts:
        print("\n| layer (LoRA r=16) | ms fwd+bwd | vs transformers | peak MiB | rel. diff out / d hidden | path |")
        print("|---|---|---|---|---|---|")
        import torch

        folder = tempfile.mkdtemp(prefix="gated_delta_")
        baseline, reference = None, None
        for impl in LAYER_IMPLS:
            out_path = os.path.join(folder, f"{impl}.pt")
            res = _run(dict(base, part="layer", impl=impl, out_path=out_path))
            if "error" in res:
                print(f"| {impl} | - | - | - | - | {res['error']} |")
                continue
            saved = torch.load(out_path)
            reference = reference or saved
            diff = " / ".join(
                f"{((saved[k].double() - reference[k].double()).norm() / reference[k].double().norm()).item():.1e}"
                for k in ("out", "dh")
            )
            baseline = baseline or res["ms"]
            path = res.get("note") or res.get("fla", "")
            print(
                f"| {impl} | {res['ms']:.2f} | {baseline / res['ms']:.2f}x | {res['peak_mib']:.0f} | {diff} | {path} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
