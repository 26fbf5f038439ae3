"""The patching engine: per-instance only, idempotent, reversible, honest about what it skipped."""

import copy
import types
import warnings

import pytest
import torch
import transformers

import fastplug
from fastplug.options import KernelOptions
from fastplug.patch.engine import active_handle, patch_for_run, patch_model
from tests.helpers import assert_close, checkpointing_on
from tests.models.tiny import batch, tiny_model


def _has_instance_forward(model):
    return any("forward" in vars(m) for m in model.modules())


def test_patch_is_per_instance_idempotent_and_restorable():
    before = tiny_model("llama", seed=1)  # built before the patch
    model = tiny_model("llama")
    llama_forward = transformers.LlamaForCausalLM.forward
    handle = fastplug.patch_model(model)
    after = tiny_model("llama", seed=2)  # built after the patch
    assert handle.is_active and active_handle(model) is handle
    assert patch_model(model) is handle, "patching twice returns the existing handle"
    assert type(model).forward is llama_forward, "classes are never touched"
    assert not _has_instance_forward(before) and not _has_instance_forward(after)
    assert isinstance(model.model.layers[0].mlp.forward, types.MethodType)
    assert checkpointing_on(model)

    handle.restore()
    handle.restore()  # harmless
    assert not handle.is_active and active_handle(model) is None
    assert not _has_instance_forward(model)
    assert "_fastplug_handle" not in vars(model)
    assert not checkpointing_on(model)
    assert "restored" in handle.summary()


def test_context_manager_and_summary():
    model = tiny_model("qwen3")
    with patch_model(model, rms_norm=False, gradient_checkpointing=False) as handle:
        text = handle.summary()
        assert "rms_norm" not in handle.counts
        assert "attention: 2" in text and "mlp: 2" in text and "lm_head_loss: 1" in text
    assert not _has_instance_forward(model)


