"""FastModel: loading (patched, tokenizer with a pad token, RoPE scaling, clear errors), get_peft_model's
defaults and warnings, for_inference / for_training. Tiny models saved locally; nothing downloaded."""

import warnings

import pytest
import torch
import transformers

from fastplug import FastKernels, FastModel, KernelOptions
from fastplug.models.peft_lora import lora_projection
from fastplug.patch import checkpointing
from fastplug.patch.engine import active_handle
from tests.model_path_helpers import EOS, save_tiny
from tests.models.tiny import batch

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama")


def test_from_pretrained_loads_patches_and_gives_a_pad_token(tmp_path):
    path = save_tiny(tmp_path, "llama", tokenizer_pad=False)
    model, tokenizer = FastModel.from_pretrained(path, dtype="bfloat16")
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert next(model.parameters()).dtype == torch.bfloat16
    handle = active_handle(model)
    assert handle is not None and handle.counts.get("rms_norm", 0) > 0
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.pad_token_id == EOS
    assert callable(model.fast_generate)
    assert "fast_generate" not in vars(transformers.LlamaForCausalLM)  # the instance only


def test_from_pretrained_options_and_attention(llama_path):
    model, _ = FastModel.from_pretrained(
        llama_path, options=KernelOptions(rms_norm=False, gradient_checkpointing=False), attn_implementation="eager"
    )
    handle = active_handle(model)
    assert "rms_norm" not in handle.counts
    assert not checkpointing.is_enabled(model)
    as_dict, _ = FastModel.from_pretrained(llama_path, options={"rms_norm": False, "gradient_checkpointing": False})
    assert active_handle(as_dict).options == handle.options


def test_from_pretrained_scales_rope_beyond_the_trained_length(llama_path):
    plain, _ = FastModel.from_pretrained(llama_path)
    model, _ = FastModel.from_pretrained(llama_path, max_seq_length=256)  # trained: 64 positions
    params = model.config.rope_parameters
    assert params["rope_type"] == "linear" and params["factor"] == pytest.approx(4.0)
    assert model.config.max_position_embeddings == 256
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq / 4)
    same, _ = FastModel.from_pretrained(llama_path, max_seq_length=32)  # within range: untouched
    assert same.config.rope_parameters.get("rope_type", "default") == "default"


def test_from_pretrained_errors_and_unknown_families(tmp_path, monkeypatch):
    import fastplug.patch.engine

    monkeypatch.setattr(fastplug.patch.engine, "_warned_model_types", set())  # warned once per process
    with pytest.raises(ValueError, match="dtype"):
        FastModel.from_pretrained(str(tmp_path), dtype="int8")
    with pytest.raises(ValueError, match="max_seq_length"):
        FastModel.from_pretrained(str(tmp_path), max_seq_length=0)
    with pytest.raises(ValueError, match="options"):
        FastModel.from_pretrained(str(tmp_path), options="rope")
    with pytest.raises(TypeError, match="valid options"):  # before anything loads
        FastModel.from_pretrained(str(tmp_path), options={"flash": True})
    vit = tmp_path / "vit"
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(vit)
    with pytest.raises(ValueError, match="causal-LM"):
        FastModel.from_pretrained(str(vit))
    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    with pytest.warns(UserWarning, match="not a supported family"):
        model, tokenizer = FastModel.from_pretrained(str(gpt2))
    assert isinstance(model, transformers.GPT2LMHeadModel) and tokenizer is None  # no tokenizer saved there


def test_get_peft_model_defaults_keep_the_fused_path(llama_path):
    model, _ = FastModel.from_pretrained(llama_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = FastModel.get_peft_model(model, random_state=0)
    assert not [w for w in caught if "fastplug" in str(w.message)]  # the defaults warn about nothing
    config = peft_model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (16, 16, 0.0, "none")
    lora_layers = [m for m in peft_model.modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert len(lora_layers) == 2 * 7  # every linear layer of 2 decoder layers, not the LM head
    assert all(lora_projection(m) is not None and lora_projection(m).lora_A is not None for m in lora_layers)
    assert checkpointing.is_enabled(peft_model)
    assert callable(peft_model.fast_generate)
    again = FastModel.get_peft_model(FastModel.from_pretrained(llama_path)[0], random_state=0)
    for a, b in zip(peft_model.parameters(), again.parameters()):
        assert torch.equal(a, b)  # random_state seeds the adapters


@pytest.mark.parametrize(
    "kwargs, what",
    [({"lora_dropout": 0.1}, "lora_dropout=0.1"), ({"use_dora": True}, "use_dora=True")],
)
def test_get_peft_model_warns_when_the_fused_path_turns_off(llama_path, kwargs, what):
    model, _ = FastModel.from_pretrained(llama_path)
    with pytest.warns(UserWarning, match=what):
        FastModel.get_peft_model(model, r=4, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"r": 0}, "r must"),
        ({"lora_alpha": -1}, "lora_alpha"),
        ({"lora_dropout": 1.5}, "lora_dropout"),
        ({"bias": "some"}, "bias"),
        ({"use_gradient_checkpointing": "sometimes"}, "use_gradient_checkpointing"),
        ({"use_gradient_checkpointing": 1}, "use_gradient_checkpointing"),
    ],
)
def test_get_peft_model_rejects_bad_arguments(llama_path, kwargs, match):
    model, _ = FastModel.from_pretrained(llama_path)
    with pytest.raises(ValueError, match=match):
        FastModel.get_peft_model(model, **kwargs)


