"""Every supported family, tiny and random: patched vs unpatched loss, gradients and logits (fp32), and
restore() giving back the original forwards with bit-identical outputs."""

import copy

import pytest
import torch

from fastplug.patch.engine import patch_model
from tests.helpers import assert_close
from tests.models.tiny import FAMILIES, batch, tiny_model

# On a GPU machine these run the compiled Triton kernels against that machine's transformers version.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(family, **overrides):
    return tiny_model(family, **overrides).to(DEVICE)


def _batch(**kwargs):
    return {k: v.to(DEVICE) for k, v in batch(**kwargs).items()}


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Dense MLP modules per family (MoE experts are fused 3-D parameters; Qwen2-MoE has shared experts).
DENSE_MLPS = {"mixtral": 0, "qwen3_moe": 0}


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same_training_step(patched, reference, inputs):
    patched.train(), reference.train()
    out, grads = _loss_and_grads(patched, inputs)
    ref_out, ref_grads = _loss_and_grads(reference, inputs)
    assert out.logits is None, "the fused LM-head loss returns no logits"
    assert_close(out.loss, ref_out.loss, torch.float32, "loss")
    if getattr(ref_out, "aux_loss", None) is not None:
        assert_close(out.aux_loss, ref_out.aux_loss, torch.float32, "aux_loss")
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")


def _eval_logits(model, inputs):
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


@pytest.mark.compat
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_family_matches_unpatched(family):
    model = _model(family)
    reference = copy.deepcopy(model)
    inputs = _batch()
    original_logits = _eval_logits(reference, inputs)

    handle = patch_model(model, gradient_checkpointing=False)
    counts = handle.counts
    assert counts["lm_head_loss"] == 1 and counts["attention"] == 2 and counts["rms_norm"] >= 5
    assert counts.get("mlp", 0) == DENSE_MLPS.get(family, 2)
    _assert_same_training_step(model, reference, inputs)
    assert_close(_eval_logits(model, inputs), original_logits, torch.float32, "eval logits")

    handle.restore()
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(_eval_logits(model, inputs), original_logits)


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "qwen3_moe"])
def test_patched_lora_matches_peft(family):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    model = get_peft_model(_model(family), config)
    reference = copy.deepcopy(model)
    inputs = _batch()

    # with the model's own checkpointing and stacked bases, as a trainer adapter's run would patch it
    with patch_model(model, stack_projections=True) as handle:
        # peft 0.21 maps gate/up/down_proj onto MoE experts' 3-D weights (ParamWrapper): "experts_lora"
        fused = handle.counts.get("mlp", 0) + handle.counts["attention"] + handle.counts.get("experts_lora", 0)
        assert handle.counts["lora_fused"] == fused
        _assert_same_training_step(model, reference, inputs)
        # the frozen q/k/v (and gate/up) bases ran as one matrix per layer: one storage per group
        assert all(len(_storages(model, names)) == 1 for names in _stacked_groups(family))
        # disable_adapter() after patching: the fused path computes the base model
        with model.disable_adapter(), reference.disable_adapter():
            assert_close(_eval_logits(model, inputs), _eval_logits(reference, inputs), torch.float32, "base")
    assert torch.equal(_eval_logits(model, inputs), _eval_logits(reference, inputs))
    # restore gives every weight its own storage again (what safetensors needs to save the model)
    assert all(len(_storages(model, names)) == len(names) for names in _stacked_groups(family))


def test_bases_are_stacked_only_for_a_run_scoped_patch():
    """patch_model and FastModel leave the weights' storage alone by default (their patch may outlive
    training); the trainer adapters' run-scoped options stack the frozen bases."""
    from peft import LoraConfig, get_peft_model

    from fastplug import KernelOptions

    assert KernelOptions().stack_projections is None
    assert KernelOptions().scoped_to_run().stack_projections is True
    assert KernelOptions(stack_projections=False).scoped_to_run().stack_projections is False
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    model = get_peft_model(_model("llama"), config)
    with patch_model(model):
        _loss_and_grads(model, _batch())
        assert len(_storages(model, ("q_proj", "k_proj", "v_proj"))) == 3


