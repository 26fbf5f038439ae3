"""The patch-time self-check: on by default, it keeps the patches that agree with the original modules on the
user's own model and declines (with a warning, the originals running) the kinds that do not: simulated breaks
of transformers' attention signature and of fastplug's own wiring."""

import copy
import warnings

import pytest
import torch

from fastplug.models import families
from fastplug.patch import self_check
from fastplug.patch.engine import patch_model
from tests.models.tiny import batch, tiny_model


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    """Each test sees its own code: remembered verdicts of identical models would hide a simulated break."""
    self_check.forget()
    yield
    self_check.forget()


def _lora_model(dtype=torch.float32, **overrides):
    """What users train: a base in `dtype` with peft's fp32 adapters on every linear."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", **overrides).to(dtype)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def _greedy(model, prompt):
    model.eval()
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)


def _prompt():
    return batch(batch_size=1, tokens=6)["input_ids"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_is_on_by_default_and_keeps_agreeing_patches(dtype):
    model = _lora_model(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no decline warning
        handle = patch_model(model)
    report = handle.check
    assert report.ran and not report.declined
    assert {"attention", "mlp", "rms_norm", "lm_head_loss"} <= set(report.passed)
    assert report.bound == self_check.BOUNDS[dtype]
    assert 0 < report.worst <= report.bound * self_check.GRADIENT_FACTOR
    assert "self-check" in handle.summary() and "declined" not in handle.summary()
    assert handle.counts["attention"] == 2 and handle.counts["lora_fused"] > 0
    handle.restore()


def test_the_check_leaves_the_model_as_it_was():
    """Adapters' B (given random values during the check), RNG, training mode and the layer list come back."""
    model = _lora_model()
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    handle = patch_model(model)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    assert len(model.base_model.model.model.layers) == 2
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    handle.restore()


def test_another_librarys_loss_head_does_not_stop_the_check():
    """A trainer's own loss head on the causal LM (TRL's chunked NLL; here one that needs the trainer's masks, which
    the check's random batch lacks) is set aside while the check runs and is back after it: the check ran, decode
    step included, instead of leaving a known family's patches unchecked."""
    from types import MethodType

    model = _lora_model()
    causal_lm = model.get_base_model()

    def loss_head(self, input_ids=None, completion_mask=None, **kwargs):
        if completion_mask is None:
            raise ValueError("this loss head needs the trainer's completion_mask")
        return type(self).forward(self, input_ids=input_ids, **kwargs)

    causal_lm.forward = MethodType(loss_head, causal_lm)
    handle = patch_model(model)
    assert handle.check.ran and not handle.check.declined and not handle.check.no_decode, handle.summary()
    assert {"attention", "mlp", "rms_norm"} <= set(handle.check.passed)
    assert vars(causal_lm)["forward"].__func__ is loss_head, "the library's forward is back"
    handle.restore()
    assert vars(causal_lm)["forward"].__func__ is loss_head


def _drop_the_cache(monkeypatch):
    """fastplug's attention as it was before transformers 5.24: the cache, passed under a name it does not read,
    never reaches it (the KV cache is never filled and generate() decodes wrong tokens)."""
    import fastplug.models.attention as attention

    monkeypatch.setattr(attention, "pop_cache", lambda kwargs: (kwargs.pop("cache", None), None)[1])


def test_a_broken_attention_patch_is_declined_and_generation_stays_right(monkeypatch):
    model = _lora_model()
    reference = copy.deepcopy(model)
    prompt = _prompt()
    expected = _greedy(reference, prompt)

    _drop_the_cache(monkeypatch)
    unchecked = copy.deepcopy(reference)
    with patch_model(unchecked, self_check=False):
        assert not torch.equal(_greedy(unchecked, prompt), expected), "the simulated break changes the tokens"

    with pytest.warns(UserWarning, match=r"patched attention disagrees.*decode-step logits.*transformers \d"):
        handle = patch_model(model)
    assert [kind for kind, _ in handle.check.declined] == ["attention"]
    assert "attention" not in handle.counts and "declined by the self-check" in handle.summary()
    assert {"mlp", "rms_norm", "lm_head_loss"} <= set(handle.check.passed)
    assert all("forward" not in vars(m) for m in model.modules() if type(m).__name__ == "LlamaAttention")
    assert torch.equal(_greedy(model, prompt), expected)
    handle.restore()


