"""The real transformers.Trainer with FastKernels(): same losses as without it, patched during training,
restored after; gradient accumulation, evaluation during training, model_init, LoRA, Liger conflict."""

import gc

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import fastplug
from fastplug import FastKernels, KernelOptions
from fastplug.patch import checkpointing
from fastplug.patch.engine import active_handle
from tests.helpers import assert_close, checkpointing_on
from tests.models.tiny import batch, tiny_model

# what the trainer does with the patch, not the kernels' numbers (tests/kernels): torch references on CPU
pytestmark = pytest.mark.torch_reference  # but the torch.compile test: graphs of the kernels


def _dataset(n=8, tokens=10):
    data = batch(batch_size=n, tokens=tokens, seed=3)
    return [{k: v[i] for k, v in data.items()} for i in range(n)]


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=5e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **overrides})


class _WatchPatch(TrainerCallback):
    """Records, during training, whether the Trainer's model is patched."""

    def __init__(self):
        self.patched_steps = []
        self.frozen_steps = []  # whether Python's collector skipped the objects alive at patch time
        self.checkpointed = []  # per step: which decoder layers run checkpointed

    def on_step_end(self, args, state, control, model=None, **kwargs):
        handle = active_handle(model)
        self.patched_steps.append(handle is not None and handle.counts.get("attention") == 2)
        self.frozen_steps.append(gc.get_freeze_count() > 0)
        self.checkpointed.append([layer.gradient_checkpointing for layer in checkpointing.decoder_layers(model)])


def _run(tmp_path, callbacks, model=None, args=None, **kwargs):
    trainer = Trainer(
        model=model,
        args=args or _args(tmp_path),
        train_dataset=_dataset(),
        eval_dataset=_dataset(4, 10),
        callbacks=callbacks,
        **kwargs,
    )
    trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    eval_losses = [h["eval_loss"] for h in history if "eval_loss" in h]
    return trainer, history, torch.tensor(losses), torch.tensor(eval_losses)


def _has_instance_forward(model):
    return any("forward" in vars(m) for m in model.modules())


def test_trainer_losses_match_and_model_is_restored(tmp_path):
    model = tiny_model("llama")
    watch = _WatchPatch()
    fast = FastKernels()
    # A process may have frozen objects itself (the GPU image's Python starts with some frozen): fastplug
    # then leaves its policy alone, and either way the count after the run is the count before it.
    frozen_before = gc.get_freeze_count()
    _, history, losses, eval_losses = _run(tmp_path, [fast, watch], model=model)
    _, _, ref_losses, ref_eval = _run(tmp_path, [], model=tiny_model("llama"))

    assert len(losses) == 2 and len(eval_losses) == 1
    assert_close(losses, ref_losses, torch.float32, "training losses")
    assert_close(eval_losses, ref_eval, torch.float32, "eval losses (eval takes the original forward)")
    assert watch.patched_steps == [True, True]
    assert watch.frozen_steps == [True, True] and gc.get_freeze_count() == frozen_before, "frozen for the run only"
    assert any("tokens_per_second" in h for h in history)
    assert "attention: 2" in fast.summary and "gradient checkpointing: on" in fast.summary
    assert "the last layer unchecked" in fast.summary and watch.checkpointed == [[True, False]] * 2
    assert active_handle(model) is None and not _has_instance_forward(model)
    assert not checkpointing_on(model), "the checkpointing FastKernels turned on is turned off again"


class _ReenableCheckpointing(TrainerCallback):
    """Turns plain checkpointing on again on every layer after each step, as TRL's DPO does around its reference
    passes, and records at each step's begin (after FastKernels' own step-begin) which layers are checkpointed."""

    def __init__(self):
        self.at_step_begin = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.at_step_begin.append([layer.gradient_checkpointing for layer in checkpointing.decoder_layers(model)])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert all(layer.gradient_checkpointing for layer in checkpointing.decoder_layers(model))


def test_trainer_puts_the_checkpointing_mode_back_after_something_reenables_it(tmp_path):
    """Each step begins with the options' mode on the layers (the last one unchecked), whatever turned plain
    checkpointing on every layer in between."""
    reenable = _ReenableCheckpointing()
    model = tiny_model("llama")
    _run(tmp_path, [FastKernels(), reenable], model=model, args=_args(tmp_path, max_steps=3))
    assert reenable.at_step_begin == [[True, False]] * 3
    assert not checkpointing_on(model)


