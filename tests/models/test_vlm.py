"""Vision-language models: the language model inside Gemma 3's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and
Qwen3-VL-MoE's ForConditionalGeneration is patched, the vision tower (and Gemma 3's projector) is left as it is.
Tiny random models (text: hidden 64, 2 layers; vision: 1 layer, 16 patches merged or pooled into 4 image tokens)
against unpatched transformers: a LoRA step on image + text (loss; LoRA gradients judged against float64), greedy
generation from the KV cache on text-only ids, restore(), the summary and the self-check.

What each brings: Gemma 3's image tokens attend to each other both ways (a mask its forward composes from
token_type_ids, which fastplug's attention must build, not skip); Qwen2-VL's and Qwen2.5-VL's multimodal RoPE, whose
(3, B, T, D) tables transformers 5.7's attention merges (5.24's rotary module merges them: both are run by `compat`);
Qwen3-VL's deepstack features, added to the first layers' hidden states by its text model's forward, which stays
transformers'; Qwen3-VL-MoE's experts.
"""

import copy
import inspect

import pytest
import torch
import transformers

from fastplug import fast_generate
from fastplug.models.families import FAMILIES
from fastplug.patch.engine import active_handle, patch_model
from tests.helpers import assert_close
from tests.models.test_gemma4 import _assert_grads_as_good_as_torch

VOCAB = 128
IMAGE, START, END = 120, 122, 123  # Qwen: image, vision start / end; Gemma 3: image, begin / end of image (121, 122)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# head_dim 16: 8 rotary frequencies in temporal / height / width sections
MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
# 4 x 4 patches of 4 x 4 pixels, merged 2 x 2 into 4 image tokens
QWEN_VISION = dict(depth=1, num_heads=2, patch_size=4, temporal_patch_size=1, spatial_merge_size=2)
QWEN_SPECIAL = dict(image_token_id=IMAGE, video_token_id=121, vision_start_token_id=START, vision_end_token_id=END)
QWEN3_VISION = dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=16,
                    deepstack_visual_indexes=[0])  # fmt: skip


def _gemma3():
    text = dict(TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=6, final_logit_softcapping=30.0,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=IMAGE, boi_token_index=121, eoi_token_index=122)  # fmt: skip
    return transformers.Gemma3ForConditionalGeneration(config)


def _qwen2_vl():
    vision = dict(QWEN_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2)
    config = transformers.Qwen2VLConfig(text_config={**TEXT, **MROPE}, vision_config=vision, **QWEN_SPECIAL)
    return transformers.Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl():
    vision = dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=8,
                  fullatt_block_indexes=[0])  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(text_config={**TEXT, **MROPE}, vision_config=vision, **QWEN_SPECIAL)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _qwen3_vl():
    text = dict(TEXT, head_dim=16, **MROPE)
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=QWEN3_VISION, **QWEN_SPECIAL)
    return transformers.Qwen3VLForConditionalGeneration(config)


def _qwen3_vl_moe():
    text = dict(TEXT, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **MROPE)
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=QWEN3_VISION, **QWEN_SPECIAL)
    return transformers.Qwen3VLMoeForConditionalGeneration(config)


# builder, the parts left as they are, the patches expected: norms (2 per layer, Gemma 3: 4; q/k norms; the final
# one), attention, MLP or experts
VLMS = {
    "gemma3": (_gemma3, ("model.vision_tower", "model.multi_modal_projector"),
               {"rms_norm": 13, "attention": 2, "mlp": 2}),
    "qwen2_vl": (_qwen2_vl, ("model.visual",), {"rms_norm": 5, "attention": 2, "mlp": 2}),
    "qwen2_5_vl": (_qwen2_5_vl, ("model.visual",), {"rms_norm": 5, "attention": 2, "mlp": 2}),
    "qwen3_vl": (_qwen3_vl, ("model.visual",), {"rms_norm": 9, "attention": 2, "mlp": 2}),
    "qwen3_vl_moe": (_qwen3_vl_moe, ("model.visual",), {"rms_norm": 9, "attention": 2, "experts": 2}),
}  # fmt: skip