def test_a_changed_transformers_attention_signature_is_not_patched(monkeypatch):
    """A future transformers whose attention takes the KV cache under a name fastplug does not know: the attention
    patch is not installed (its structure check reads the forward's own signature); generation stays right."""
    from transformers.models.llama import modeling_llama

    from fastplug.models.attention import cache_keyword

    original = modeling_llama.LlamaAttention.forward
    name = cache_keyword(modeling_llama.LlamaAttention)

    def renamed(self, hidden_states, position_embeddings=None, attention_mask=None, kv_store=None, **kwargs):
        cache = kwargs.pop(name, kv_store)  # the decoder layer still passes the old name here
        return original(self, hidden_states, position_embeddings, attention_mask, **{name: cache}, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", renamed)
    cache_keyword.cache_clear()
    model = _lora_model()
    prompt = _prompt()
    expected = _greedy(copy.deepcopy(model), prompt)
    with patch_model(model) as handle:
        assert "attention" not in handle.counts
        assert any("KV cache argument" in reason for _, reason in handle.skipped)
        assert torch.equal(_greedy(model, prompt), expected)
    monkeypatch.undo()
    cache_keyword.cache_clear()


def test_a_wrong_norm_is_declined(monkeypatch):
    """Llama's norm computed as Gemma's (1 + w): the check sees it, the norms keep transformers' forward."""
    monkeypatch.setitem(families.FAMILIES, "llama", families.Family("llama", rms_norm_offset=1.0))
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="patched rms_norm disagrees"):
        handle = patch_model(model)
    assert [kind for kind, _ in handle.check.declined] == ["rms_norm"]
    inputs = batch()
    model.train(), reference.train()
    torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-5, atol=1e-6)
    handle.restore()


def test_an_identical_model_reuses_the_verdict_and_the_option_turns_it_off():
    first = patch_model(_lora_model())
    second = patch_model(_lora_model())
    assert not first.check.reused and second.check.reused
    assert second.check.passed == first.check.passed
    assert "identical model" in second.summary()
    off = patch_model(_lora_model(), self_check=False)
    assert not off.check.ran and "self_check=False" in off.summary()
    for handle in (first, second, off):
        handle.restore()


# Families fastplug has no Family entry for (the 2025-26 ones of issue 33 have theirs now: tests/models/): only
# structural rules apply, and the self-check is what stands between them and a silent change (issue 33, item 3).
NEW_FAMILIES = {
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_unknown_families_keep_only_checked_patches(family, monkeypatch):
    import transformers
    from peft import LoraConfig, get_peft_model

    import fastplug.models.families
    import fastplug.patch.engine
    from tests.models.tiny import _COMMON

    config_name, model_name, extra = NEW_FAMILIES[family]
    assert family not in fastplug.models.families.FAMILIES, "a family with an entry: pick one that has none"
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**_COMMON, **extra}))
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    monkeypatch.setattr(fastplug.patch.engine, "_warned_model_types", set())  # warned once per process
    with pytest.warns(UserWarning, match="not a supported family"):
        handle = patch_model(model)
    report = handle.check
    assert report.ran, report.reason
    patched = {kind for kind in handle.counts if kind != "lora_fused"}
    assert patched and patched <= set(report.passed), (patched, report.passed)
    assert not report.declined
    handle.restore()


def test_a_negligible_gradient_does_not_decide_by_its_relative_error():
    """A gradient that is exactly zero (the key bias: softmax ignores it) comes out as rounding noise, which two
    correct implementations round differently: measured against the largest gradient, not against itself. A small
    gradient that is not negligible is still measured by its own norm."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 64, generator=g)
    ref = self_check.Outputs(
        {"gradient of w": weight, "gradient of k bias": 1e-10 * torch.randn(64, generator=g), "loss": torch.ones(1)}
    )
    out = self_check.Outputs(
        {
            "gradient of w": weight * (1 + 1e-6 * torch.randn(64, 64, generator=g)),
            "gradient of k bias": 1e-10 * torch.randn(64, generator=g),  # other noise, relative difference ~1.4
            "loss": torch.ones(1),
        }
    )
    verdict = self_check.compare(out, ref, self_check.BOUNDS[torch.float32])
    assert verdict.ok, verdict
    small = 1e-2 * torch.randn(64, generator=g)
    ref.tensors["gradient of q bias"], out.tensors["gradient of q bias"] = small, 1.1 * small
    verdict = self_check.compare(out, ref, self_check.BOUNDS[torch.float32])
    assert not verdict.ok and verdict.where == "gradient of q bias", verdict


def _opt():
    import transformers

    config = transformers.OPTConfig(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64, vocab_size=128
    )
    return transformers.OPTForCausalLM(config)


def _bert():
    import transformers

    config = transformers.BertConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize("make", [_opt, _bert], ids=["opt", "bert"])
def test_full_fine_tuning_of_layer_norm_models_keeps_the_layer_norm(make, monkeypatch):
    """OPT and BERT, every parameter trained in fp32 with their configs' dropout (OPT's through
    torch.nn.functional): the key bias's gradient is exactly zero, its rounding noise is no disagreement, and the
    LayerNorm kernel is kept without asking the user to report anything (and without needing float64)."""
    import fastplug.patch.engine

    torch.manual_seed(0)
    model = make()
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    monkeypatch.setattr(fastplug.patch.engine, "_warned_model_types", set())  # warned once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patch_model(model)
    assert not [str(w.message) for w in caught if "report" in str(w.message)]
    report = handle.check
    assert report.ran and not report.declined and "declined" not in handle.summary(), handle.summary()
    assert report.passed == ["layer_norm"] and handle.counts["layer_norm"] > 0
    assert not report.float64, "the floor decides, not a float64 run"
    handle.restore()
