"""The Trainer's steps without their waits for the device (`SyncFreeSteps`): the NaN/inf loss filter done on
the device logs the losses the Trainer's own filter logs, the loop never tests a loss on the host, and the flag is
the user's wherever anything else reads it; pinned batches are copied to the device non-blocking for the run."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from fastplug import FastKernels
from fastplug.integrations.trainer_syncs import SyncFreeSteps
from tests.helpers import assert_close, padding_reads_on_device
from tests.integrations.test_hf_trainer import _args, _dataset, _run
from tests.models.tiny import tiny_model

pytestmark = pytest.mark.torch_reference


def _loss_not_finite_on_call(bad_call: int, value: float):
    """A compute_loss_func whose `bad_call`-th loss is `value` (NaN or inf) plus the loss: its gradient is the
    loss's, so the model trains the same, and only the logged loss sees it."""
    calls = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        logits = outputs.logits[:, :-1].float().flatten(0, 1)
        loss = F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)
        return loss + value if len(calls) == bad_call else loss

    return loss_func


class _FlagSeen(TrainerCallback):
    """The logging_nan_inf_filter value other callbacks see: at every event after the loop read it."""

    def __init__(self):
        self.seen = []

    def _record(self, args, *_, **__):
        self.seen.append(args.logging_nan_inf_filter)

    on_pre_optimizer_step = on_optimizer_step = on_substep_end = on_step_end = on_evaluate = on_log = _record


def _train(tmp_path, value, filtered: bool, callbacks=()):
    """The tiny Llama trained 3 steps (accumulation 2, evaluation at step 2) with a non-finite loss on the third
    micro-batch, by the plain Trainer or inside SyncFreeSteps as FastKernels' train() runs it."""
    trainer = Trainer(
        model=tiny_model("llama"),
        args=_args(tmp_path, max_steps=3, eval_steps=2),
        train_dataset=_dataset(),
        eval_dataset=_dataset(4, 10),
        callbacks=list(callbacks),
        compute_loss_func=_loss_not_finite_on_call(3, value),
    )
    with SyncFreeSteps(trainer) if filtered else contextlib.nullcontext():
        trainer.train()
    history = trainer.state.log_history
    logged = {key: torch.tensor([h[key] for h in history if key in h]) for key in ("loss", "eval_loss")}
    return trainer, logged


@pytest.mark.compat  # the Trainer loop's filter and state, in the oldest transformers too
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_logged_losses_are_the_trainers_own_filters(tmp_path, value):
    """Through the device filter the run logs the losses the Trainer's own filter logs (the non-finite one
    replaced by the window's mean so far); the flag is on wherever a callback looks, and the trainer is as it was
    after train()."""
    _, reference = _train(tmp_path, value, filtered=False)
    flags = _FlagSeen()
    trainer, logged = _train(tmp_path, value, filtered=True, callbacks=[flags])
    assert len(reference["loss"]) == 3 and torch.isfinite(reference["loss"]).all()
    assert torch.equal(logged["loss"], reference["loss"]), (logged, reference)
    assert torch.equal(logged["eval_loss"], reference["eval_loss"])
    assert flags.seen and all(flags.seen), flags.seen
    assert trainer.args.logging_nan_inf_filter is True
    assert "training_step" not in vars(trainer)
    assert not any(isinstance(cb, SyncFreeSteps) for cb in trainer.callback_handler.callbacks)


