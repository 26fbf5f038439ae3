"""Qwen3.5 (dense, MoE, the language model of Qwen3_5ForConditionalGeneration) and Qwen3-Next: hybrids of Gated
DeltaNet linear-attention layers and output-gated attention. Tiny random models, patched against unpatched
transformers in fp32: LoRA losses and gradients over steps, greedy generation from the cache, restore(), the
summary, the self-check; the HF Trainer and FastSFTTrainer; fast_generate and FastModel."""

import copy
import inspect

import pytest
import torch
import transformers

from fastplug.patch.engine import patch_model
from tests.helpers import TOL, assert_close, rel_err

VOCAB = 128
# one linear-attention layer and one full-attention layer; grouped values (1 q/k head, 2 value heads)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    layer_types=["linear_attention", "full_attention"],
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)
CONFIGS = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
    # Qwen3-Next's own part is its linear layers' fused projections; its MoE blocks are Qwen2-MoE's (dense MLPs here)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {"mlp_only_layers": [0, 1]}),
}
PROJECTIONS = {  # the linear-attention layer's projections, by layout
    "qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(family: str, seed: int = 0, **overrides):
    config_name, model_name, extra = CONFIGS[family]
    config = getattr(transformers, config_name)(**{**TEXT, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # the norms start at zero (1 + w) and one: randomise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def lora(model, family: str):
    from peft import LoraConfig, get_peft_model

    targets = LORA_TARGETS + PROJECTIONS["qwen3_next" if family == "qwen3_next" else "qwen3_5"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, config)


def tokens(batch=2, length=9, seed=1):
    """input_ids, attention_mask (left padding on the first row) and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_and_grads(model, inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_steps(model, reference, batches):
    """Losses (aux loss too) and gradients equal transformers' over an SGD step per batch. Gradients are judged against
    a float64 copy: within fp32's bound, or within twice transformers' own fp32 error where a batch's gradients
    are ill-conditioned and transformers is further off than that. Every copy steps with the float64 gradients,
    so each step compares them at the same parameters (the fused paths' adapter copies must follow them)."""
    truth = copy.deepcopy(reference).double()
    if getattr(truth.config, "_experts_implementation", None) not in (None, "eager"):
        truth.get_base_model().set_experts_implementation("eager")  # grouped_mm takes no float64
    models = (model, reference, truth)
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in models]
    for step, inputs in enumerate(batches):
        (out, grads), (ref, ref_grads), (_, exact) = (_loss_and_grads(m, inputs) for m in models)
        assert_close(out.loss, ref.loss, torch.float32, f"step {step} loss")
        if getattr(ref, "aux_loss", None) is not None:
            assert_close(out.aux_loss, ref.aux_loss, torch.float32, f"step {step} aux loss")
        assert grads.keys() == ref_grads.keys() == exact.keys() and grads
        for name, grad in grads.items():
            bound = 2 * max(TOL[torch.float32], rel_err(ref_grads[name], exact[name]))
            assert_close(grad, exact[name], torch.float32, f"step {step} grad of {name}", tol=bound)
        for m, optimizer in zip(models, optimizers):
            for name, p in m.named_parameters():
                if name in exact:
                    p.grad = exact[name].to(p.dtype)
            optimizer.step()


def _generate(model, ids, attention_mask=None):
    model.eval()
    # transformers 5.7's MoE forward fails computing the router loss of a decode step: none while generating
    moe = {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
    return model.generate(ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0, **moe)


@pytest.mark.compat
@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_hybrid_matches_transformers(family):
    """LoRA on every projection (the linear-attention ones fused into one node per layer), stacked bases as a trainer
    run patches: losses and gradients over two steps, greedy generation through the cache (the prefill fills the
    linear layer's conv and recurrent states, transformers' decode steps go on from them), summary, restore."""
    model = lora(tiny(family), family)
    reference = copy.deepcopy(model)
    handle = patch_model(model, stack_projections=True, gradient_checkpointing=False)
    counts = handle.counts
    assert handle.check is not None and handle.check.ran and not handle.check.declined, handle.summary()
    assert counts["linear_attention"] == 1 and counts["rms_norm_gated"] == 1 and counts["attention"] == 1
    # peft >= 0.21 maps gate/up/down_proj of a qwen3_next model onto experts' 3-D weights (none here): its MLPs then
    # carry no adapter
    mlps_with_lora = sum(hasattr(getattr(m, "gate_proj", None), "lora_A") for m in model.modules())
    assert counts["lm_head_loss"] == 1 and counts["lora_fused"] == 2 + mlps_with_lora, handle.summary()
    if family == "qwen3_5_moe":
        assert counts["experts"] == 2 and counts["router"] == 2 and counts["mlp"] == 2  # mlp: the shared experts
    summary = handle.summary()
    assert "linear_attention: 1" in summary and "Gated DeltaNet" in summary
    steps = 2 if family == "qwen3_5" else 1  # the others: one step
    _assert_same_steps(model, reference, [tokens(seed=step + 1) for step in range(steps)])

    prompt = tokens(batch=2, length=6, seed=5)  # the first row left-padded: pads zeroed before the convolution
    prompt = (prompt["input_ids"], prompt["attention_mask"])
    assert torch.equal(_generate(model, *prompt), _generate(reference, *prompt))

    handle.restore()
    assert not any("forward" in vars(m) for m in model.modules())
    probe = tokens(seed=7)
    del probe["labels"]
    with torch.no_grad():
        assert torch.equal(model(**probe).logits, reference(**probe).logits)


def test_conditional_generation_patches_the_language_model_only():
    """Qwen3_5ForConditionalGeneration: the language model patched, the vision tower left as it is; a LoRA step on
    image + text equals transformers'."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip
    special = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=vision, **special)
    torch.manual_seed(0)
    base = transformers.Qwen3_5ForConditionalGeneration(config)
    model = lora(base, "qwen3_5")
    reference = copy.deepcopy(model)
    vision_modules = {name: vars(m).get("forward") for name, m in base.model.visual.named_modules()}

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 110, (1, 10), generator=g)
    ids[0, 2], ids[0, 3:7], ids[0, 7] = 122, 120, 123  # one image of 4x4 patches, merged 2x2: 4 image tokens
    inputs = dict(input_ids=ids, labels=ids, pixel_values=torch.randn(16, 48, generator=g),
                  image_grid_thw=torch.tensor([[1, 4, 4]]))  # fmt: skip
    if "mm_token_type_ids" in inspect.signature(type(base).forward).parameters:  # transformers >= 5.17
        inputs["mm_token_type_ids"] = (ids == 120).int()

    with patch_model(model, gradient_checkpointing=False) as handle:
        assert handle.counts["linear_attention"] == 1 and handle.counts["attention"] == 1
        assert ("model.visual", "not the language model: left as it is") in handle.skipped
        assert "lm_head_loss: Qwen3_5ForConditionalGeneration's forward" in handle.summary()
        assert not handle.check.declined, handle.summary()
        assert {n: vars(m).get("forward") for n, m in base.model.visual.named_modules()} == vision_modules
        _assert_same_steps(model, reference, [inputs])


def test_trainer_and_sft_trainer(tmp_path):
    """FastKernels() in the HF Trainer and FastSFTTrainer (with their default gradient checkpointing: the linear
    layers recomputed in backward), a step each: transformers' losses, the model restored."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from fastplug import FastKernels
    from fastplug.integrations.trl import FastSFTTrainer
    from fastplug.patch.engine import active_handle
    from tests.integrations.test_trl import TOKENIZER, common_args, losses, sft_dataset

    special = {f"{n}_token_id": getattr(TOKENIZER, f"{n}_token_id") for n in ("pad", "eos", "bos")}
    data = tokens(batch=4, length=9, seed=3)
    rows = [{k: v[i] for k, v in data.items()} for i in range(4)]
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, learning_rate=5e-3,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)  # fmt: skip

    def hf_losses(callbacks):
        trainer = Trainer(model=lora(tiny("qwen3_5"), "qwen3_5"), args=TrainingArguments(**args), train_dataset=rows,
                          callbacks=callbacks)  # fmt: skip
        trainer.train()
        return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h]), trainer.model

    fast = FastKernels()
    patched, model = hf_losses([fast])
    assert_close(patched, hf_losses([])[0], torch.float32, "Trainer losses")
    assert "linear_attention: 1" in fast.summary and "declined" not in fast.summary
    assert "gradient checkpointing: on" in fast.summary  # the linear layers ran again inside backward
    assert active_handle(model) is None and not any("forward" in vars(m) for m in model.modules())

    def sft(cls):
        model = lora(tiny("qwen3_5", **special), "qwen3_5")
        args = SFTConfig(**{**common_args(tmp_path), "max_steps": 1})
        trainer = cls(model=model, args=args, train_dataset=sft_dataset(), processing_class=TOKENIZER)
        trainer.train()
        return torch.tensor(losses(trainer)), trainer

    patched, trainer = sft(FastSFTTrainer)
    assert "linear_attention: 1" in trainer.fast_kernels_summary
    assert_close(patched, sft(SFTTrainer)[0], torch.float32, "FastSFTTrainer losses")


def test_fast_generate_and_fast_model_say_why_not(tmp_path):
    """FastModel loads and patches a saved Qwen3.5; model.generate runs it; fast_generate, whose static KV cache
    holds no recurrent states, raises a ValueError that says so."""
    from fastplug import FastModel, KernelOptions, fast_generate
    from fastplug.patch.engine import active_handle

    tiny("qwen3_5").save_pretrained(tmp_path)
    model, _ = FastModel.from_pretrained(str(tmp_path), options=KernelOptions(self_check=False))
    assert "linear_attention: 1" in active_handle(model).summary()
    prompt = tokens(batch=1, length=5)["input_ids"]
    assert _generate(model, prompt).shape == (1, 9)
    for call in (
        lambda: model.fast_generate(prompt, max_new_tokens=2),
        lambda: fast_generate(model, prompt, max_new_tokens=2),
    ):
        with pytest.raises(ValueError, match="1 linear-attention \\(Gated DeltaNet\\) layers of 2"):
            call()


def test_linear_attention_layer_compiles_fullgraph():
    """torch.compile traces a patched Gated DeltaNet decoder layer (LoRA fused) without a graph break: the conv, the
    delta rule and the gated norm are registered operators; output and gradients equal eager's to fp32 rounding."""
    from fastplug.patch.engine import patch_model

    model = lora(tiny("qwen3_5"), "qwen3_5")
    patch_model(model, self_check=False, gradient_checkpointing=False)
    decoder = model.base_model.model.model
    layer = decoder.layers[0]
    hidden = torch.randn(2, 9, TEXT["hidden_size"], requires_grad=True)
    rotary = decoder.rotary_emb(hidden, torch.arange(9)[None])
    params = [hidden] + [p for p in layer.parameters() if p.requires_grad]
    model.train()

    def run(fn):
        out = fn(hidden)
        return [out, *torch.autograd.grad(out.pow(2).sum(), params)]

    eager = run(lambda h: layer(h, position_embeddings=rotary))
    compiled = run(torch.compile(lambda h: layer(h, position_embeddings=rotary), backend="aot_eager", fullgraph=True))
    # equal to fp32 rounding: aot_eager's decompositions may order a sum differently on some CPUs (AVX-512: 8e-7)
    for i, (a, b) in enumerate(zip(compiled, eager)):
        assert rel_err(a, b) <= 2e-6, f"output {i}: {rel_err(a, b):.1e} from eager"
