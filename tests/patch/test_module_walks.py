"""The flat walks of the module tree (fastplug/patch/module_walks.py): each gives what nn.Module's (and
transformers') own method gives, also after the tree changes, and restore() takes them away."""

import pickle
from copy import deepcopy

import pytest
import torch
from torch import nn

import fastplug
from fastplug.patch.module_walks import ModuleWalks, WatchedDict, WriteCount, modules_in_order
from tests.models.tiny import batch, tiny_model

peft = pytest.importorskip("peft")


def _peft_model():
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    return model


def _flags(model):
    return [m.training for m in model.modules()]


def test_walks_give_what_the_modules_own_methods_give_as_the_tree_changes():
    model = _peft_model()
    base = model.get_base_model()
    want_params = list(model.parameters())
    want_count = base.num_parameters(exclude_embeddings=True)
    undo = ModuleWalks(model, base).install()
    try:
        assert "train" in vars(model) and "num_parameters" in vars(base)
        assert [id(p) for p in model.parameters()] == [id(p) for p in want_params]
        assert base.num_parameters(exclude_embeddings=True) == want_count
        assert model.num_parameters(exclude_embeddings=True) == want_count, "through peft's attribute forwarding"

        # modes: eval() and a change of mode take the model's own train(); a repeated train() changes nothing
        model.eval()
        assert not any(_flags(model))
        assert model.train() is model and all(_flags(model))
        model.train()
        assert all(_flags(model))
        layer = base.model.layers[0]
        layer.eval()  # one module out of step: the model's own train() puts it back
        model.train()
        assert all(_flags(model))
        with pytest.raises(ValueError, match="boolean"):
            model.train("no")

        # a gradient on every trained parameter; zero_grad clears them all, or zeroes them when asked
        model(**batch()).loss.backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None for p in trained)
        model.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in trained)
        model.zero_grad()
        assert all(p.grad is None for p in trained)

        # a submodule added: the walks read the tree as it is
        extra = nn.Linear(3, 5)
        layer.extra = extra
        assert [id(p) for p in model.parameters()] == [id(p) for p in nn.Module.parameters(model)]
        assert any(p is extra.weight for p in model.parameters())
        assert base.num_parameters(exclude_embeddings=True) == want_count + 3 * 5 + 5
        layer.extra.eval()
        model.train()
        assert extra.training, "the new module is walked"
        extra.weight.grad = torch.ones_like(extra.weight)
        model.zero_grad()
        assert extra.weight.grad is None

        # a parameter swapped in place, as FSDP2 and accelerate do, and a submodule deleted: read live
        swapped = nn.Parameter(torch.zeros(5, 3))
        extra._parameters["weight"] = swapped
        assert any(p is swapped for p in model.parameters())
        assert base.num_parameters(exclude_embeddings=True) == want_count + 3 * 5 + 5
        extra._parameters["bias"] = nn.Parameter(torch.zeros(7))
        assert base.num_parameters(exclude_embeddings=True) == want_count + 3 * 5 + 7, "a size change is counted"
        del layer.extra
        assert [id(p) for p in model.parameters()] == [id(p) for p in want_params]
        assert base.num_parameters(exclude_embeddings=True) == want_count
        # freezing is no registration: only_trainable is counted afresh
        trainable = base.num_parameters(only_trainable=True)
        trained[0].requires_grad_(False)
        assert base.num_parameters(only_trainable=True) == trainable - trained[0].numel()
    finally:
        undo()
    assert not {"train", "zero_grad", "parameters"} & set(vars(model)) and "num_parameters" not in vars(base)


def test_modules_in_order_is_modules_with_shared_and_missing_children():
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.ReLU())
    root = nn.Sequential(nn.Linear(2, 2), inner, shared, nn.Sequential(inner, nn.Tanh()))
    root.register_module("absent", None)
    assert modules_in_order(root) == list(root.modules())
    model = _peft_model()
    assert modules_in_order(model) == list(model.modules())


def test_a_deep_copy_of_the_model_walks_its_own_tree():
    """TRL copies the model for a reference model: the copy's walks read the copy."""
    model = _peft_model()
    undo = ModuleWalks(model, model.get_base_model()).install()
    try:
        copy = deepcopy(model)
        walks = vars(copy)["train"].__self__
        assert walks.model is copy and walks is not vars(model)["train"].__self__
        copy.get_base_model().model.layers[0].extra = nn.Linear(2, 2)
        assert [id(p) for p in copy.parameters()] == [id(p) for p in nn.Module.parameters(copy)]
        assert not {id(p) for p in copy.parameters()} & {id(p) for p in model.parameters()}
    finally:
        undo()


def test_a_class_whose_train_does_more_keeps_its_own_and_an_instances_own_methods_stay():
    calls = []

    class Counted(nn.Linear):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    model = nn.Sequential(nn.Linear(2, 2), Counted(2, 2))
    own = vars(model)["zero_grad"] = lambda set_to_none=True: None
    undo = ModuleWalks(model, model).install()
    try:
        model.train()
        assert calls == [True], "a class that overrides train() beyond flags is called each time"
        assert vars(model)["zero_grad"] is own and "num_parameters" not in vars(model)
    finally:
        undo()
    assert vars(model)["zero_grad"] is own and "train" not in vars(model)