def _vlm(name):
    torch.manual_seed(0)
    model = VLMS[name][0]()
    with torch.no_grad():  # norm weights start at one (Gemma's 1 + w at zero): random values, so a wrong form shows
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _image_batch(model):
    """One row of text around one image (4 image tokens); the image tokens take no loss."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 110, (1, 12), generator=g)
    if model.config.model_type == "gemma3":
        ids[0, 3], ids[0, 4:8], ids[0, 8] = 121, IMAGE, 122
        # the mask Gemma 3 composes: image tokens attend to each other both ways (transformers does so in training)
        batch = dict(pixel_values=torch.randn(1, 3, 16, 16, generator=g), token_type_ids=(ids == IMAGE).long())
    else:
        ids[0, 3], ids[0, 4:8], ids[0, 8] = START, IMAGE, END
        batch = dict(pixel_values=torch.randn(16, 48, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
        if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:  # transformers >= 5.17
            batch["mm_token_type_ids"] = (ids == IMAGE).int()
    return dict(batch, input_ids=ids, labels=ids.masked_fill(ids == IMAGE, -100))


def _step(model, batch):
    model.train()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# Qwen2-VL and Qwen3-VL-MoE take no kernel path of their own (Qwen2.5-VL's attention, Qwen3-VL's, Qwen3-MoE's
# experts): on CPU they run the kernels' torch references (CI time), the others the Triton interpreter
PLUMBING_ONLY = ("qwen2_vl", "qwen3_vl_moe")


@pytest.mark.compat
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.torch_reference] * (name in PLUMBING_ONLY)) for name in VLMS]
)
def test_language_model_patched_vision_tower_left(name):
    from peft import LoraConfig, get_peft_model

    _, towers, expected = VLMS[name]
    base = _vlm(name)
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    reference, float64 = copy.deepcopy(model), copy.deepcopy(model).double()
    if "experts" in expected:  # torch's grouped_mm has no float64
        float64.get_base_model().set_experts_implementation("eager")
    modules = [(n, id(m)) for n, m in model.named_modules()]
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    handle = patch_model(model, stack_projections=True, gradient_checkpointing=False, self_check=False)
    counts, summary = handle.counts, handle.summary()
    assert {kind: counts.get(kind) for kind in expected} == expected, summary
    assert counts["lora_fused"] == 2 + expected.get("mlp", 0), "the attention projections and the MLP"
    for tower in towers:
        assert f"{tower}: not the language model: left as it is" in summary
        assert not any("forward" in vars(m) for m in base.get_submodule(tower).modules()), f"{tower} is untouched"
    assert f"lm_head_loss: {type(base).__name__}'s forward (vision features merged" in summary
    if name == "gemma3":  # its masks with image tokens are built, not skipped for the flash kernel's causal one
        assert summary.count("a mask the model composes (image tokens attending both ways)") == 2

    # one LoRA step on an image and text: the loss as transformers', the LoRA gradients as good as torch's
    batch = _image_batch(base)
    float64_batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    (loss, grads), (ref_loss, ref_grads) = _step(model, batch), _step(reference, batch)
    assert_close(loss, ref_loss, torch.float32, "loss")
    _assert_grads_as_good_as_torch(grads, ref_grads, _step(float64, float64_batch)[1])

    # greedy generation from the KV cache on text-only ids
    prompt = torch.randint(3, 110, (1, 4), generator=torch.Generator().manual_seed(5))
    model.eval(), reference.eval()
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(input_ids=prompt, **kwargs), reference.generate(input_ids=prompt, **kwargs))
    with pytest.raises(ValueError, match="is a vision-language model .* Use model.generate"):
        fast_generate(model, prompt, max_new_tokens=3)

    # restore: the same modules, no instance forward, the weights bit for bit
    handle.restore()
    assert [(n, id(m)) for n, m in model.named_modules()] == modules and active_handle(model) is None
    assert not any("forward" in vars(m) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == weights.keys() and all(torch.equal(after[k], v) for k, v in weights.items())

    # with the self-check: every kind shown equal to the original on this model, none declined
    with patch_model(model, stack_projections=True, gradient_checkpointing=False) as handle:
        assert handle.check.ran and not handle.check.declined, handle.summary()
        assert {kind: handle.counts.get(kind) for kind in expected} == expected
    assert active_handle(model) is None

    if FAMILIES[name].rope == "multimodal":  # the RoPE patch off: the family's own rotation (5.7: the multimodal one)
        with torch.no_grad(), patch_model(model, rope=False, gradient_checkpointing=False, self_check=False):
            assert_close(model(**batch, use_cache=False).loss, ref_loss, torch.float32, "loss with rope=False")
