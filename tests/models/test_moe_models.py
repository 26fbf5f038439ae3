"""Tiny Qwen3-MoE, Qwen2-MoE and Mixtral on the fastplug experts: logits, loss, router aux loss and gradients
match the unpatched model, full fine-tuning and LoRA (on attention; on attention and the experts through
peft's target_parameters); the experts implementation is switched on the instance and switched back."""

import copy

import pytest
import torch

from fastplug.patch.engine import patch_model
from tests.helpers import assert_close
from tests.models.test_families import _assert_same_training_step, _batch, _eval_logits, _model

MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_full_finetuning_matches_and_restores(family):
    model = _model(family)
    other = _model(family)  # another instance: must stay on transformers' experts
    reference = copy.deepcopy(model)
    inputs = _batch()
    original = _eval_logits(reference, inputs)
    before = model.config._experts_implementation

    handle = patch_model(model, gradient_checkpointing=False)
    assert handle.counts["experts"] == 2 and handle.counts["router"] == 2
    assert model.config._experts_implementation == "fastplug"
    assert other.config._experts_implementation == before
    assert "paths:" in handle.summary() and "fastplug grouped GEMM experts" in handle.summary()
    _assert_same_training_step(model, reference, inputs)
    assert_close(_eval_logits(model, inputs), original, torch.float32, "eval logits")

    handle.restore()
    assert model.config._experts_implementation == before
    assert torch.equal(_eval_logits(model, inputs), original)


# LoRA on attention alone (experts frozen, on the fastplug experts) runs for Qwen3-MoE in test_families.py.
@pytest.mark.parametrize("family, on_experts", [(f, True) for f in MOE_FAMILIES] + [("mixtral", False)])
def test_moe_lora_matches_peft(family, on_experts):
    from peft import LoraConfig, get_peft_model

    extra = dict(target_parameters=EXPERT_PARAMETERS) if on_experts else {}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False, **extra)
    model = get_peft_model(_model(family), config)
    reference = copy.deepcopy(model)
    inputs = _batch()
    with patch_model(model) as handle:  # with checkpointing, as training runs
        assert handle.counts.get("experts_lora", 0) == (2 if on_experts else 0)
        if on_experts:
            summary = handle.summary()
            assert "grouped rank-r terms" in summary and "gate_up_proj r=4" in summary and "down_proj r=4" in summary
        _assert_same_training_step(model, reference, inputs)
        with model.disable_adapter(), reference.disable_adapter():  # a DPO reference pass
            assert_close(_eval_logits(model, inputs), _eval_logits(reference, inputs), torch.float32, "base")
    assert torch.equal(_eval_logits(model, inputs), _eval_logits(reference, inputs))


def test_moe_option_off_leaves_experts_alone():
    model = _model("qwen3_moe")
    with patch_model(model, moe=False) as handle:
        assert "experts" not in handle.counts and "router" not in handle.counts
        assert model.config._experts_implementation != "fastplug"
