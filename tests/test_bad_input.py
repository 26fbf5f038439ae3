"""Bad input gets a clear error, never a quiet wrong number (issue 33): out-of-range labels through the fused
LM-head loss, FP8 restore, option types, the logits the fused loss skips, empty batches and meta models."""

import dataclasses
import gc
import re

import pytest
import torch

import fastplug
from fastplug import KernelOptions
from fastplug.patch.engine import active_handle
from tests.models.tiny import VOCAB, batch, tiny_model

# ------------------------------------------------------------------------------------ out-of-range labels


@pytest.mark.parametrize("bad", [VOCAB, 263, -5])
def test_out_of_range_label_raises_through_the_patched_model(bad):
    model = tiny_model("llama")
    fastplug.patch_model(model, gradient_checkpointing=False)
    model.train()
    inputs = batch(seed=torch.randint(0, 1000, ()).item())
    inputs["labels"][1, 7] = bad
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        model(**inputs)
    inputs["labels"][1, 7] = -100  # the ignore index stays fine
    assert torch.isfinite(model(**inputs).loss)


def test_trainer_stops_at_an_out_of_range_label(tmp_path):
    # Before: the loss was NaN, the Trainer logged 0.0 and kept updating the weights.
    from transformers import Trainer, TrainingArguments

    data = batch(batch_size=4, tokens=10, seed=3)
    data["labels"][2, 5] = VOCAB + 7
    rows = [{k: v[i] for k, v in data.items()} for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1)  # fmt: skip
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[fastplug.FastKernels()])
    modules = dict(model.named_modules())
    with pytest.raises(IndexError, match=f"Target {VOCAB + 7} is out of bounds"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # The Trainer has no event for a failed run: FastKernels restores through the train() it wraps
    assert all(m is modules[n] for n, m in model.named_modules()) and active_handle(model) is None
    assert gc.get_freeze_count() == 0, "the run's freeze of Python's collector ends with it"
    data["labels"][2, 5] = 1  # a later train() patches again and runs
    trainer.train_dataset = [{k: v[i] for k, v in data.items()} for i in range(4)]
    trainer.train()
    assert all(m is modules[n] for n, m in model.named_modules()) and gc.get_freeze_count() == 0


# ----------------------------------------------------------------------------------------- option types

BOOL_OPTIONS = [f.name for f in dataclasses.fields(KernelOptions) if f.type == "bool"]
OPTIONAL_BOOL_OPTIONS = [f.name for f in dataclasses.fields(KernelOptions) if f.type == "bool | None"]


def test_every_switch_is_checked():
    assert {"rope", "rms_norm", "cross_entropy", "fp8", "fp8_keep_original"} <= set(BOOL_OPTIONS)
    assert set(OPTIONAL_BOOL_OPTIONS) == {"stack_projections", "freeze_gc", "bucket_lengths", "cuda_graphs"}


@pytest.mark.parametrize("value", [0, 1.5, True, "0.5", None])
def test_memory_budget_must_be_a_fraction(value):
    with pytest.raises(ValueError, match=rf"memory_budget must be a fraction in \(0, 1\]; got {value!r}"):
        KernelOptions(memory_budget=value)


@pytest.mark.parametrize("value", [0, -0.5, True, "half", None])
def test_graphs_memory_must_be_a_positive_fraction(value):
    with pytest.raises(
        ValueError, match=f"graphs_memory must be a positive fraction of the peak memory; got {value!r}"
    ):
        KernelOptions(graphs_memory=value)


@pytest.mark.parametrize("name", BOOL_OPTIONS + OPTIONAL_BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, 1.0, [True]])
def test_a_switch_that_is_not_a_bool_raises_naming_it(name, value):
    expected = "True, False or None" if name in OPTIONAL_BOOL_OPTIONS else "True or False"
    with pytest.raises(TypeError, match=rf"option {name} must be {expected}; got {value!r}".replace("[", r"\[")):
        KernelOptions(**{name: value})
    with pytest.raises(TypeError, match=name):
        KernelOptions.build(**{name: value})


