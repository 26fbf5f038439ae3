"""While a model is patched with freeze_gc (the trainer adapters' default for their run), the objects alive
at patch time are frozen for Python's collector; the last restore unfreezes them, and a process that froze
objects itself keeps its policy. patch_model alone does not freeze unless asked."""

import gc

import pytest

import fastplug
from fastplug.patch import host_gc
from tests.models.tiny import tiny_model


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_while_any_patch_is_active():
    first, second = tiny_model("llama"), tiny_model("qwen3")
    h1 = fastplug.patch_model(first, gradient_checkpointing=False, freeze_gc=True)
    frozen = gc.get_freeze_count()  # it only falls from here: frozen objects freed by refcount leave it
    assert frozen > 1000, "the objects alive at patch time (torch, transformers, the model) are frozen"
    h2 = fastplug.patch_model(second, gradient_checkpointing=False, freeze_gc=True)
    assert 1000 < gc.get_freeze_count() <= frozen, "a second patch does not freeze again"
    h1.restore()
    assert gc.get_freeze_count() > 1000, "another model is still patched"
    h2.restore()
    h2.restore()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("freeze_gc", [None, False])
def test_patch_model_leaves_the_collector_alone_unless_asked(freeze_gc):
    handle = fastplug.patch_model(tiny_model("llama"), gradient_checkpointing=False, freeze_gc=freeze_gc)
    assert gc.get_freeze_count() == 0
    handle.restore()


def test_trainer_adapters_scope_the_freeze_to_their_run():
    options = fastplug.KernelOptions()
    assert options.freeze_gc is None and options.scoped_to_run().freeze_gc is True
    assert fastplug.KernelOptions(freeze_gc=False).scoped_to_run().freeze_gc is False


def test_a_freeze_made_by_the_process_is_kept():
    gc.freeze()
    handle = fastplug.patch_model(tiny_model("llama"), gradient_checkpointing=False, freeze_gc=True)
    handle.restore()
    assert gc.get_freeze_count() > 1000, "fastplug does not unfreeze what it did not freeze"


def test_release_is_idempotent():
    release = host_gc.hold()
    other = host_gc.hold()
    release()
    release()
    assert gc.get_freeze_count() > 0, "the second holder still holds"
    other()
    assert gc.get_freeze_count() == 0


def test_what_the_first_optimizer_step_leaves_alive_is_frozen_too():
    import torch

    release = host_gc.hold()
    at_patch = gc.get_freeze_count()
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    kept = [[i] for i in range(5000)]  # like the caches the first step fills (lists stay tracked)
    param.grad = torch.randn(4)
    optimizer.step()
    after_first = gc.get_freeze_count()
    assert after_first >= at_patch + len(kept), "the first step's survivors are frozen"
    more = [[i] for i in range(5000)]
    optimizer.step()
    assert gc.get_freeze_count() <= after_first, "later steps do not freeze again"
    release()
    assert gc.get_freeze_count() == 0
    assert not host_gc._armed, "the step callback is disarmed with the last holder"
    optimizer.step()  # and a step after the release freezes nothing
    assert gc.get_freeze_count() == 0 and len(kept) == len(more)