@pytest.mark.compat
def test_the_trainer_loop_does_not_test_the_loss_on_the_host(tmp_path, monkeypatch):
    """With FastKernels the loop's `torch.isnan(loss) or torch.isinf(loss)` (a device sync per micro-batch) does
    not run; without it, it runs once per micro-batch."""
    tested = []
    isnan = torch.isnan

    def counting_isnan(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
            tested.append(1)
        return isnan(tensor, *args, **kwargs)

    monkeypatch.setattr(torch, "isnan", counting_isnan)
    counts = {}
    for fast in (False, True):
        tested.clear()
        _run(tmp_path, [FastKernels()] if fast else [], model=tiny_model("llama"), args=_args(tmp_path, max_steps=2))
        counts[fast] = len(tested)
    assert counts == {False: 4, True: 0}, counts


def test_a_trainer_without_the_filters_state_keeps_its_own_filter():
    """A trainer without `_tr_loss` (another transformers): the loss comes back as it was and the flag stays on,
    so the Trainer filters it, syncing."""
    loss = torch.tensor(float("nan"))
    trainer = SimpleNamespace(
        args=SimpleNamespace(logging_nan_inf_filter=True),
        training_step=lambda *a, **k: loss,
        callback_handler=SimpleNamespace(callbacks=[]),
        state=SimpleNamespace(global_step=0),
    )
    with SyncFreeSteps(trainer):
        assert trainer.training_step() is loss
        assert trainer.args.logging_nan_inf_filter is True
    assert trainer.args.logging_nan_inf_filter is True and trainer.callback_handler.callbacks == []


class _LoaderSeen(TrainerCallback):
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.non_blocking = train_dataloader._non_blocking


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_batches_are_copied_non_blocking_for_the_run(tmp_path, pinned):
    """With the DataLoader pinning its batches (the default), accelerate copies them without waiting for the
    device during the run, and its setting is the user's again after it; unpinned batches are left alone."""
    seen = _LoaderSeen()
    args = _args(tmp_path, max_steps=1)
    args.dataloader_pin_memory = pinned  # use_cpu turned it off; the copy is the same on CPU
    trainer, *_ = _run(tmp_path, [FastKernels(), seen], model=tiny_model("llama"), args=args)
    assert seen.non_blocking is pinned
    assert trainer.accelerator.dataloader_config.non_blocking is False


def _right_padded(lengths, seed, left=False, labels_at_pads=False):
    g = torch.Generator().manual_seed(seed)
    tokens = max(lengths)
    ids = torch.randint(1, 64, (len(lengths), tokens), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        if left:
            mask[row, tokens - n :] = 1
        else:
            mask[row, :n] = 1
    labels = ids.clone() if labels_at_pads else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize(
    "case",
    [
        dict(lengths=[7, 3, 5]),
        dict(lengths=[4, 4]),
        dict(lengths=[7, 3], left=True),
        dict(lengths=[6, 2], labels_at_pads=True),
    ],
)
def test_a_collated_batch_carries_its_padding_read_on_the_host_to_the_device(monkeypatch, case):
    """The collator's batch, pinned (a copy of the mapping), sent from a DataLoader worker (pickled) and moved
    with `.to` as accelerate moves it, comes back as the collator made it, and the forward's padding check reads the
    facts the host read, equal to reading the moved tensors; a write in place, other labels or another ignore index
    make it read the tensors again."""
    import copy
    import pickle

    from fastplug.integrations.trainer_syncs import _CollateReadingRows
    from fastplug.models.padding import padding_facts, unmaskable

    made = _right_padded(**case, seed=len(case["lengths"]))
    collate = _CollateReadingRows(lambda features: {k: v.clone() for k, v in made.items()})
    batch = pickle.loads(pickle.dumps(copy.copy(collate(None))))
    moved = batch.to("cpu", non_blocking=True)
    assert type(moved) is dict and moved.keys() == made.keys()
    assert all(torch.equal(moved[k], made[k]) for k in made)
    expected = padding_facts(made["attention_mask"], made["labels"], -100)
    reads = padding_reads_on_device(monkeypatch)
    mask, labels = moved["attention_mask"], moved["labels"]
    assert unmaskable(mask, labels, -100) == expected and reads == []
    assert unmaskable(mask, labels, -1) == padding_facts(mask, labels, -1) and len(reads) == 1
    assert unmaskable(mask, labels.clone(), -100) == expected and len(reads) == 2
    mask[0, 1:] = 0  # now the first row is one token long
    assert unmaskable(mask, labels, -100) == padding_facts(mask, labels, -100) and len(reads) == 3
    assert unmaskable(mask, labels, -100)[1][0] == 1


def test_a_carried_batch_moves_every_value_as_accelerate_would():
    """Values beside the tensors (a nested mapping, a tuple, an object with its own `.to`) reach the device as
    accelerate's `send_to_device` would have sent them without fastplug's wrapper."""
    from fastplug.integrations.trainer_syncs import _CollateReadingRows

    class Moves:
        def __init__(self):
            self.moved_to = None

        def to(self, device, non_blocking=False):
            self.moved_to = (device, non_blocking)
            return self

    extra = Moves()
    made = {**_right_padded([5, 3], seed=2), "extra": extra, "nested": {"ids": (torch.ones(2),)}}
    batch = _CollateReadingRows(lambda features: made)(None)
    moved = batch.to("cpu", non_blocking=True)
    assert extra.moved_to == ("cpu", True)
    assert type(moved["nested"]) is dict and torch.equal(moved["nested"]["ids"][0], torch.ones(2))


def test_the_collators_attributes_and_its_other_batches_are_its_own():
    """Attributes read and set through the wrapper are the collator's; a batch without a mask and labels, or of
    another mapping type, passes as the collator made it."""
    from collections import OrderedDict

    from fastplug.integrations.trainer_syncs import _CollateReadingRows

    class Collator:
        pad_to_multiple_of = None

        def __call__(self, features):
            return features

    inner = Collator()
    collate = _CollateReadingRows(inner)
    collate.pad_to_multiple_of = 8
    assert inner.pad_to_multiple_of == 8 and collate.pad_to_multiple_of == 8
    ids_only = {"input_ids": torch.ones(2, 3, dtype=torch.long)}
    assert collate(ids_only) is ids_only
    ordered = OrderedDict(_right_padded([3, 2], seed=1))
    assert collate(ordered) is ordered


def _varlen_dataset(n=8, seed=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 17, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, 64, (length,), generator=g)} for length in lengths]


def _pad_right(features):
    """What the HF collators make of token rows for causal LM training: right padding, labels ignored there."""
    tokens = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), tokens, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.compat
@pytest.mark.parametrize("workers", [0, 1])
def test_the_forward_does_not_read_the_padding_on_the_device(tmp_path, monkeypatch, workers):
    """A Trainer run of rows of varied lengths with FastKernels packs every batch with the padding read where it
    was collated, in the main process or a DataLoader worker (the forward never reads it from the device), logs
    the plain Trainer's losses, and the trainer's collator is the user's again after it."""
    from fastplug.models import padding

    reads = padding_reads_on_device(monkeypatch)
    checked = []
    check = padding.unmaskable
    monkeypatch.setattr(padding, "unmaskable", lambda *args: checked.append(1) or check(*args))
    runs = {}
    for fast in (False, True):
        trainer = Trainer(
            model=tiny_model("llama"),
            args=_args(tmp_path, max_steps=3, eval_steps=3, dataloader_num_workers=workers),
            train_dataset=_varlen_dataset(),
            eval_dataset=_varlen_dataset(4, seed=5),
            data_collator=_pad_right,
            callbacks=[FastKernels()] if fast else [],
        )
        trainer.train()
        runs[fast] = torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])
        assert trainer.data_collator is _pad_right
    assert len(checked) == 6, "each micro-batch's padding checked"
    assert reads == [], "the forward read a batch's padding on the device"
    assert len(runs[True]) == 3
    assert_close(runs[True], runs[False], torch.float32, "logged losses")
