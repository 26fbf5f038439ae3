"""Where does a bf16 LoRA step lose precision? One batch of real text, each path against an fp32 truth.

    python scripts/precision_probe.py [--layers 4] [--batches 3]      (needs a GPU)

The model: Llama-1B widths (fewer layers by default), bf16 base, peft's default fp32 adapters (r16, alpha 32,
every linear layer) with lora_B set to small random values, as after some training. The truth is the same
model in fp32 (TF32 off), unpatched. For each path: the loss's signed difference to the truth (a bias shows
as the same sign on every batch), and the LoRA gradients' relative error, cosine and norm ratio to the truth.
Paths: transformers in bf16, fastplug with everything, and fastplug with one kernel family at a time.
CPU runs are not meaningful: the Triton interpreter truncates fp32 -> bf16 casts where a GPU rounds.
"""

import argparse
import copy

import torch

from fastplug.bench.text import stdlib_bytes

OFF = dict(rms_norm=False, rope=False, mlp=False, cross_entropy=False, lora=False, attention=False, moe=False)


def build(layers):
    import transformers as T
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                           attn_implementation="sdpa")  # fmt: skip
    model = T.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 2e-3)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None])
    return loss.item(), grads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    import fastplug
    from fastplug.options import KernelOptions

    off = {k: v for k, v in OFF.items() if k in KernelOptions.field_names()}
    model = build(args.layers)
    truth_model = copy.deepcopy(model).float()
    model.train(), truth_model.train()
    tokens = stdlib_bytes(args.batches * args.batch * args.seq).cuda().view(args.batches, args.batch, args.seq)
    paths = {"transformers bf16": None, "fastplug (all)": {}}
    paths.update({f"fastplug {k} only": {**off, k: True} for k in off})
    rows = {name: [] for name in paths}
    for ids in tokens:
        truth_loss, truth_grads = loss_and_grads(truth_model, ids)
        for name, options in paths.items():
            handle = (
                fastplug.patch_model(model, gradient_checkpointing=False, **options) if options is not None else None
            )
            loss, grads = loss_and_grads(model, ids)
            if handle is not None:
                handle.restore()
            rows[name].append((
                loss - truth_loss,
                ((grads - truth_grads).norm() / truth_grads.norm()).item(),
                torch.nn.functional.cosine_similarity(grads, truth_grads, dim=0).item(),
                (grads.norm() / truth_grads.norm()).item(),
            ))  # fmt: skip
    print(
        f"\n| path ({args.layers} layers, {args.batch}x{args.seq}) | loss - fp32 loss per batch | grad rel err | "
        "grad cosine | grad norm ratio |"
    )
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        diffs = " ".join(f"{d:+.5f}" for d, *_ in values)
        mean = [sum(v[i] for v in values) / len(values) for i in range(1, 4)]
        print(f"| {name} | {diffs} | {mean[0]:.4f} | {mean[1]:.5f} | {mean[2]:.4f} |")


if __name__ == "__main__":
    main()