def test_patch_model_installs_the_walks_and_restore_removes_them():
    model = _peft_model()
    handle = fastplug.patch_model(model, self_check=False)
    try:
        assert "train" in vars(model) and "num_parameters" in vars(model.get_base_model())
        model.train()
        assert all(_flags(model))
    finally:
        handle.restore()
    assert "train" not in vars(model) and "num_parameters" not in vars(model.get_base_model())


def _dicts(model):
    return [type(d) for m in model.modules() for d in (m._modules, m._parameters)]


def test_the_walk_is_kept_while_the_tree_holds_and_read_again_after_any_change():
    """Between steps nothing is walked again; each way of changing the tree makes the next call read it anew."""
    model = _peft_model()
    base = model.get_base_model()
    undo = ModuleWalks(model, base).install()
    walks = vars(model)["train"].__self__
    try:
        model.train()
        assert set(_dicts(model)) == {WatchedDict}, "every module's dicts are watched"
        kept = walks.snapshot(model)
        for _ in range(3):
            model.train(), list(model.parameters()), model.zero_grad(), base.num_parameters(exclude_embeddings=True)
        assert walks.snapshot(model) is kept, "an unchanged tree is not walked again"

        layer = base.model.layers[0]
        shape_changes = [
            lambda: layer.mlp.register_module("extra", nn.Linear(2, 2)),  # setattr's way
            lambda: layer.mlp._modules.pop("extra"),
            lambda: layer.mlp._modules.update(extra=nn.Linear(2, 3)),
            lambda: layer.mlp._modules.setdefault("other", nn.Linear(3, 3)),
            lambda: layer.mlp._modules.__ior__({"other": nn.Linear(3, 4)}),
            lambda: layer.mlp._modules.__delitem__("other"),
            lambda: layer.mlp._modules.popitem(),
            lambda: vars(layer.post_attention_layernorm).__setitem__("_parameters", {}),  # a dict replaced whole
            lambda: vars(layer.self_attn).__setitem__("_modules", dict(layer.self_attn._modules)),
        ]
        norm = layer.input_layernorm
        parameter_writes = [  # as FSDP2 swaps its units' parameters: the modules' list stays, its parameters are read
            lambda: norm._parameters.__setitem__("weight", nn.Parameter(torch.randn(64))),
            lambda: norm._parameters.update(weight=nn.Parameter(torch.randn(64))),
            lambda: norm._parameters.clear(),
        ]
        for change in shape_changes + parameter_writes:
            before = walks.snapshot(model)
            change()
            assert (walks.snapshot(model) is before) is (change in parameter_writes), change
            assert [id(p) for p in model.parameters()] == [id(p) for p in nn.Module.parameters(model)]
            want = type(base).num_parameters(base, exclude_embeddings=True)
            assert base.num_parameters(exclude_embeddings=True) == want
        assert set(_dicts(model)) == {WatchedDict}, "modules added or dicts replaced are watched from their walk on"

        class Relabelled(type(layer.mlp)):
            def train(self, mode=True):
                self.relabelled = mode
                return super().train(mode)

        layer.mlp.__class__ = Relabelled  # a class changed in place: its own train() is now called
        model.train()
        assert layer.mlp.relabelled is True
    finally:
        undo()
    assert set(_dicts(model)) == {dict}, "restore() gives every module plain dicts again"


def test_watched_dicts_copy_and_pickle_as_plain_dicts_and_count_for_every_tree_watching():
    counts = WriteCount(), WriteCount()  # two trees watching one module's dict
    watched = WatchedDict(a=1)
    watched.counts = list(counts)
    watched["b"] = 2
    assert [c.writes for c in counts] == [1, 1] and dict(watched) == {"a": 1, "b": 2}
    for copied in (deepcopy(watched), pickle.loads(pickle.dumps(watched))):
        assert type(copied) is dict and copied == {"a": 1, "b": 2}

    model = _peft_model()
    undo = ModuleWalks(model, model.get_base_model()).install()
    try:
        model.train()
        assert set(_dicts(deepcopy(model))) == {dict}, "a copy's walks watch the copy's dicts anew"
        assert set(_dicts(pickle.loads(pickle.dumps(model)))) == {dict}
    finally:
        undo()


@pytest.mark.torch_reference
def test_the_trainers_steps_read_the_kept_lists(tmp_path):
    """A real HF Trainer run: its per-step train(), FLOP count, clipping and zero_grad() write no dict of the
    tree, so from the second step on every walk reads the lists kept (a write per step would make them walk
    the tree again each time, correct but as slow as nn.Module's)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    seen = []

    class Lists(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            walks = vars(model)["train"].__self__
            snapshot = walks._snapshots[id(model)]
            seen.append((snapshot, snapshot._parameters_at, walks._counts.modules.writes))

    data = batch(batch_size=12, tokens=10, seed=3)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6, learning_rate=5e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    model = _peft_model()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{k: v[i] for k, v in data.items()} for i in range(12)],
        callbacks=[fastplug.FastKernels(), Lists()],
    )
    trainer.train()
    assert len(seen) == 6 and len({id(s) for s, *_ in seen[1:]}) == 1, "the tree was read again between steps"
    assert len({tuple(counts) for _, *counts in seen[1:]}) == 1, "a dict of the tree was written during a step"
    assert "train" not in vars(model) and set(_dicts(model)) == {dict}, "the end of training restored plain dicts"
