"""Convergence on real text: transformers vs fastplug, per-step losses over many steps.

    python scripts/convergence.py MODE IMPL      # MODE lora|full, IMPL hf|fastplug ; prints RESULT json
    python scripts/convergence.py all            # runs the four in subprocesses and compares
    python scripts/convergence.py all lora:hf,lora:fastplug_nolora   # a chosen list of MODE:IMPL
      (IMPL: hf, hf2 = transformers again, fastplug, fastplug_nolora, fastplug_loraonly, hf_fp32 = transformers
       with the base in fp32 too: the precision reference)
    CONVERGENCE_OPTIM=fused|foreach (default fused, the HF Trainer's default optimizer)

Text: the Python standard library's own source files (real text nobody here wrote), byte-level tokens.
Same seed, same batches. LoRA mode: Llama-1B shape, LoRA r16 on all linear layers, 120 steps.
Full mode: a 1024-wide 8-layer Llama, every weight trained (norm dW, trained LM head), 120 steps.
"""

import json
import os
import subprocess
import sys
import time

import torch

from fastplug.bench.text import stdlib_bytes


def run(mode, impl, steps=120, bs=4, seq=2048):
    import transformers as T
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    if mode == "lora":
        cfg = T.LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
    else:
        cfg = T.LlamaConfig(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
            attn_implementation="sdpa",
        )
    model = T.LlamaForCausalLM(cfg).to("cuda", torch.float32 if impl == "hf_fp32" else torch.bfloat16)
    if mode == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
        lr = 1e-3
    else:
        model = model.float()  # full fine-tuning in fp32 master weights under bf16 autocast
        lr = 3e-4
    torch.backends.cuda.matmul.allow_tf32 = (
        True  # hf_fp32: TF32 products (10-bit mantissa, fp32 sums), 3 bits over bf16
    )
    if impl.startswith("fastplug"):
        import fastplug

        opts = {
            "fastplug_nolora": dict(lora=False),
            "fastplug_loraonly": dict(rms_norm=False, rope=False, mlp=False, cross_entropy=False),
        }.get(impl, {})
        h = fastplug.patch_model(model, **opts)
        print(h.summary().splitlines()[1], file=sys.stderr)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode == "lora":
            model.enable_input_require_grads()
    model.train()
    fused = os.environ.get("CONVERGENCE_OPTIM", "fused") == "fused"
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0, fused=fused, foreach=not fused
    )
    toks = stdlib_bytes(steps * bs * seq + 1).cuda()
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        chunk = toks[i * bs * seq : (i + 1) * bs * seq].view(bs, seq)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(mode == "full")):
            loss = model(input_ids=chunk, labels=chunk).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    losses = [float(x) for x in losses]
    return dict(
        mode=mode,
        impl=impl,
        seconds=round(time.perf_counter() - t0, 1),
        losses=losses,
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
    )


if __name__ == "__main__":
    if sys.argv[1] != "all":
        print("RESULT " + json.dumps(run(sys.argv[1], sys.argv[2])), flush=True)
        sys.exit()
    res = {}
    plan = [(m, i) for m in ("lora", "full") for i in ("hf", "fastplug")]
    if len(sys.argv) > 2:
        plan = [tuple(x.split(":")) for x in sys.argv[2].split(",")]
    for mode, impl in plan:
        if True:
            p = subprocess.run([sys.executable, __file__, mode, impl], capture_output=True, text=True, timeout=400)
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(mode, impl, "FAILED", p.stderr[-2000:])
                continue
            res[(mode, impl)] = json.loads(line[0][7:])
            r = res[(mode, impl)]
            print(
                mode,
                impl,
                "s",
                r["seconds"],
                "peak",
                r["peak_gib"],
                "loss first/mid/last",
                [round(r["losses"][i], 4) for i in (0, 59, -1)],
                flush=True,
            )
    base = os.environ.get("CONVERGENCE_BASE", "hf")  # hf_fp32: compare each run with the fp32 run
    for (mode, impl), r in res.items():
        if impl != base and (mode, base) in res:
            a, b = res[(mode, base)]["losses"], r["losses"]
            rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
            tail = sum(a[-20:]) / 20, sum(b[-20:]) / 20

            def ma(x):
                return [sum(x[i : i + 10]) / 10 for i in range(0, len(x), 10)]

            worse = sum(y > x for x, y in zip(ma(a), ma(b)))
            print(
                f"{mode} {impl} vs {base}: max rel per-step diff {max(rel):.4f}, mean last 20: {base} {tail[0]:.4f} "
                f"{impl} {tail[1]:.4f} ({(tail[1] - tail[0]) / tail[0] * 100:+.2f}%), "
                f"higher in {worse}/{len(ma(a))} windows"
            )
    out = os.environ.get("OUT", "/tmp")
    json.dump({f"{k[0]}_{k[1]}": v for k, v in res.items()}, open(os.path.join(out, "convergence.json"), "w"))
