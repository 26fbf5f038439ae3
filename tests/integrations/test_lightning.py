"""The fastplug Lightning strategies with the real Lightning on a tiny Llama: same losses as Lightning alone,
modules restored after fit and after an exception, names registered in both Lightning packages."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import fastplug  # noqa: E402,F401  (registers the strategies)
from fastplug import KernelOptions  # noqa: E402
from fastplug.integrations.lightning import (  # noqa: E402
    FastKernelsDDPStrategy,
    FastKernelsFSDPStrategy,
    FastKernelsStrategy,
    find_transformers_models,
)
from fastplug.patch.engine import active_handle  # noqa: E402
from tests.helpers import checkpointing_on, padding_reads_on_device, rel_err  # noqa: E402
from tests.models.tiny import tiny_model  # noqa: E402

# what the trainer does with the patch, not the kernels' numbers (tests/kernels): torch references on CPU
pytestmark = pytest.mark.torch_reference

STEPS = 2
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _leave_no_distributed_state():
    """A DDP fit sets MASTER_PORT, WORLD_SIZE, ... in os.environ and keeps its process group: later tests
    (and their subprocesses, which inherit the environment) would try to join it."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def tiny_llama(seed=0):
    return tiny_model("llama", seed=seed)


class TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lm = tiny_llama()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.lm(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batches():
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.randint(0, 128, (8, 24), generator=generator), batch_size=2)


def module_state(module):
    """Identity, class and instance forward of every module, identity of every parameter."""
    modules = [(name, id(m), type(m), vars(m).get("forward")) for name, m in module.named_modules()]
    return modules, [(name, id(p)) for name, p in module.named_parameters()]


class Probe(L.Callback):
    """Records at each step whether the model was patched and checkpointed; raises at `raise_at` if set."""

    def __init__(self, raise_at=None):
        self.raise_at, self.active, self.checkpointing = raise_at, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.active.append(active_handle(pl_module.lm) is not None)
        self.checkpointing.append(checkpointing_on(pl_module.lm))
        if trainer.global_step == self.raise_at:
            raise RuntimeError("boom at step 2")


def fit(strategy, callbacks=()):
    module = TinyLM()
    before = module_state(module.lm)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False, callbacks=list(callbacks),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, batches())
    return module, before


@pytest.mark.compat
@pytest.mark.parametrize(("name", "lightning_name"), [("fastkernels", "auto"), ("fastkernels_ddp", "ddp")])
def test_fit_matches_lightning_and_restores(name, lightning_name):
    # DDP (one CPU process, gloo) samples the data in its own order, so each name is compared with its base
    reference, _ = fit(lightning_name)
    probe = Probe()
    module, before = fit(name, [probe])
    assert probe.active == [True] * STEPS
    assert probe.checkpointing == [True] * STEPS, "gradient checkpointing on while fitting (default options)"
    assert rel_err(torch.tensor(module.losses), torch.tensor(reference.losses)) < 1e-5
    assert active_handle(module.lm) is None
    assert module_state(module.lm) == before
    assert not checkpointing_on(module.lm), "turned off again at teardown"


def test_fit_restores_after_exception_with_constructed_strategy():
    probe = Probe(raise_at=2)
    strategy = FastKernelsStrategy(options=KernelOptions(gradient_checkpointing=False))
    module = TinyLM()
    before = module_state(module.lm)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=5, logger=False, callbacks=[probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, batches())
    assert probe.active == [True, True]
    assert probe.checkpointing == [False, False], "options reach the strategy"
    assert strategy.fast_kernels_summary.startswith("[lm] fastplug patch of LlamaForCausalLM")
    assert active_handle(module.lm) is None
    assert module_state(module.lm) == before


def test_the_mixin_is_named_for_lightning_and_its_former_name_still_imports():
    from fastplug.integrations import lightning as adapter

    for strategy in (FastKernelsStrategy, FastKernelsDDPStrategy, FastKernelsFSDPStrategy):
        assert issubclass(strategy, adapter.LightningFastKernelsMixin)
    assert adapter.FastKernelsMixin is adapter.LightningFastKernelsMixin
    assert {"LightningFastKernelsMixin", "FastKernelsMixin"} <= set(adapter.__all__)


def test_options_may_be_a_dict():
    assert FastKernelsStrategy(options={"mlp": False}).fast_kernels == KernelOptions(mlp=False)


