"""The attention patch through fastplug's attention ("fastplug" in transformers' AttentionInterface): tiny
models whose sequences are longer than their sliding windows and the kernel's blocks, patched vs unpatched
loss and LoRA gradients on unpadded, packed (padding-free) and padded batches."""

import copy
import sys

import pytest
import torch

from fastplug.models import fast_attention
from fastplug.patch.engine import patch_model
from tests.helpers import assert_close
from tests.models.test_families import _loss_and_grads
from tests.models.tiny import VOCAB, tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOKENS = 37  # > the windows (6) and the interpreter's 16/32 blocks
DOCS = (13, 5, 19)  # packed row: position_ids restart per document
# The attention patch with its LoRA QKV/O and RoPE; the norm, MLP and loss kernels (tested elsewhere) stay off
# to spare the interpreter.
ATTENTION_FOCUS = dict(gradient_checkpointing=False, rms_norm=False, mlp=False, cross_entropy=False)
# family -> config overrides: Mistral slides everywhere, Gemma2 alternates windowed/full with a softcap (and
# runs eager attention in transformers), Gemma3 has local and global layers.
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "gemma2": {"attn_implementation": "eager"},
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]},
}


def _lora_model(family):
    from peft import LoraConfig, get_peft_model

    model = tiny_model(family, max_position_embeddings=64, **FAMILIES[family]).to(DEVICE)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    return get_peft_model(model, config)


def _inputs(batch, position_ids=None):
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, VOCAB, (batch, TOKENS), generator=g).to(DEVICE)
    inputs = {"input_ids": input_ids, "labels": input_ids.clone(), "use_cache": False}
    if position_ids is not None:
        inputs["position_ids"] = position_ids.to(DEVICE)
    return inputs


def _assert_same_training_step(patched, reference, inputs):
    out, grads = _loss_and_grads(patched, inputs)
    ref_out, ref_grads = _loss_and_grads(reference, inputs)
    assert_close(out.loss, ref_out.loss, torch.float32, "loss")
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        # fp32, but through two layers of attention whose softmax sums in another order (blocks of keys
        # against transformers' one row): a few 1e-6 on the smallest LoRA grads
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}", tol=5e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_attention_matches_unpatched(family):
    model = _lora_model(family)
    reference = copy.deepcopy(model)
    base = model.get_base_model()
    original = base.config._attn_implementation
    model.train(), reference.train()
    with patch_model(model, **ATTENTION_FOCUS) as handle:
        assert base.config._attn_implementation == "fastplug"
        summary = handle.summary()
        padded = (
            "right-padded batches: the same kernel"
            if original == "eager"
            else f"padded batches: transformers' {original}"
        )
        assert summary.count("fastplug attention") == 2 and padded in summary
        if family == "gemma2":
            assert "softcap 50, sliding window 6" in summary
        _assert_same_training_step(model, reference, _inputs(2))
        if family != "qwen2":  # (Llama's attention plus biases: the packed run adds nothing there)
            # packed: the unpatched model masks across documents (use_cache=False lets transformers see the
            # restarts), the patched one runs the varlen kernel with no 4-D mask
            packed = torch.cat([torch.arange(n) for n in DOCS])[None]
            _assert_same_training_step(model, reference, _inputs(1, packed))
    assert base.config._attn_implementation == original


def test_packed_rows_see_only_their_document():
    model = tiny_model("gemma2", attn_implementation="eager").to(DEVICE).eval()
    reference = copy.deepcopy(model)
    inputs = _inputs(1, torch.cat([torch.arange(n) for n in DOCS])[None])
    with torch.no_grad(), patch_model(model, gradient_checkpointing=False):
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False).logits
        starts = [0, DOCS[0], DOCS[0] + DOCS[1], TOKENS]
        per_doc = torch.cat(
            [
                reference(input_ids=inputs["input_ids"][:, a:b], use_cache=False).logits
                for a, b in zip(starts[:-1], starts[1:])
            ],
            dim=1,
        )
    assert_close(logits, per_doc, torch.float32, "packed logits")


