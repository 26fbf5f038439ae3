"""Gemma 4, tiny and random (hidden 64, 3 layers: sliding, full, full; the last one reads the second one's keys
and values (KV sharing); full layers with head_dim 32, one kv head and k = v; per-layer inputs; MoE block beside
the MLP): patched against unpatched transformers for LoRA (peft, every linear layer and the experts) and full
fine-tuning, generation, restore, the self-check, the trainer adapters, the language model inside
Gemma4ForConditionalGeneration, and what FastModel / fast_generate say about it.

Its fp32 gradients differ from float64 by up to ~1e-5 in plain torch already, so they are judged against float64:
within the fp32 bound, or no worse than a small multiple (4x) of torch's own fp32 error where that comes near it."""

import copy
import importlib
import warnings

import pytest
import torch
import transformers

from fastplug import FastKernels, FastModel, fast_generate
from fastplug.patch.engine import active_handle, patch_model
from tests.helpers import TOL, assert_close, rel_err

VOCAB = 128
# On a GPU machine the first two tests run the compiled kernels (the others test plumbing on the torch references).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYER_TYPES = ("sliding_attention", "full_attention", "full_attention")  # the last one must be full
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def text_config(moe: bool = False, **overrides):
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        max_position_embeddings=64,
        pad_token_id=0,
        sliding_window=6,
        layer_types=list(LAYER_TYPES),
        num_kv_shared_layers=1,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    )
    if moe:
        base.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return transformers.Gemma4TextConfig(**{**base, **overrides})


def _randomise(model):
    """Norm weights, router scales and layer scalars start at one: random values, so a wrong form shows. q/k norms
    around head_dim ** -0.25 and router weights of std 1, as `bench.presets._gemma4_init` says why."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(p.shape[0] ** -0.25)
            if name.endswith("router.proj.weight"):
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.8, 1.2)
    return model


def gemma4(moe: bool = False, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return _randomise(transformers.Gemma4ForCausalLM(text_config(moe, **overrides)))


def _ids(batch=2, tokens=8, seed=1, device="cpu"):
    return torch.randint(1, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed)).to(device)


def _step_grads(model, ids, **kwargs):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_as_good_as_torch(grads, torch_grads, float64_grads):
    assert grads.keys() == torch_grads.keys() == float64_grads.keys() and grads
    for name, grad in grads.items():
        ours, theirs = rel_err(grad, float64_grads[name]), rel_err(torch_grads[name], float64_grads[name])
        # twice the fp32 bound against float64 (AVX-512 CPUs' fp32 matmuls reach 1.4e-5 on a LoRA A gradient), or
        # where torch's own fp32 error comes near it, a small multiple of that
        assert ours <= max(2 * TOL[torch.float32], 4 * theirs), (
            f"grad of {name}: {ours:.2e} from float64, torch's {theirs:.2e}"
        )


def _module_identity(model):
    return [(name, id(m)) for name, m in model.named_modules()]


@pytest.fixture
def flash_heads_up_to_16(monkeypatch):
    """The full layers' 32-wide heads then pass the flash kernel's limit, as a real Gemma 4's 512 pass its 256:
    they take the model's own attention (fast_attention.py), the 16-wide sliding layers the kernel."""
    monkeypatch.setattr(importlib.import_module("fastplug.kernels.attention"), "MAX_HEAD_DIM", 16)