def test_registered_names_resolve_and_take_the_accelerator_device():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, StrategyRegistry

    expected = {
        "fastkernels": (FastKernelsStrategy, SingleDeviceStrategy),
        "fastkernels_ddp": (FastKernelsDDPStrategy, DDPStrategy),
        "fastkernels_fsdp": (FastKernelsFSDPStrategy, ModelParallelStrategy),  # Lightning's FSDP2 strategy
    }
    for name, (cls, base) in expected.items():
        assert StrategyRegistry[name]["strategy"] is cls and issubclass(cls, base)
    # Built from the registry with no arguments, the single-device strategy takes its device from the accelerator.
    trainer = L.Trainer(strategy="fastkernels", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, FastKernelsStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.parallel_devices == [torch.device("cpu")]


def test_find_transformers_models_takes_the_outermost():
    from peft import LoraConfig, get_peft_model

    holder = torch.nn.ModuleDict(
        {"policy": get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"])), "ref": tiny_llama(1)}
    )
    assert [path for path, _ in find_transformers_models(holder)] == ["policy", "ref"]


REGISTRATION_CHECK = """
import importlib
import lightning.pytorch.strategies as lp
import pytorch_lightning.strategies as pl
from fastplug.integrations.lightning import FastKernelsStrategy, FastKernelsStrategyPL
for strategies, cls in ((lp, FastKernelsStrategy), (pl, FastKernelsStrategyPL)):
    names = {"fastkernels", "fastkernels_ddp", "fastkernels_fsdp"}
    assert names <= set(strategies.StrategyRegistry), (strategies.__name__, sorted(strategies.StrategyRegistry))
    assert strategies.StrategyRegistry["fastkernels"]["strategy"] is cls
    assert issubclass(cls, strategies.SingleDeviceStrategy)
print("ok")
"""


@pytest.mark.parametrize(
    "imports",
    ["import fastplug; import lightning.pytorch; import pytorch_lightning",
     "import lightning.pytorch; import pytorch_lightning; import fastplug"],
)  # fmt: skip
def test_registration_in_either_import_order(imports):
    pytest.importorskip("pytorch_lightning")
    code = textwrap.dedent(imports.replace("; ", "\n")) + REGISTRATION_CHECK
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


class CompiledTinyLM(TinyLM):
    """For torch.compile(module): Lightning compiles its steps. No .item() inside them, and use_cache=False
    (transformers logs a warning, a graph break, when a cache is asked for under checkpointing)."""

    def forward(self, batch):
        return self.lm(input_ids=batch, labels=batch, use_cache=False).loss

    def training_step(self, batch, batch_idx):
        loss = self(batch)
        self.losses.append(loss.detach())
        return loss


@pytest.mark.interpreted_kernels  # torch.compile of the kernels
def test_fit_of_a_compiled_module_patches_the_model_it_compiles():
    """torch.compile(module) handed to Trainer.fit with the fastkernels strategy: the strategy patches the
    module's transformers model before the compiled forward first runs, no graph break and no recompile from
    step to step (as many graphs as Lightning alone), same losses, restored after."""
    from torch._dynamo.utils import counters

    runs = {}
    for name in ("fastkernels", "auto"):
        torch._dynamo.reset()
        counters.clear()
        module, probe = CompiledTinyLM(), Probe()
        before = module_state(module.lm)
        trainer = L.Trainer(
            strategy=name, accelerator="cpu", devices=1, max_steps=STEPS, logger=False, callbacks=[probe],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(torch.compile(module, backend="aot_eager"), batches())
        assert not counters["graph_break"], dict(counters["graph_break"])
        runs[name] = (module, probe, before, counters["stats"]["unique_graphs"])
    module, probe, before, graphs = runs["fastkernels"]
    reference, _, _, reference_graphs = runs["auto"]
    assert graphs >= 1 and graphs == reference_graphs, (graphs, reference_graphs)
    assert probe.active == [True] * STEPS
    assert rel_err(torch.stack(module.losses), torch.stack(reference.losses)) < 1e-5
    assert active_handle(module.lm) is None
    assert module_state(module.lm) == before


class PaddedLM(TinyLM):
    def training_step(self, batch, batch_idx):
        loss = self.lm(**batch).loss
        self.losses.append(loss.item())
        return loss


class PaddedLMChangingItsBatches(PaddedLM):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch  # a hook of the user's: fastplug cannot tell what it did to the mask


def padded_batches():
    """Rows of 5-20 tokens, padded on the right per batch with their pads' labels ignored (the HF collators' way)."""
    generator = torch.Generator().manual_seed(1)
    rows = [
        torch.randint(1, 128, (int(n),), generator=generator) for n in torch.randint(5, 21, (8,), generator=generator)
    ]

    def collate(features):
        ids = torch.nn.utils.rnn.pad_sequence(features, batch_first=True)
        mask = (torch.arange(ids.shape[1])[None] < torch.tensor([[len(f)] for f in features])).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate)


@pytest.mark.parametrize("module_class, reads", [(PaddedLM, 0), (PaddedLMChangingItsBatches, STEPS)])
def test_padded_batches_are_checked_on_the_host_where_lightning_moves_them(monkeypatch, module_class, reads):
    """With Lightning's own batch transfer, the strategy checks a padded batch's padding on the host and the forward
    reads none from the device; a module with a transfer hook of its own has it read on the device. The losses are
    Lightning's either way."""
    from fastplug.models import padding

    read_on_device = padding_reads_on_device(monkeypatch)
    checked = []
    check = padding.unmaskable
    monkeypatch.setattr(padding, "unmaskable", lambda *args: checked.append(1) or check(*args))
    losses = {}
    for strategy in ("auto", "fastkernels"):  # the plain run checks nothing: the counts are the patched run's
        module = module_class()
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, padded_batches())
        losses[strategy] = torch.tensor(module.losses)
    assert len(checked) == STEPS, "each batch's padding checked by the patched forward"
    assert len(read_on_device) == reads
    assert rel_err(losses["fastkernels"], losses["auto"]) < 1e-5
