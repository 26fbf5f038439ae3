"""accelerate's FSDP2 and peft models: the units `prepare` would shard, decided on CPU without sharding.

transformers' Trainer gives the FSDP plugin peft's FSDP1 wrap policy before `prepare`; accelerate 1.15's FSDP2
turns it into no units (the root alone). `peft_units_for_accelerate` makes it the decoder layers again. The
sharding itself runs on two GPUs (tests/gpu/test_distributed_gpu.py).
"""

from types import SimpleNamespace

import pytest

from fastplug.integrations.fsdp import accelerate_fsdp2_plugin, peft_units_for_accelerate
from tests.models.tiny import tiny_model

peft = pytest.importorskip("peft")
accelerate_utils = pytest.importorskip("accelerate.utils")
fsdp_utils = pytest.importorskip("accelerate.utils.fsdp_utils")
trainer_fsdp = pytest.importorskip("transformers.integrations.fsdp")


def _peft_model():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    return peft.get_peft_model(tiny_model("llama", num_hidden_layers=3), config)


def _units(plugin, model) -> list[str]:
    """The modules accelerate's FSDP2 would shard before the root, after the Trainer's peft update."""
    trainer_fsdp.update_fsdp_plugin_peft(model, SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    plugin.set_auto_wrap_policy(model)  # what fsdp2_prepare_model calls first
    policy = fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    return [] if policy is None else [name for name, m in model.named_modules() if policy(m)]


def test_peft_model_is_sharded_per_decoder_layer():
    model = _peft_model()
    plugin = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2)
    assert accelerate_fsdp2_plugin(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))) is plugin
    undo = peft_units_for_accelerate(model, plugin)
    assert undo is not None
    layers = [name for name, m in model.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 3
    assert _units(plugin, model) == layers
    undo()
    assert "set_auto_wrap_policy" not in vars(plugin)


def test_a_presharded_model_keeps_its_layers_as_units_when_the_trainer_prepares_it_with_its_optimizer():
    """FSDP2 prepares model and optimizer together: the Trainer hands the plugin no peft policy, and the
    plugin's transformer policy holds the plain class names. A model sharded per layer before the Trainer
    has FSDP<Name> classes (as `fully_shard` renames them); accelerate would not find the plain name."""
    from torch.distributed.fsdp import FSDPModule

    model = _peft_model()
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    renamed = type("FSDPLlamaDecoderLayer", (FSDPModule, type(layers[0])), {})
    for layer in layers:
        layer.__class__ = renamed  # what fully_shard does to a unit's class
    plugin = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    names_before = plugin.transformer_cls_names_to_wrap
    undo = peft_units_for_accelerate(model, plugin)
    plugin.set_auto_wrap_policy(model)
    policy = fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [m for m in model.modules() if policy(m)] == layers
    undo()
    assert plugin.transformer_cls_names_to_wrap == names_before


def test_without_fastplug_accelerate_shards_the_root_alone():
    """Why the adapter exists: with peft's policy accelerate 1.15 makes no unit below the root. When a later
    accelerate makes units of it, this test fails and the adapter can go."""
    assert _units(accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2), _peft_model()) == []


def test_nothing_to_adapt_without_fsdp2_or_peft():
    fsdp1 = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=1)
    assert accelerate_fsdp2_plugin(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp1))) is None
    assert accelerate_fsdp2_plugin(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None))) is None
    plugin = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2)
    assert peft_units_for_accelerate(tiny_model("llama"), plugin) is None
    assert peft_units_for_accelerate(_peft_model(), None) is None
    assert "set_auto_wrap_policy" not in vars(plugin)