def test_moe_lora_self_check_generate_steps_and_restore(flash_heads_up_to_16):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", target_parameters=EXPERTS, init_lora_weights=False
    )
    model = get_peft_model(gemma4(moe=True).to(DEVICE), lora)
    reference, float64 = copy.deepcopy(model), copy.deepcopy(model).double()
    float64.get_base_model().set_experts_implementation("eager")  # grouped_mm has no float64
    modules, experts_before = _module_identity(model), model.config._experts_implementation
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*disagrees with the original modules")
        handle = patch_model(model, stack_projections=True, gradient_checkpointing=False)

    # every kind patched and shown equal on this model; what stays transformers' is said
    counts, summary = handle.counts, handle.summary()
    assert handle.check.ran and not handle.check.declined, summary
    assert counts["lm_head_loss"] == 1 and counts["attention"] == 3 and counts["mlp"] == 3
    assert counts["router"] == counts["experts"] == 3
    # LoRA on the experts as grouped terms where peft keeps the experts' layout (0.21 does, 0.18 not: reported)
    folded = [path for path, reason in handle.skipped if reason.startswith("experts_lora:")]
    assert counts.get("experts_lora", 0) + len(folded) == 3
    assert counts["lora_fused"] == 3 + 3 + counts.get("experts_lora", 0), "attention, MLP, experts"
    # 12 norms per layer (weightless v_norm and router norm included), no k/v norms on the sharing layer, 2 outside
    assert counts["rms_norm"] == 12 + 12 + 10 + 2
    assert "keys and values of an earlier full_attention layer (KV sharing)" in summary
    assert "per_layer_inputs: transformers' code" in summary
    assert "transformers' sdpa attention: head_dim 32 > the flash kernel's 16" in summary
    assert model.config._experts_implementation == "fastplug"

    # greedy generation with the KV cache (before training: the same weights)
    prompt = _ids(1, 4, seed=2, device=DEVICE)
    model.eval(), reference.eval()
    kwargs = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))

    # a LoRA step: loss as peft's, gradients as good as torch's against float64; after it, packed rows' loss
    # (position_ids restart; transformers looks for documents only without a cache) with the updated adapters
    ids = _ids(device=DEVICE)
    losses, grads = zip(*(_step_grads(m, ids) for m in (model, reference, float64)))
    assert_close(losses[0], losses[1], torch.float32, "loss")
    _assert_grads_as_good_as_torch(*grads)
    for m in (model, reference):
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2).step()
    packed = torch.cat([torch.arange(3), torch.arange(5)]).expand(2, -1).to(DEVICE)
    with torch.no_grad():
        out, ref = (m(input_ids=ids, labels=ids, position_ids=packed, use_cache=False) for m in (model, reference))
    assert_close(out.loss, ref.loss, torch.float32, "second loss, packed rows")

    # restore: the same module objects, no instance forward, the experts implementation back, weights untouched
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle.restore()
    assert _module_identity(model) == modules and not any("forward" in vars(m) for m in model.modules())
    assert model.config._experts_implementation == experts_before and active_handle(model) is None
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    attn = model.base_model.model.model.layers[0].self_attn
    storages = {getattr(attn, n).base_layer.weight.untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")}
    assert len(storages) == 3, "each stacked base has its own storage again"


def _vlm(seed=0):
    """Gemma4ForConditionalGeneration: the text model above (2 layers) and a 1-layer vision tower; images of 4 x 4
    patches pooled into 4 soft tokens; image tokens attend to each other both ways on sliding layers."""
    text = text_config(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0
    ).to_dict()
    text["use_bidirectional_attention"] = "vision"
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=16,
    )
    ids = dict(image_token_id=120, boi_token_id=121, eoi_token_id=122, video_token_id=123, audio_token_id=124)
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, boa_token_id=125, eoa_token_index=126, **ids
    )
    torch.manual_seed(seed)
    return _randomise(transformers.Gemma4ForConditionalGeneration(config))


def _image_batch():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 100, (1, 12), generator=generator)
    ids[0, 3], ids[0, 4:8], ids[0, 8] = 121, 120, 122  # begin, 4 image soft tokens, end
    grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    return dict(
        input_ids=ids,
        pixel_values=torch.rand(1, 16, 12, generator=generator),
        image_position_ids=grid,
        mm_token_type_ids=(ids == 120).long(),
        labels=ids.masked_fill(ids == 120, -100),
    )