def _stacked_groups(family):
    groups = [("q_proj", "k_proj", "v_proj")]
    return groups + ([("gate_proj", "up_proj")] if DENSE_MLPS.get(family, 2) else [])


def _storages(model, names) -> set:
    """The storages of the first layer's base weights `names` (attention or MLP projections)."""
    layer = model.base_model.model.model.layers[0]
    owner = layer.self_attn if names[0] == "q_proj" else layer.mlp
    return {getattr(owner, n).base_layer.weight.untyped_storage().data_ptr() for n in names}


def test_unfusable_lora_is_reported_and_still_matches():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.1, init_lora_weights=False)
    model = get_peft_model(_model("llama"), config)
    reference = copy.deepcopy(model)
    handle = patch_model(model, gradient_checkpointing=False)
    assert "lora_fused" not in handle.counts
    assert any("lora_dropout > 0" in reason for _, reason in handle.skipped)
    inputs = _batch()
    assert_close(_eval_logits(model, inputs), _eval_logits(reference, inputs), torch.float32, "logits")
    handle.restore()


@pytest.mark.compat
def test_eager_attention_and_generation_with_cache():
    model = _model("llama", attn_implementation="eager")
    reference = copy.deepcopy(model)
    inputs = _batch(batch_size=1, tokens=6)
    with patch_model(model):
        _assert_same_training_step(model, reference, inputs)
        model.eval(), reference.eval()
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        generated = model.generate(inputs["input_ids"], **kwargs)
        assert torch.equal(generated, reference.generate(inputs["input_ids"], **kwargs))


def test_patched_mlp_reuses_the_projection_outputs_only_when_no_hook_sees_them():
    """The dense MLP patch passes reuse_inputs unless a forward hook (on a projection, inside it, or global)
    sees the outputs the backward would overwrite."""
    from torch import nn

    from fastplug.models.projections import outputs_private

    class Wrapped(nn.Module):  # a peft-like layer whose output can be its inner layer's own
        def __init__(self):
            super().__init__()
            self.base_layer = nn.Linear(4, 4)

    gate, up = Wrapped(), nn.Linear(4, 4)
    assert outputs_private(gate, up)
    handle = gate.base_layer.register_forward_hook(lambda *_: None)
    assert not outputs_private(gate, up)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
    assert not outputs_private(gate, up)
    handle.remove()
    assert outputs_private(gate, up)


def test_patched_attention_rotates_in_place_only_when_no_hook_sees_the_projections(monkeypatch):
    """Without LoRA the patched attention rotates q and k in the projections' own buffers; a forward hook
    that keeps q_proj's output turns that off, so what it kept is still the projection, and so does a KV
    cache (it keeps the rotated keys, where backward would write their gradients)."""
    from fastplug.models import attention

    asked = []
    rope = attention.rope
    monkeypatch.setattr(attention, "rope", lambda *a, inplace: asked.append(inplace) or rope(*a, inplace=inplace))
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    # no self-check: its forwards (run unless an earlier test's verdict is reused) would call rope too
    with patch_model(model, gradient_checkpointing=False, self_check=False):
        model.train()
        model(**_batch(), use_cache=False).loss.backward()
        kept = []
        attn.q_proj.register_forward_hook(lambda module, args, out: kept.append((args[0].detach(), out)))
        model(**_batch(), use_cache=False).loss.backward()
        assert asked == [True, True, False, True], "layer 0's hook turns it off for layer 0 alone"
        model(**_batch(), use_cache=True).loss.backward()
        assert asked[4:] == [False, False], "a cache keeps the keys"
    x, q = kept[0]
    assert torch.equal(q, torch.nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias))