def test_the_steps_do_not_walk_the_model_to_keep_the_checkpointing_mode(tmp_path, monkeypatch):
    """The mode is put back at each step's begin from the layer found once: walking a peft model's thousands of
    modules there would cost each step milliseconds the GPU waits for. A run of four steps finds the decoder
    layers as often as a run of one."""
    found = []
    walk = checkpointing.decoder_layers
    monkeypatch.setattr(checkpointing, "decoder_layers", lambda model: found.append(1) or walk(model))
    walks = {}
    for steps in (1, 4):
        found.clear()
        _run(tmp_path, [FastKernels()], model=tiny_model("llama"), args=_args(tmp_path, max_steps=steps))
        walks[steps] = len(found)
    assert walks[4] == walks[1], walks


def test_trainer_auto_checkpointing_plans_the_layers_and_is_undone(tmp_path):
    """FastKernels(gradient_checkpointing="auto") runs AutoCheckpointing on the layers the Trainer turned
    checkpointing on for (on CPU: every layer but the last stays checkpointed), reports the count in the
    logs, and leaves no hook behind."""
    model = tiny_model("llama", num_hidden_layers=3)
    watch = _WatchPatch()
    fast = FastKernels(gradient_checkpointing="auto")
    _, history, losses, _ = _run(tmp_path, [fast, watch], model=model)
    _, _, ref_losses, _ = _run(tmp_path, [], model=tiny_model("llama", num_hidden_layers=3))
    assert_close(losses, ref_losses, torch.float32, "training losses")
    assert "gradient checkpointing: on, auto: 2 of 3 layers checkpointed" in fast.summary
    assert watch.checkpointed == [[True, True, False]] * 2
    assert [h["checkpointed_layers"] for h in history if "loss" in h] == [2, 2]
    assert fast.checkpointing.layers is None and not checkpointing_on(model)
    assert not checkpointing.decoder_stack(model)._forward_pre_hooks, "auto's hook is removed"


@pytest.mark.compat
def test_trainer_with_lora_matches(tmp_path):
    from peft import LoraConfig, get_peft_model

    def lora_model():
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        return get_peft_model(tiny_model("qwen2"), config)

    fast = FastKernels()
    _, _, losses, _ = _run(tmp_path, [fast], model=lora_model())
    _, _, ref_losses, _ = _run(tmp_path, [], model=lora_model())
    assert "lora_fused: 4" in fast.summary
    assert_close(losses, ref_losses, torch.float32, "training losses")


def test_trainer_bf16_mixed_precision_matches(tmp_path):
    args = dict(bf16=True, eval_strategy="no", gradient_accumulation_steps=1)
    _, _, losses, _ = _run(tmp_path, [FastKernels()], model=tiny_model("gemma"), args=_args(tmp_path, **args))
    _, _, ref_losses, _ = _run(tmp_path, [], model=tiny_model("gemma"), args=_args(tmp_path, **args))
    assert_close(losses, ref_losses, torch.bfloat16, "bf16 training losses")


def test_trainer_model_init_patches_the_new_model(tmp_path):
    watch = _WatchPatch()
    fast = FastKernels(gradient_checkpointing=False)
    trainer, _, losses, _ = _run(tmp_path, [fast, watch], model_init=lambda: tiny_model("llama"))
    assert watch.patched_steps == [True, True]
    assert torch.isfinite(losses).all()
    assert fast.handle.model is trainer.model and not fast.handle.is_active


def test_liger_conflict_warns_and_fastplug_steps_back(tmp_path):
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="Liger wins"):
        Trainer(
            model=model,
            args=_args(tmp_path, use_liger_kernel=True, eval_strategy="no"),
            train_dataset=_dataset(),
            callbacks=[FastKernels()],
        )
    assert active_handle(model) is None


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="valid options"):
        FastKernels(flash_attention=True)


def test_trainer_keeps_a_patch_the_user_made_and_leaves_it_after_training(tmp_path):
    """patch_model, then FastKernels with no options (or the same ones): the user's patch runs the training and
    is still in place after it; its own restore() gives the originals back."""
    model = tiny_model("llama")
    modules = [(name, id(m)) for name, m in model.named_modules()]
    handle = fastplug.patch_model(model, gradient_checkpointing=False)
    watch = _WatchPatch()
    fast = FastKernels(rope=True)  # the same as the patch: kept quietly
    _run(tmp_path, [fast, watch], model=model)
    assert fast.handle is handle and watch.patched_steps == [True, True]
    assert active_handle(model) is handle and handle.is_active and _has_instance_forward(model)
    handle.restore()
    assert active_handle(model) is None and not _has_instance_forward(model)
    assert [(name, id(m)) for name, m in model.named_modules()] == modules


