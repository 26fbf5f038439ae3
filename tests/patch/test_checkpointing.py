"""Gradient checkpointing: the model's own, restored exactly; "offload" trains like plain checkpointing."""

import copy

import pytest
import torch

from fastplug.patch import checkpointing
from fastplug.patch.engine import patch_model
from tests.helpers import assert_close, checkpointing_on
from tests.models.tiny import batch, tiny_model


def _checkpointing_attributes(model):
    return [
        (name, key, value)
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if key in ("gradient_checkpointing", "_gradient_checkpointing_func", "_require_grads_hook")
    ]


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_native_checkpointing_is_turned_on_and_restored_exactly():
    model = tiny_model("llama")
    before = _checkpointing_attributes(model)
    handle = patch_model(model, gradient_checkpointing=True)
    assert checkpointing_on(model) and "non-reentrant" in handle.summary()
    handle.restore()
    assert _checkpointing_attributes(model) == before


def test_last_layer_runs_unchecked_and_computes_the_same():
    """Checkpointing the last layer would only repeat its forward (its recompute comes right after the loss):
    it runs once a step, the other layers twice, and the gradients are those of every layer checkpointed."""
    model = tiny_model("llama", num_hidden_layers=3)
    inputs = batch()
    layers = checkpointing.decoder_layers(model)
    calls = []
    for i, layer in enumerate(layers):  # on the MLP: a recompute calls the layer's forward, not its __call__
        layer.mlp.register_forward_pre_hook(lambda module, args, i=i: calls.append(i))
    with patch_model(model, gradient_checkpointing=True) as handle:
        calls.clear()  # the patch's self-check ran the first layer
        model.train()
        assert [layer.gradient_checkpointing for layer in layers] == [True, True, False]
        assert "the last layer unchecked" in handle.summary()
        loss, grads = _step(model, inputs)
        assert sorted(calls) == [0, 0, 1, 1, 2], "layers 0 and 1 recomputed in backward, the last one not"
        layers[-1].gradient_checkpointing = True
        all_loss, all_grads = _step(model, inputs)
    assert torch.equal(loss, all_loss)
    assert grads.keys() == all_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], all_grads[name]), name


def test_offload_without_cuda_falls_back_with_a_warning():
    if torch.cuda.is_available():
        pytest.skip("the fallback is for machines without CUDA")
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="offload"):
        handle = patch_model(model, gradient_checkpointing="offload")
    assert checkpointing_on(model) and "offload needs CUDA" in handle.summary()
    handle.restore()


def _install(model, func):
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module._gradient_checkpointing_func = func


@pytest.mark.parametrize("lora", [False, True])
def test_offload_function_matches_plain_checkpointing(lora):
    """The offload autograd function (on CPU the host copy is a clone) gives plain checkpointing's grads,
    also for a peft model whose layer inputs do not require grad."""
    model = tiny_model("llama")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False))
    model.train()
    checkpointing.enable_native(model)
    if lora:  # layer inputs then carry no grad: the offload function must still reach the LoRA weights
        model.get_base_model().disable_input_require_grads()
    reference = copy.deepcopy(model)
    _install(model, checkpointing.OffloadCheckpoint())
    inputs = batch()
    loss, grads = _step(model, inputs)
    ref_loss, ref_grads = _step(reference, inputs)
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_matches_plain_checkpointing():
    model = tiny_model("llama").cuda().train()
    reference = copy.deepcopy(model)
    inputs = {k: v.cuda() for k, v in batch(tokens=64).items()}
    with patch_model(model, gradient_checkpointing="offload") as handle:
        assert "offload" in handle.summary() and "needs CUDA" not in handle.summary()
        losses = [_step(model, inputs)[0] for _ in range(2)]
        _, grads = _step(model, inputs)
    with patch_model(reference, gradient_checkpointing=True):
        ref_losses = [_step(reference, inputs)[0] for _ in range(2)]
        _, ref_grads = _step(reference, inputs)
    for loss, ref in zip(losses, ref_losses):
        assert_close(loss, ref, torch.float32, "loss")
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")


@pytest.mark.parametrize("reference_pass", [False, True])
def test_recompute_reuses_the_views_of_its_forward(monkeypatch, reference_pass):
    """A checkpoint's recompute (in backward) takes the fused views its forward used instead of asking peft
    again, also after a no_grad forward in between with the adapters off (DPO's reference pass inside
    `disable_adapter()`); the gradients are the plain ones."""
    from peft import LoraConfig, get_peft_model

    from fastplug.models import projections

    def lora_model():
        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        return get_peft_model(tiny_model("llama"), config).train()

    asked = []
    fused = projections.fused_projections
    monkeypatch.setattr(projections, "fused_projections", lambda *m: asked.append(m) or fused(*m))
    model, reference = lora_model(), lora_model()
    handle = patch_model(model, gradient_checkpointing=True)
    inputs = batch()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    assert asked
    if reference_pass:
        with torch.no_grad(), model.disable_adapter():
            model(**inputs)
    asked.clear()
    loss.backward()
    assert not asked
    ref_loss, ref_grads = _step(reference, inputs)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_close(loss.detach(), ref_loss, torch.float32, "loss")
    assert grads.keys() == ref_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")
    handle.restore()


def test_a_run_in_auto_mode_takes_the_models_own_auto_plan_and_leaves_it():
    """FastModel's "auto" plan on the model (one AutoCheckpointing, its hooks) serves a trainer run in "auto" mode
    too: no second plan (two sets of hooks would both set the layers' flags), and the run's undo leaves it."""
    model = tiny_model("llama")
    own = checkpointing.enable(model, "auto")
    hooks = list(own._hooks)
    run = checkpointing.TrainerCheckpointing(model, "auto")
    assert run.auto is own and vars(model)[checkpointing._AUTO] is own
    run.undo()
    assert vars(model)[checkpointing._AUTO] is own and own._hooks == hooks, "the model's plan outlives the run"
    alone = tiny_model("llama")
    run = checkpointing.TrainerCheckpointing(alone, "auto")
    assert vars(alone)[checkpointing._AUTO] is run.auto
    run.undo()
    assert checkpointing._AUTO not in vars(alone), "a plan the run made goes with it"
    own.remove()


def test_a_run_in_offload_mode_puts_its_one_offload_back_without_walking_the_model(monkeypatch):
    """At each step the offload mode goes back on the layers found once: the layers the trainer turned plain
    checkpointing on for again (TRL's DPO does around each reference pass) get the run's one OffloadCheckpoint
    back, and the last layer its flag, with no walk of the model's modules."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # install_offload's check; nothing runs here
    model = tiny_model("llama")
    checkpointing.enable_native(model)
    run = checkpointing.TrainerCheckpointing(model, "offload")
    layers = checkpointing.decoder_layers(model)
    offload = layers[0]._gradient_checkpointing_func
    assert isinstance(offload, checkpointing.OffloadCheckpoint) and not layers[-1].gradient_checkpointing

    walks = []
    modules = torch.nn.Module.modules
    monkeypatch.setattr(torch.nn.Module, "modules", lambda self: walks.append(self) or modules(self))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # the trainer
    assert all(layer.gradient_checkpointing for layer in layers)
    assert all(layer._gradient_checkpointing_func is not offload for layer in layers)
    walks.clear()
    run.reapply()
    assert walks == []
    assert all(layer._gradient_checkpointing_func is offload for layer in layers)
    assert [layer.gradient_checkpointing for layer in layers] == [True] * (len(layers) - 1) + [False]
    run.undo()
