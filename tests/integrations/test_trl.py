"""FastSFTTrainer / FastDPOTrainer with the real TRL on a tiny Llama: same losses as TRL alone, models restored."""

import math
import string

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from peft import LoraConfig, get_peft_model  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from fastplug import KernelOptions  # noqa: E402
from fastplug.integrations.trl import FastDPOTrainer, FastSFTTrainer  # noqa: E402
from fastplug.patch import checkpointing  # noqa: E402
from fastplug.patch.engine import active_handle, patch_model  # noqa: E402
from tests.helpers import padding_reads_on_device, rel_err  # noqa: E402
from tests.models.tiny import tiny_model  # noqa: E402

# what the trainer does with the patch, not the kernels' numbers (tests/kernels): torch references on CPU
pytestmark = pytest.mark.torch_reference

STEPS = 2


def char_tokenizer():
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


TOKENIZER = char_tokenizer()


def tiny_llama(seed=0):
    ids = {f"{name}_token_id": getattr(TOKENIZER, f"{name}_token_id") for name in ("pad", "eos", "bos")}
    return tiny_model("llama", seed=seed, **ids)


def tiny_lora_llama(seed=0):
    # init_lora_weights=False: random lora_B, so the adapter changes the outputs from the first step
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    model = tiny_llama(seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(model, config)


def module_state(model, trl_head=None):
    """Identity, class and instance forward of every module, identity of every parameter.

    `trl_head`'s instance forward is TRL's fused LM head (installed by TRL itself), so it is left out.
    """
    modules = [
        (name, id(m), type(m), None if m is trl_head else vars(m).get("forward")) for name, m in model.named_modules()
    ]
    return modules, [(name, id(p)) for name, p in model.named_parameters()]


class Probe(TrainerCallback):
    """Records at each step whether fastplug was active on `models` and checkpointing was on; raises at `raise_at`."""

    def __init__(self, models, raise_at=None):
        self.models, self.raise_at, self.active, self.checkpointing = models, raise_at, [], []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.active.append(all(active_handle(m) is not None for m in self.models))
        self.checkpointing.append(checkpointing.is_enabled(model))
        if state.global_step == self.raise_at:
            raise RuntimeError("boom at step 2")


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def common_args(tmp_path):
    return dict(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=1, report_to="none", save_strategy="no", max_length=32, seed=0, disable_tqdm=True, use_cpu=True,
        bf16=False,
    )  # fmt: skip


def sft_dataset():
    return datasets.Dataset.from_dict({"text": [f"{i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(8)]})


def dpo_dataset():
    answers = [("yes", "no") if i % 2 == 0 else ("no", "yes") for i in range(8)]
    return datasets.Dataset.from_dict(
        {"prompt": [f"is {i} even? " for i in range(8)], "chosen": [a for a, _ in answers],
         "rejected": [r for _, r in answers]}
    )  # fmt: skip


@pytest.mark.compat
def test_sft_matches_trl_and_restores(tmp_path):
    args = SFTConfig(**common_args(tmp_path))
    reference = SFTTrainer(model=tiny_llama(), args=args, train_dataset=sft_dataset(), processing_class=TOKENIZER)
    reference.train()

    model = tiny_llama()
    before = module_state(model, trl_head=model)
    probe = Probe([model])
    trainer = FastSFTTrainer(
        model=model, args=SFTConfig(**common_args(tmp_path)), train_dataset=sft_dataset(),
        processing_class=TOKENIZER, callbacks=[probe],
    )  # fmt: skip
    trl_forward = vars(model)["forward"].__func__
    assert active_handle(model) is not None, "patched once TRL's set-up is done"
    assert "TRL's fused LM head" in trainer.fast_kernels_summary
    trainer.train()

    assert probe.active == [True] * STEPS
    assert rel_err(torch.tensor(losses(trainer)), torch.tensor(losses(reference))) < 1e-5
    assert active_handle(model) is None
    assert module_state(model, trl_head=model) == before
    assert vars(model)["forward"].__func__ is trl_forward, "TRL's fused LM head was never replaced"


def test_sft_packs_padded_batches_through_trls_fused_head_with_trls_losses(tmp_path, monkeypatch):
    """Rows of different lengths (the collator pads each batch on the right, the pads' labels ignored): TRL's fused
    LM head runs them packed into one row, with their padding read where they were collated (never from the
    device), and the losses are TRL's own; the wrapper goes with the run."""

    texts = [f"{i} is " + "very " * i + ("even." if i % 2 == 0 else "odd.") for i in range(8)]
    dataset = datasets.Dataset.from_dict({"text": texts})
    reference = SFTTrainer(model=tiny_llama(), args=SFTConfig(**common_args(tmp_path)), train_dataset=dataset,
                           processing_class=TOKENIZER)  # fmt: skip
    reference.train()
    model = tiny_llama()
    trainer = FastSFTTrainer(
        model=model, args=SFTConfig(**common_args(tmp_path)), train_dataset=dataset, processing_class=TOKENIZER
    )
    trl_forward = vars(model)["forward"].__func__
    paths = []

    class BatchPathsAtTheEnd(TrainerCallback):
        def on_train_end(self, *args, **kwargs):
            paths.append(str(trainer.fast_kernel_handles[0].batch_paths))

    trainer.add_callback(BatchPathsAtTheEnd())
    reads = padding_reads_on_device(monkeypatch)
    trainer.train()
    assert "padding dropped, rows packed into one" in paths[0], paths
    assert reads == [], "the forward read a batch's padding on the device"
    assert rel_err(torch.tensor(losses(trainer)), torch.tensor(losses(reference))) < 1e-5
    assert vars(model)["forward"].__func__ is trl_forward, "TRL's fused LM head is back after the run"


def test_sft_peft_restores_after_exception(tmp_path):
    model = tiny_lora_llama()
    head = model.get_base_model()
    before = module_state(model, trl_head=head)
    probe = Probe([model], raise_at=2)
    args = SFTConfig(**common_args(tmp_path), gradient_checkpointing=False)  # the options turn it on
    trainer = FastSFTTrainer(
        model=model, args=args, train_dataset=sft_dataset(), processing_class=TOKENIZER, callbacks=[probe]
    )
    assert "gradient checkpointing: on, turned on by fastplug" in trainer.fast_kernels_summary
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert probe.active == [True, True] and probe.checkpointing == [True, True]
    assert active_handle(model) is None
    assert module_state(model, trl_head=head) == before
    assert not checkpointing.is_enabled(model) and not args.gradient_checkpointing, "checkpointing set back"


def test_sft_keeps_a_patch_the_user_made_and_refuses_other_options(tmp_path):
    """A model patch_model patched: FastSFTTrainer with other options raises naming them; without options it
    trains on that patch and leaves it in place, for the user's restore()."""
    model = tiny_llama()
    handle = patch_model(model, gradient_checkpointing=False)
    kwargs = dict(model=model, train_dataset=sft_dataset(), processing_class=TOKENIZER)
    with pytest.raises(ValueError, match=r"other options: cuda_graphs=True \(patched with False\)\. Call restore"):
        FastSFTTrainer(**kwargs, args=SFTConfig(**common_args(tmp_path)), options=KernelOptions(cuda_graphs=True))
    probe = Probe([model])
    trainer = FastSFTTrainer(**kwargs, args=SFTConfig(**common_args(tmp_path)), callbacks=[probe])
    trainer.train()
    assert probe.active == [True] * STEPS and trainer.fast_kernel_handles == []
    assert active_handle(model) is handle and handle.is_active
    handle.restore()
    assert active_handle(model) is None


def test_options_keyword_and_its_deprecated_spelling(tmp_path):
    """options= (a KernelOptions or a dict), the keyword of every fastplug entry point; fast_kernels=, its former
    name, still works with a DeprecationWarning pointing at the caller's line (so Python's filters show it)."""
    kwargs = dict(args=SFTConfig(**common_args(tmp_path)), train_dataset=sft_dataset(), processing_class=TOKENIZER)
    for options in (KernelOptions(mlp=False), {"mlp": False}):
        trainer = FastSFTTrainer(model=tiny_llama(), options=options, **kwargs)
        assert trainer.fast_kernels == KernelOptions(mlp=False)
        assert trainer.fast_kernel_handles[0].options.mlp is False
        trainer.restore_fast_kernels()
    with pytest.warns(DeprecationWarning, match="fast_kernels= is deprecated; pass options=") as said:
        trainer = FastSFTTrainer(model=tiny_llama(), fast_kernels=KernelOptions(mlp=False), **kwargs)
    assert [w.filename for w in said if "fast_kernels=" in str(w.message)] == [__file__]
    assert trainer.fast_kernels == KernelOptions(mlp=False)
    trainer.restore_fast_kernels()
    with pytest.raises(TypeError, match="not both"):
        FastSFTTrainer(model=tiny_llama(), options={}, fast_kernels=KernelOptions(), **kwargs)


def test_the_mixin_is_named_for_trl_and_its_former_name_still_imports():
    from fastplug.integrations import trl as adapter

    for trainer in (FastSFTTrainer, FastDPOTrainer, adapter.FastGRPOTrainer, adapter.FastRLOOTrainer):
        assert issubclass(trainer, adapter.TRLFastKernelsMixin)
    assert adapter.FastKernelsMixin is adapter.TRLFastKernelsMixin
    assert {"TRLFastKernelsMixin", "FastKernelsMixin"} <= set(adapter.__all__)


@pytest.mark.compat
def test_dpo_with_reference_model(tmp_path):
    def run(trainer_cls):
        policy, ref = tiny_llama(), tiny_llama(seed=1)
        states = [module_state(m, trl_head=m) for m in (policy, ref)]
        probe = Probe([policy, ref])
        trainer = trainer_cls(
            model=policy, ref_model=ref, args=DPOConfig(**common_args(tmp_path)), train_dataset=dpo_dataset(),
            processing_class=TOKENIZER, callbacks=[probe],
        )  # fmt: skip
        trainer.train()
        return trainer, probe, states, (policy, ref)

    reference, _, _, _ = run(DPOTrainer)
    trainer, probe, before, models = run(FastDPOTrainer)
    assert probe.active == [True] * STEPS, "policy and reference model patched while training"
    assert rel_err(torch.tensor(losses(trainer)), torch.tensor(losses(reference))) < 1e-5
    assert [module_state(m, trl_head=m) for m in models] == before
    assert all(active_handle(m) is None for m in models)


def randomise_lora_b(model):
    """A trained-looking adapter (peft starts lora_B at zero), the same in every run."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def test_dpo_peft_reference_pass_disables_the_fused_adapter(tmp_path):
    # No ref_model: TRL's reference pass runs the policy under disable_adapter(). With the fused LoRA path that
    # must still give the base model's log-probs, so the losses match TRL alone from the first step on.
    def run(trainer_cls):
        trainer = trainer_cls(
            model=tiny_llama(), args=DPOConfig(**common_args(tmp_path)), train_dataset=dpo_dataset(),
            processing_class=TOKENIZER, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        )  # fmt: skip
        assert trainer.ref_model is None
        randomise_lora_b(trainer.model)  # before train(): the optimizer does not exist yet
        probe = Probe([trainer.model])
        trainer.add_callback(probe)
        trainer.train()
        return trainer, probe

    reference, _ = run(DPOTrainer)
    trainer, probe = run(FastDPOTrainer)
    assert abs(losses(reference)[0] - math.log(2)) > 1e-3, "the reference pass differs from the policy"
    assert probe.active == [True] * STEPS
    assert "lora_fused" in trainer.fast_kernels_summary, "the fused LoRA path is the one under test"
    assert rel_err(torch.tensor(losses(trainer)), torch.tensor(losses(reference))) < 1e-5
    assert active_handle(trainer.model) is None


@pytest.mark.parametrize("mode", [{"packing": True}, {"padding_free": True, "max_length": None}])
def test_sft_packed_padding_free_matches_trl(tmp_path, mode):
    # Padding-free batches (TRL's bfd packing turns it on): one row per batch, position_ids restarting per
    # document, no attention_mask. fastplug runs its varlen attention; TRL alone masks across documents.
    def run(trainer_cls):
        model = tiny_llama()
        model.config.use_cache = False  # with a cache, transformers would not look for packed documents
        args = SFTConfig(**{**common_args(tmp_path), **mode})
        trainer = trainer_cls(model=model, args=args, train_dataset=sft_dataset(), processing_class=TOKENIZER)
        trainer.train()
        return trainer

    reference = run(SFTTrainer)
    trainer = run(FastSFTTrainer)
    assert "fastplug attention" in trainer.fast_kernels_summary
    assert rel_err(torch.tensor(losses(trainer)), torch.tensor(losses(reference))) < 1e-5


class LayerFlags(TrainerCallback):
    """Records at each step which decoder layers run checkpointed."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append([layer.gradient_checkpointing for layer in checkpointing.decoder_layers(model)])


@pytest.mark.parametrize("mode", [True, "auto"])
def test_sft_checkpointing_modes_apply_to_the_layers_and_are_undone(tmp_path, mode):
    """The options' mode runs on the layers TRL turned checkpointing on for: the last layer unchecked, and
    "auto" planning them (on CPU it keeps the others checkpointed); afterwards the model is as before."""
    from fastplug import KernelOptions

    model = tiny_lora_llama()
    flags = LayerFlags()
    args = SFTConfig(**common_args(tmp_path), gradient_checkpointing=False)
    trainer = FastSFTTrainer(
        model=model,
        args=args,
        train_dataset=sft_dataset(),
        processing_class=TOKENIZER,
        callbacks=[flags],
        options=KernelOptions(gradient_checkpointing=mode),
    )
    assert ("auto" in trainer.fast_kernels_summary) == (mode == "auto")
    trainer.train()
    assert flags.steps == [[True, False]] * STEPS
    assert not checkpointing.is_enabled(model) and not args.gradient_checkpointing
    assert not checkpointing.decoder_stack(model)._forward_pre_hooks, "auto's hook is removed"