@pytest.mark.parametrize(
    "fast, named",
    [
        (lambda: FastKernels(cuda_graphs=True), ["cuda_graphs=True (patched with False)"]),
        (
            lambda: FastKernels(options=KernelOptions(mlp=False, rope=False, fp8=True)),
            ["rope=False (patched with True)", "mlp=False (patched with True)", "fp8=True (patched with False)"],
        ),
        (lambda: FastKernels(options={"rope": False}), ["rope=False (patched with True)"]),
    ],
)
def test_trainer_with_other_options_than_the_users_patch_raises(tmp_path, fast, named):
    """FastKernels options that differ from a patch the model carries raise, naming only what the user set;
    the user's patch stays as it was."""
    model = tiny_model("llama")
    handle = fastplug.patch_model(model, gradient_checkpointing=False, self_check=False)
    with pytest.raises(ValueError, match="already patched with other options") as raised:
        Trainer(model=model, args=_args(tmp_path, eval_strategy="no"), train_dataset=_dataset(), callbacks=[fast()])
    message = str(raised.value)
    assert message.split("options: ")[1].split(". ")[0] == ", ".join(named)
    assert "restore()" in message and "the options it was patched with" in message
    assert active_handle(model) is handle and handle.options.rope and not handle.options.cuda_graphs


def test_patch_model_during_a_run_names_only_what_the_user_set(tmp_path):
    """patch_model inside a FastKernels run: with no options it keeps the run's patch; with other options it
    raises naming those alone (not the run's freeze_gc, stack_projections or gradient_checkpointing)."""
    seen = {}

    class PatchDuringRun(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen["same"] = fastplug.patch_model(model) is active_handle(model)
            with pytest.raises(ValueError) as raised:
                fastplug.patch_model(model, cuda_graphs=True)
            seen["message"] = str(raised.value)

    model = tiny_model("llama")
    _run(tmp_path, [FastKernels(), PatchDuringRun()], model=model)
    assert seen["same"]
    assert (
        "already patched with other options: cuda_graphs=True (patched with False). Call restore()" in (seen["message"])
    )
    assert active_handle(model) is None and not _has_instance_forward(model), "the run's own patch is restored"


@pytest.mark.interpreted_kernels
def test_trainer_torch_compile_with_fastkernels_matches_compiled_unpatched(tmp_path):
    """TrainingArguments(torch_compile=True): FastKernels patches at on_init_end, before the Trainer compiles
    and wraps the model, so the compiled module runs fastplug's registered ops. No graph break, no more graphs
    than the unpatched model (no recompile per step: the adapter-cast generation and the token counter stay
    out of the trace), same losses, patched during the steps, restored after. aot_eager: no C++ toolchain."""
    from torch._dynamo.utils import counters

    compiled = dict(torch_compile=True, torch_compile_backend="aot_eager", eval_strategy="no")
    graphs = []
    for fast in (True, False):  # the batches carry an attention_mask: the mask path is traced too
        torch._dynamo.reset()
        counters.clear()
        model, watch = tiny_model("llama"), _WatchPatch()
        callbacks = [FastKernels(), watch] if fast else []
        trainer, _, step_losses, _ = _run(tmp_path, callbacks, model=model, args=_args(tmp_path, **compiled))
        assert not counters["graph_break"], dict(counters["graph_break"])
        graphs.append(counters["stats"]["unique_graphs"])
        if fast:
            losses, patched_model, patched_watch = step_losses, model, watch
            assert type(trainer.model_wrapped).__name__ == "OptimizedModule", "the Trainer compiled the model"
    assert graphs[0] == graphs[1], f"graphs compiled (patched, plain): {graphs}: a recompile from step to step"
    model, watch, ref_losses = patched_model, patched_watch, step_losses
    assert_close(losses, ref_losses, torch.float32, "training losses")
    assert watch.patched_steps == [True, True]
    assert active_handle(model) is None and not _has_instance_forward(model)