@pytest.mark.parametrize("interpret, runs", [("1", "Triton interpreter"), ("0", "torch reference")])
def test_summary_says_what_runs_on_the_models_device(monkeypatch, interpret, runs):
    """On a CPU the paths name what the kernels run there (the Triton interpreter or the torch references, as
    use_triton decides), not CUDA's SDPA; experts without Triton say that transformers' grouped_mm runs."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    for family in ("llama", "qwen3_moe"):
        with patch_model(tiny_model(family), gradient_checkpointing=False, self_check=False) as handle:
            text = handle.summary()
            paths = dict(handle.paths)
        assert "on CUDA" not in text and "cuda" not in text
        attention = [taken for path, taken in paths.items() if path.endswith("self_attn")]
        assert len(attention) == 2 and all(f"flash attention on cpu: {runs}" in taken for taken in attention)
    experts = [taken for path, taken in paths.items() if path.endswith("experts")]
    expected = "fastplug grouped GEMM experts" if interpret == "1" else "transformers' grouped_mm (fastplug's grouped"
    assert experts and all(taken.startswith(expected) for taken in experts)


def test_peft_model_is_unwrapped():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    handle = patch_model(model, gradient_checkpointing=False)
    assert handle.model is model.get_base_model()
    assert active_handle(model) is handle and patch_model(model, gradient_checkpointing=False) is handle
    handle.restore()
    assert not _has_instance_forward(model)


def test_unknown_architecture_warns_and_trains(monkeypatch):
    import fastplug.patch.engine

    monkeypatch.setattr(fastplug.patch.engine, "_warned_model_types", set())  # other tests may have patched a GPT-2
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="not a supported family"):
        handle = patch_model(model, gradient_checkpointing=False)
    assert handle.counts == {"layer_norm": 5}  # 2 per block + the final one
    inputs = batch()
    model.train(), reference.train()
    torch.manual_seed(0)
    loss = model(**inputs).loss
    torch.manual_seed(0)
    ref_loss = reference(**inputs).loss
    assert_close(loss, ref_loss, torch.float32, "loss")
    loss.backward()
    handle.restore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(model, gradient_checkpointing=False).restore()  # warned once per model type


def test_patching_again_with_other_options_raises():
    model = tiny_model("llama")
    handle = patch_model(model, gradient_checkpointing=False)
    assert patch_model(model, gradient_checkpointing=False) is handle, "the same options: the same handle"
    with pytest.raises(ValueError, match=r"already patched with other options: rope=False \(patched with True\)"):
        patch_model(model, rope=False, gradient_checkpointing=False)
    handle.restore()
    with patch_model(model, rope=False, gradient_checkpointing=False) as again:  # after restore() it may
        assert again.options.rope is False


def test_patching_a_runs_patch_names_only_what_the_caller_set():
    """A trainer's patch has run-scoped options (freeze_gc, stack_projections on, checkpointing left to the
    trainer): patch_model with no options keeps it, and with others names only those; patch_for_run keeps a
    patch it did not make and says so."""
    model = tiny_model("llama")
    handle, made = patch_for_run(model, KernelOptions().scoped_to_run(), (), gradient_checkpointing=False)
    assert made and patch_model(model) is handle
    with pytest.raises(ValueError) as raised:
        patch_model(model, KernelOptions(rope=False))
    assert "already patched with other options: rope=False (patched with True). Call restore()" in str(raised.value)
    assert patch_for_run(model, KernelOptions(), {"rope"}) == (handle, False)
    with pytest.raises(ValueError, match=r"options: cuda_graphs=True \(patched with False\)\. Call"):
        patch_for_run(model, KernelOptions(cuda_graphs=True, rope=True), {"cuda_graphs", "rope"})
    handle.restore()


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="valid options"):
        patch_model(tiny_model("llama"), flash=True)


def test_options_may_be_a_dict():
    """options= as a dict works as the keywords do: the same checks, and each key counts as set by the caller."""
    model = tiny_model("llama")
    handle = patch_model(model, options={"rope": False, "gradient_checkpointing": False})
    # cuda_graphs=None resolved by the patch: no graphs off the GPU
    assert handle.options == KernelOptions(rope=False, gradient_checkpointing=False, cuda_graphs=False)
    assert patch_model(model, options={"rope": False}) is handle
    with pytest.raises(ValueError, match=r"other options: rope=True \(patched with False\)"):
        patch_model(model, options={"rope": True})  # a default, but named: set by the caller
    handle.restore()
    with pytest.raises(TypeError, match="valid options"):
        patch_model(model, options={"flash": True})


def test_forward_replaced_by_someone_else_is_left_alone():
    model = tiny_model("llama")
    foreign = types.MethodType(lambda self, **kw: "theirs", model)
    model.forward = foreign  # as TRL's fused LM head does
    handle = patch_model(model, gradient_checkpointing=False)
    assert "lm_head_loss" not in handle.counts
    assert any("already replaced" in reason for _, reason in handle.skipped)
    handle.restore()
    assert model.forward is foreign


def test_gradient_accumulation_matches_one_big_batch():
    """Two micro-batches with num_items_in_batch give the gradient of the whole batch in one go."""
    model = tiny_model("llama")
    model.train()
    inputs = batch(batch_size=4, tokens=9)
    with patch_model(model, gradient_checkpointing=False):
        model(**inputs).loss.backward()
        full = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        num_items = (inputs["labels"][:, 1:] != -100).sum()
        for half in (slice(0, 2), slice(2, 4)):
            micro = {k: v[half] for k, v in inputs.items()}
            model(**micro, num_items_in_batch=num_items).loss.backward()
        for name, p in model.named_parameters():
            assert_close(p.grad, full[name], torch.float32, f"accumulated grad of {name}")


def test_training_steps_leave_no_tensors_behind():
    # A kernel that caches its outputs, or an autograd ctx holding a tensor of its own graph, keeps every
    # step's activations alive: the count of live tensors must not grow from one step to the next.
    import gc

    import peft

    model = peft.get_peft_model(
        tiny_model("llama").to(torch.bfloat16),
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        ),
    )
    patch_model(model, gradient_checkpointing=True)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs = batch()

    def live_tensors_after_step():
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    live_tensors_after_step()  # the optimizer's state and the adapters' compute-dtype copies appear here
    counts = [live_tensors_after_step() for _ in range(3)]
    assert counts[0] == counts[1] == counts[2], counts


def test_first_patch_names_a_newer_transformers_than_tested(monkeypatch):
    from fastplug import versions

    fake = {t.distribution: t.newest for t in versions.TESTED.values()}
    fake["transformers"] = "5.99.0"
    monkeypatch.setattr(versions, "installed_version", lambda distribution: fake.get(distribution))
    monkeypatch.setattr(versions, "_warned", False)
    with pytest.warns(UserWarning, match=r"transformers 5\.99\.0.*newest tested.*5\.24") as record:
        patch_model(tiny_model("llama"), gradient_checkpointing=False).restore()
    assert record[0].filename == __file__, "the warning points at the user's patch_model call"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(tiny_model("llama"), gradient_checkpointing=False).restore()  # once per process