def test_rope_no_is_an_error_not_rope_on():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="rope must be True or False; got 'no'"):
        fastplug.patch_model(model, rope="no")
    assert not any("forward" in vars(m) for m in model.modules())  # nothing patched


def test_none_only_where_none_means_something():
    for name in OPTIONAL_BOOL_OPTIONS:
        assert getattr(KernelOptions(**{name: None}), name) is None
    with pytest.raises(TypeError, match="rope must be True or False; got None"):
        KernelOptions(rope=None)
    options = KernelOptions(rope=False, freeze_gc=True, stack_projections=False, gradient_checkpointing="auto")
    assert options.rope is False and options.gradient_checkpointing == "auto"


# ------------------------------------------------------------------------------------------ FP8 restore


def _frozen_bf16_llama():
    model = tiny_model("llama", seed=torch.randint(0, 1000, ()).item()).to(torch.bfloat16)
    return model.requires_grad_(False)


def test_fp8_restore_gives_back_the_frozen_base_exactly_by_default(recwarn):
    model = _frozen_bf16_llama()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    handle = fastplug.patch_model(model, fp8=True, gradient_checkpointing=False)
    assert handle.counts["fp8_linear"] == 14
    with torch.no_grad():
        assert torch.isfinite(model(**batch()).loss)
    handle.restore()
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    assert not [w for w in recwarn if "FP8" in str(w.message)]


def test_lossy_fp8_restore_is_an_explicit_choice_that_warns():
    model = _frozen_bf16_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = fastplug.patch_model(model, fp8=True, fp8_keep_original=False, gradient_checkpointing=False)
    with pytest.warns(UserWarning, match=r"14 frozen linear weights dequantized from FP8.*fp8_keep_original=True"):
        handle.restore()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == 14 and all(".layers." in n for n in changed)


# ----------------------------------------------------------------------------- logits of the fused loss


def _patched_and_reference():
    seed = torch.randint(0, 1000, ()).item()
    model, reference = tiny_model("llama", seed=seed), tiny_model("llama", seed=seed)
    fastplug.patch_model(model, gradient_checkpointing=False)
    return model.train(), reference.train()


def test_fused_loss_leaves_logits_none_and_skip_logits_false_returns_them():
    model, reference = _patched_and_reference()
    inputs = batch(seed=torch.randint(0, 1000, ()).item())
    expected = reference(**inputs)
    fused = model(**inputs)
    assert fused.logits is None and "logits" not in fused.keys()  # the documented choice: None, not a tensor
    torch.testing.assert_close(fused.loss, expected.loss)
    both = model(**inputs, skip_logits=False)  # asked for: the original forward, logits and loss
    torch.testing.assert_close(both.logits, expected.logits)
    torch.testing.assert_close(both.loss, expected.loss)
    both.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_skip_logits_true_fuses_outside_training_and_is_checked():
    model, reference = _patched_and_reference()
    model.eval(), reference.eval()
    inputs = batch(seed=torch.randint(0, 1000, ()).item())
    with torch.no_grad():
        expected = reference(**inputs)
        assert model(**inputs).logits is not None  # eval: logits by default
        fused = model(**inputs, skip_logits=True)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, expected.loss)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=inputs["input_ids"], skip_logits=True)
    with pytest.raises(TypeError, match="skip_logits must be True, False or None; got 'no'"):
        model(**inputs, skip_logits="no")