def test_get_peft_model_twice_is_an_error(llama_path):
    peft_model = FastModel.get_peft_model(FastModel.from_pretrained(llama_path)[0], r=4)
    with pytest.raises(ValueError, match="already has peft adapters"):
        FastModel.get_peft_model(peft_model)


def test_inference_and_training_modes_toggle(llama_path):
    model, _ = FastModel.from_pretrained(llama_path)
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=True)
    FastModel.for_inference(peft_model)
    assert not peft_model.training and not checkpointing.is_enabled(peft_model) and model.config.use_cache
    FastModel.for_training(peft_model)
    assert peft_model.training and checkpointing.is_enabled(peft_model) and not model.config.use_cache
    assert active_handle(peft_model) is not None  # the patches stay through both
    no_checkpointing = FastModel.get_peft_model(
        FastModel.from_pretrained(llama_path)[0], r=4, use_gradient_checkpointing=False
    )
    assert not checkpointing.is_enabled(no_checkpointing)
    FastModel.for_training(no_checkpointing)
    assert not checkpointing.is_enabled(no_checkpointing)


def test_auto_checkpointing_plans_against_the_options_memory_budget(llama_path):
    """gradient_checkpointing="auto" keeps the memory_budget of the options, whether the options or
    get_peft_model's use_gradient_checkpointing ask for it, through for_inference / for_training."""
    for mode in ("auto", False):
        model, _ = FastModel.from_pretrained(
            llama_path, options=KernelOptions(gradient_checkpointing=mode, memory_budget=0.5)
        )
        peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="auto")
        FastModel.for_training(FastModel.for_inference(peft_model))
        assert vars(model)[checkpointing._AUTO].fraction == 0.5
    active_handle(peft_model).restore()  # without the patch, FastModel still plans against the options' budget
    FastModel.for_training(FastModel.for_inference(peft_model))
    assert vars(model)[checkpointing._AUTO].fraction == 0.5


def test_checkpointing_turned_off_stays_off_under_an_auto_plan(llama_path):
    """for_inference turns "auto" checkpointing off for good: its plan no longer sets the layers' flags at the
    next training forward (a plan measured on a GPU would); for_training plans afresh."""
    model, _ = FastModel.from_pretrained(llama_path)
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="auto")
    plan = vars(model)[checkpointing._AUTO]
    plan.bytes_per_token, plan.room = 1.0, -1.0  # as measured on a GPU without room: every layer but the last
    data = batch(batch_size=2, tokens=8)
    FastModel.for_inference(peft_model).train()
    peft_model(**data).loss.backward()
    assert not checkpointing.is_enabled(peft_model) and checkpointing._AUTO not in vars(model)
    FastModel.for_training(peft_model)
    assert checkpointing.is_enabled(peft_model) and vars(model)[checkpointing._AUTO] is not plan


@pytest.mark.torch_reference  # the Trainer's plumbing around the patch, not the kernels' numbers
def test_fast_model_patch_outlives_a_fastkernels_run(llama_path, tmp_path):
    """FastKernels trains on the patch FastModel made and leaves it in place: for_training/for_inference and
    fast_generate go on with it afterwards; its own restore() gives the originals back."""
    model, _ = FastModel.from_pretrained(llama_path)
    peft_model = FastModel.get_peft_model(model, r=4)
    handle = active_handle(peft_model)
    data = batch(batch_size=4, tokens=8)
    dataset = [{k: v[i] for k, v in data.items()} for i in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    transformers.Trainer(model=peft_model, args=args, train_dataset=dataset, callbacks=[FastKernels()]).train()
    assert active_handle(peft_model) is handle and handle.is_active
    assert any("forward" in vars(m) for m in model.modules())
    FastModel.for_training(peft_model)
    assert active_handle(peft_model) is handle
    handle.restore()
    assert active_handle(peft_model) is None and not any("forward" in vars(m) for m in model.modules())


def test_fast_model_is_not_instantiated():
    with pytest.raises(TypeError, match="from_pretrained"):
        FastModel()


def test_from_pretrained_load_in_4bit_gives_fused_qlora(llama_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from fastplug.models.peft_lora import lora_projection

    model, _ = FastModel.from_pretrained(llama_path, load_in_4bit=True, device_map="cpu")
    assert model.config.quantization_config.bnb_4bit_quant_type == "nf4"
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    peft_model = FastModel.get_peft_model(model, r=4, random_state=0)
    lora_layers = [m for m in peft_model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(lora_layers) == 2 * 7  # peft's 4-bit LoRA layers, all on the fused 4-bit path
    assert all(lora_projection(m, quantized=True) is not None for m in lora_layers)
    ids = torch.randint(3, 60, (2, 9))
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.lora_B["default"].weight.grad is not None for m in lora_layers)
    with pytest.raises(ValueError, match="not both"):
        FastModel.from_pretrained(llama_path, load_in_4bit=True, quantization_config=object())