def test_conditional_generation_patches_the_language_model_only():
    from peft import LoraConfig, get_peft_model

    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(_vlm().to(DEVICE), lora)
    reference, float64 = copy.deepcopy(model), copy.deepcopy(model).double()
    tower = model.get_base_model().model.vision_tower
    handle = patch_model(model, stack_projections=True, gradient_checkpointing=False, self_check=False)
    summary = handle.summary()
    assert handle.counts["attention"] == 2 and handle.counts["mlp"] == 2 and handle.counts["lora_fused"] == 4
    assert "model.vision_tower: not the language model: left as it is" in summary
    assert "lm_head_loss: Gemma4ForConditionalGeneration's forward" in summary
    assert not any("forward" in vars(m) for m in tower.modules()), "the vision tower is untouched"

    # one LoRA step on an image and text: the image tokens see each other both ways on the sliding layer
    batch = {k: v.to(DEVICE) for k, v in _image_batch().items()}
    float64_batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    results = []
    for m, inputs in ((model, batch), (reference, batch), (float64, float64_batch)):
        m.train()
        loss = m(**inputs, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert_close(results[0][0], results[1][0], torch.float32, "loss")
    _assert_grads_as_good_as_torch(results[0][1], results[1][1], results[2][1])
    handle.restore()
    assert not any("forward" in vars(m) for m in model.modules())


# The trainer adapters, FastModel and the bench: their plumbing, with the same patched forwards, on the kernels'
# torch references on CPU (marker torch_reference); the tests above run the kernels themselves.
def _pad_eos_bos():
    from tests.integrations.test_trl import TOKENIZER

    return {f"{name}_token_id": getattr(TOKENIZER, f"{name}_token_id") for name in ("pad", "eos", "bos")}


@pytest.mark.compat
@pytest.mark.torch_reference
def test_hf_trainer_and_fast_sft_trainer_match(tmp_path):
    from peft import LoraConfig
    from transformers import Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from fastplug.integrations.trl import FastSFTTrainer
    from tests.integrations.test_trl import TOKENIZER, common_args, losses, sft_dataset

    def trainer_run(callbacks):
        ids = _ids(4, 8, seed=4)
        data = [{"input_ids": row, "labels": row} for row in ids]
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=5e-3,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=gemma4(), args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        return trainer, torch.tensor(losses(trainer))

    fast = FastKernels()
    trainer, fast_losses = trainer_run([fast])
    _, ref_losses = trainer_run([])
    assert_close(fast_losses, ref_losses, torch.float32, "Trainer losses")
    assert "attention: 3" in fast.summary and "gradient checkpointing: on" in fast.summary
    assert active_handle(trainer.model) is None and not any("forward" in vars(m) for m in trainer.model.modules())

    def sft_run(trainer_cls):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        torch.manual_seed(5)
        trainer = trainer_cls(
            model=gemma4(**_pad_eos_bos()), args=SFTConfig(**common_args(tmp_path)), train_dataset=sft_dataset(),
            processing_class=TOKENIZER, peft_config=lora,
        )  # fmt: skip
        trainer.train()
        return trainer, torch.tensor(losses(trainer))

    trainer, fast_losses = sft_run(FastSFTTrainer)
    _, ref_losses = sft_run(SFTTrainer)
    assert "lora_fused" in trainer.fast_kernels_summary and "attention: 3" in trainer.fast_kernels_summary
    assert_close(fast_losses, ref_losses, torch.float32, "SFT losses")
    assert active_handle(trainer.model) is None


@pytest.mark.torch_reference
def test_fast_model_loads_it_and_fast_generate_says_why_not(tmp_path):
    for name, model in (("text", gemma4()), ("multimodal", _vlm())):
        model.save_pretrained(tmp_path / name)
        with pytest.warns(UserWarning, match="tokenizer"):
            loaded, tokenizer = FastModel.from_pretrained(str(tmp_path / name))
        assert type(loaded) is type(model) and tokenizer is None
        handle = active_handle(loaded)
        assert handle.counts["attention"] == len(model.get_decoder().layers) and not handle.check.declined
        with pytest.raises(ValueError, match="per-layer inputs, .*a norm on the values, a scalar on each layer"):
            loaded.fast_generate(_ids(1, 4), max_new_tokens=2)
    with pytest.raises(ValueError, match="keys and values shared between layers, values that are the keys"):
        fast_generate(gemma4(), _ids(1, 4), max_new_tokens=2)


@pytest.mark.torch_reference
def test_bench_e2e_presets_train_as_transformers():
    """`python -m fastplug.bench e2e --models gemma4,gemma4_moe`: the tiny presets build, patch and train with the
    losses of plain transformers (the workers' subprocess plumbing is the llama smoke's, tests/test_bench_smoke.py)."""
    from fastplug.bench import e2e

    for name in ("gemma4", "gemma4_moe"):
        losses = {}
        for impl in ("transformers", "fastplug"):
            model = e2e.build_model(name, tiny=True, device=torch.device("cpu"), seed=0)
            runner, _ = e2e.apply_impl(model, impl, True, {"freeze_gc": False, "self_check": False})
            params = [p for p in model.parameters() if p.requires_grad]
            batches = e2e.token_batches(VOCAB, 2, 8, 2, 0, torch.device("cpu"))
            losses[impl] = e2e.train_steps(runner, params, batches, 2, torch.device("cpu"), float("inf"))[1]
            if impl == "fastplug":
                handle = active_handle(model)
                assert handle.counts["attention"] == 3 and handle.counts.get("experts", 0) == 3 * (name == "gemma4_moe")
                handle.restore()
        for a, b in zip(losses["fastplug"], losses["transformers"]):
            assert abs(a - b) <= e2e.LOSS_TOLERANCE * abs(b), (name, losses)