def test_trainer_evaluation_gets_logits_for_compute_metrics(tmp_path):
    # Trainer evaluation runs the model in eval mode: the fused loss stays out of it, predictions are logits
    from transformers import Trainer, TrainingArguments

    data = batch(batch_size=6, tokens=10, seed=torch.randint(0, 1000, ()).item())
    rows = [{k: v[i] for k, v in data.items()} for i in range(6)]
    seen = []

    def compute_metrics(prediction):
        seen.append(torch.as_tensor(prediction.predictions))
        labels = torch.as_tensor(prediction.label_ids)[:, 1:]
        correct = (seen[-1][:, :-1].argmax(-1) == labels)[labels != -100]
        return {"accuracy": correct.float().mean().item()}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=3,
                             max_steps=1, eval_strategy="steps", eval_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True, logging_steps=1)  # fmt: skip
    model = tiny_model("llama")
    trainer = Trainer(model=model, args=args, train_dataset=rows[:2], eval_dataset=rows,
                      compute_metrics=compute_metrics, callbacks=[fastplug.FastKernels()])  # fmt: skip
    trainer.train()
    metrics = [h for h in trainer.state.log_history if "eval_accuracy" in h]
    assert len(metrics) == 1 and len(seen) == 1 and seen[0].shape == (6, 10, VOCAB)
    model.eval()  # restored by now, with the weights evaluation saw
    with torch.no_grad():
        expected = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    torch.testing.assert_close(seen[0], expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- empty batches, empty rows, meta models


@pytest.mark.parametrize("shape, what", [((0, 9), "an empty batch \\(0 rows\\)"), ((3, 0), "rows of length 0")])
@pytest.mark.parametrize("training", [True, False])
def test_empty_batches_and_rows_say_what_is_wrong(shape, what, training):
    # Plain transformers fails reshaping inside attention ("cannot reshape tensor of 0 elements")
    model = tiny_model("llama")
    fastplug.patch_model(model, gradient_checkpointing=False)
    model.train(training)
    ids = torch.randint(1, VOCAB, shape)
    with pytest.raises(ValueError, match=re.escape(f"input_ids has shape {tuple(shape)}: ") + what):
        model(input_ids=ids, labels=ids)
    embeds = torch.randn(*shape, 64)
    with pytest.raises(ValueError, match=f"inputs_embeds has shape .*{what}"):
        model(inputs_embeds=embeds)
    ok = torch.randint(1, VOCAB, (2, 5))
    assert torch.isfinite(model(input_ids=ok, labels=ok).loss)


def _meta_llama():
    from transformers import LlamaForCausalLM

    from tests.models.tiny import tiny_config

    with torch.device("meta"):
        return LlamaForCausalLM(tiny_config("llama"))


def test_a_meta_model_patches_and_computes_once_loaded():
    # The patches read the weights at call time: patch, then load (FSDP2's meta-device init does it in that order)
    model = _meta_llama()
    handle = fastplug.patch_model(model, gradient_checkpointing=False)
    assert handle.counts["lm_head_loss"] == 1 and handle.counts["attention"] == 2
    source = tiny_model("llama", seed=torch.randint(0, 1000, ()).item())
    model.to_empty(device="cpu")
    model.load_state_dict(source.state_dict())
    model.model.rotary_emb.inv_freq.copy_(source.model.rotary_emb.inv_freq)  # a buffer left out of state_dict
    inputs = batch(seed=torch.randint(0, 1000, ()).item())
    model.train(), source.train()
    torch.testing.assert_close(model(**inputs).loss, source(**inputs).loss)
    handle.restore()


def test_fp8_on_a_meta_model_asks_for_its_weights_first():
    # Before: the meta weights were skipped, so the loaded model ran in bf16 with nothing but a summary line
    model = _meta_llama().requires_grad_(False)
    with pytest.raises(ValueError, match=r"fp8=True quantizes .* 21 of 21 parameters .* meta device .*Load them first"):
        fastplug.patch_model(model, fp8=True)
    assert not any("forward" in vars(m) for m in model.modules()) and active_handle(model) is None


def test_weights_an_accelerate_hook_loads_are_not_missing():
    from fastplug.models.fp8 import meta_parameters

    model = _meta_llama()
    for layer in model.model.layers:
        layer._hf_hook = object()  # what accelerate's offload attaches: it brings the weights in at forward time
    missing = meta_parameters(model)
    assert missing and not [n for n in missing if ".layers." in n]
    assert "model.embed_tokens.weight" in missing and "lm_head.weight" in missing