@pytest.mark.parametrize("labels_at_pads", [False, True])
def test_right_padded_gemma2_runs_the_kernel_and_other_padding_takes_transformers_path(monkeypatch, labels_at_pads):
    """Right-padded rows run the kernel with per-token bounds: loss, LoRA grads and every logit (pads
    included: they see the real keys before them, as in transformers) equal eager's, with pads labelled
    -100 or trained on. Left padding and a window's length of right padding (pads that see no key) and holes
    take transformers' eager path with its 4-D mask."""
    model = _lora_model("gemma2")
    reference = copy.deepcopy(model)
    inputs = _inputs(3)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, -5:] = 0  # right padding, up to the window (6): every pad still sees a real key
    mask[2, -1:] = 0
    labels = inputs["input_ids"] if labels_at_pads else inputs["input_ids"].masked_fill(mask == 0, -100)
    inputs.update(attention_mask=mask, labels=labels)
    fallbacks = []
    real_fallback = fast_attention._fallback_function
    monkeypatch.setattr(fast_attention, "_fallback_function", lambda *a: fallbacks.append(a) or real_fallback(*a))
    with patch_model(model, **ATTENTION_FOCUS):
        _assert_same_training_step(model, reference, inputs)
        assert not fallbacks, "a right-padded batch must run the kernel"
        for other in ("left", "hole", "window"):  # the window: a pad 6 tokens past the last real key sees none
            padded = torch.ones_like(mask)
            padded[1, {"left": slice(0, 4), "hole": slice(10, 12), "window": slice(-6, None)}[other]] = 0
            with torch.no_grad():
                out = model(input_ids=inputs["input_ids"], attention_mask=padded, use_cache=False)
                ref = reference(input_ids=inputs["input_ids"], attention_mask=padded, use_cache=False)
            assert fallbacks, f"{other} padding must take transformers' path"
            assert_close(out.logits, ref.logits, torch.float32, f"logits with {other} padding")
            fallbacks.clear()


def test_output_attentions_works():
    model = tiny_model("gemma2", attn_implementation="eager").to(DEVICE).eval()
    reference = copy.deepcopy(model)
    inputs = _inputs(2)
    with torch.no_grad(), patch_model(model, gradient_checkpointing=False):
        unpadded = model(input_ids=inputs["input_ids"], use_cache=False, output_attentions=True)
    ref_unpadded = reference(input_ids=inputs["input_ids"], use_cache=False, output_attentions=True)
    for layer, (weights, ref_weights) in enumerate(zip(unpadded.attentions, ref_unpadded.attentions)):
        assert_close(weights, ref_weights, torch.float32, f"attention weights of layer {layer}")


def test_attention_option_off_and_loading_as_fastplug():
    model = tiny_model("llama").to(DEVICE)
    with patch_model(model, attention=False, gradient_checkpointing=False) as handle:
        assert model.config._attn_implementation == "sdpa"
        assert "transformers' sdpa attention (attention=False)" in handle.summary()
    fast_attention.register()
    loaded = tiny_model("llama", attn_implementation="fastplug").to(DEVICE)
    reference = tiny_model("llama").to(DEVICE)
    inputs = _inputs(2)
    with torch.no_grad():
        assert_close(
            loaded(input_ids=inputs["input_ids"]).logits,
            reference(input_ids=inputs["input_ids"]).logits,
            torch.float32,
            "logits",
        )


@pytest.mark.parametrize("loaded_as", ["sdpa", "fastplug"])
def test_rows_the_caller_did_not_pack_need_no_document_bounds(monkeypatch, loaded_as):
    """No position_ids from the caller: rows are not packed, so the kernel gets no document bounds (SDPA where
    it suits, no host sync), in the checkpoint recompute and under torch.compile too, on a model loaded as
    "fastplug" too; packed position_ids still give bounds; restore removes the decoder stack's hook and leaves
    the implementation the model was loaded with."""
    kernels = sys.modules["fastplug.kernels.attention"]  # (the package's `attention` is the function)
    fast_attention.register()
    model = tiny_model("llama", attn_implementation=loaded_as).to(DEVICE)
    decoder = model.get_decoder()
    hooks_before = len(decoder._forward_pre_hooks)
    bounded = []
    real = kernels.flash_attention
    monkeypatch.setattr(
        kernels, "flash_attention", lambda *a, **kw: bounded.append(kw["doc_start"] is not None) or real(*a, **kw)
    )
    inputs = _inputs(2)
    # checkpointed (the recompute must see the flag too); the bounds are under test, not RoPE or LoRA
    with patch_model(model, **{**ATTENTION_FOCUS, "gradient_checkpointing": True, "rope": False, "lora": False}):
        bounded.clear()  # the patch's self-check ran the first layer
        model.train()
        model(**inputs).loss.backward()
        assert bounded == [False] * 3  # two layers, and the first one's recompute (the last runs unchecked)
        bounded.clear()
        packed = torch.cat([torch.arange(n) for n in DOCS])[None]
        model(**_inputs(1, packed)).loss.backward()
        assert bounded == [True] * 3
        bounded.clear()
        compiled = torch.compile(model, backend="eager")
        plain = {"input_ids": inputs["input_ids"], "use_cache": False}  # (with labels the fused loss skips logits)
        with torch.no_grad():
            assert_close(compiled(**plain).logits, model(**plain).logits, torch.float32, "compiled logits")
        assert bounded and not any(bounded)
    assert len(decoder._forward_pre_hooks) == hooks_before and model.config._attn_implementation == loaded_as
