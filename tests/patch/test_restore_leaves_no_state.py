"""After `restore()` nothing of fastplug stays in the process: no hook on any module of the model or in torch's
global hook tables (modules' and optimizers'), no instance attribute, the config as it was, Python's gc not
frozen, and no module-level container of fastplug's holding a tensor or the model. Through `patch_model` and
through `FastModel`."""

import sys
import weakref

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch.nn.modules import module as torch_module

import fastplug
from fastplug.kernels import state
from fastplug.patch import host_gc
from tests.model_path_helpers import save_tiny
from tests.models.tiny import batch, tiny_model

peft = pytest.importorskip("peft")

_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)
_OPTIMIZER_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
_CONFIG_ATTRIBUTES = ("_attn_implementation", "_experts_implementation")
# FastModel's own record of how it loaded the model (for_training reads it), not a patch: kept by design
_FAST_MODEL_ATTRIBUTES = {"_fastplug_checkpointing", "_fastplug_memory_budget", "_fastplug_max_seq_length"}


def _fastplug_names(module) -> set[str]:
    return {name for name in vars(module) if name.startswith(("_fastplug", "fastplug"))}


def _hook_names(hooks) -> list[str]:
    # by what runs, not by handle id: the FastModel test compares with another instance of the model
    return [f"{getattr(h, '__module__', '')}.{getattr(h, '__qualname__', type(h).__name__)}" for h in hooks.values()]


def _state_of(model) -> dict:
    """Per module: its hooks (by key), its instance-attribute names and fastplug-named attributes."""
    modules = {}
    for path, module in model.named_modules():
        modules[path] = (
            {table: _hook_names(getattr(module, table, {})) for table in _HOOK_TABLES},
            set(vars(module)),
            _fastplug_names(module),
        )
    config = {name: getattr(model.config, name, None) for name in _CONFIG_ATTRIBUTES}
    return {"modules": modules, "config": config}


def _global_hooks() -> dict:
    """torch's process-wide hook tables: modules' and optimizers' (fastplug's optimizer-step hook among them)."""
    tables = {name: getattr(torch_module, name, {}) for name in _GLOBAL_HOOKS}
    tables.update({name: getattr(torch_optimizer, name) for name in _OPTIMIZER_HOOKS})
    return {name: _hook_names(table) for name, table in tables.items()}


_MAPPINGS = (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
_CONTAINERS = (*_MAPPINGS, list, set, tuple, weakref.WeakSet)


def _holds(container, model, tensors: bool) -> bool:
    """The model (or one of its modules), or with `tensors` any tensor, in `container` (keys and values of a
    mapping, weak ones included), one level deep."""
    values = list(container.items()) if isinstance(container, _MAPPINGS) else list(container)
    flat = [x for v in values for x in (v if isinstance(v, tuple) else (v,))]
    modules = {id(m) for m in model.modules()}
    return any((tensors and isinstance(x, torch.Tensor)) or id(x) in modules for x in flat)


def _module_containers_holding(model, tensors: bool = True) -> list[str]:
    found = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fastplug") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if type(value).__module__.startswith("fastplug") and hasattr(value, "__dict__"):
                value = vars(value)  # an object of fastplug's own (a cache): its fields
            if isinstance(value, _CONTAINERS) and _holds(value, model, tensors):
                found.append(f"{name}.{attr}")
    return found


def _train_step(model) -> None:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    padded = batch()  # and a right-padded batch: the padding paths keep their tally
    padded["attention_mask"] = torch.ones_like(padded["attention_mask"])
    padded["attention_mask"][1, -3:] = 0
    padded["labels"][1, -3:] = -100
    for inputs in (batch(), padded):
        model(**inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _process_state(model) -> dict:
    """What the process holds: patched models alive (another test's in this worker may be), the containers."""
    return {"holders": state.holders(), "containers": _module_containers_holding(model)}


def _assert_nothing_left(model, before, global_hooks, process, allowed=frozenset()) -> None:
    after = _state_of(model)
    assert after["config"] == before["config"]
    assert after["modules"].keys() == before["modules"].keys()
    for path, (hooks, names, ours) in after["modules"].items():
        hooks_before, names_before, ours_before = before["modules"][path]
        assert hooks == hooks_before, f"{path or 'model'}: hooks left"
        assert ours - allowed <= ours_before, f"{path or 'model'}: fastplug attributes left: {ours - ours_before}"
        assert names - allowed <= names_before, f"{path or 'model'}: attributes left: {names - names_before}"
    hooks = _global_hooks()
    if process["holders"] == 0:
        # fastplug's optimizer-step hook, left by the kernels used outside a patch (an earlier test's in this
        # worker), goes with the last release (kernels/state.py): gone or as before, never added
        for name in _OPTIMIZER_HOOKS:
            assert set(hooks[name]) <= set(global_hooks[name]), name
            hooks[name] = global_hooks[name]
    assert hooks == global_hooks
    assert host_gc._holders == 0
    assert state.holders() == process["holders"]  # the patch released what it acquired
    # no other patched model alive in this process (another test's, in this worker): the shared state, caches of
    # tensors included, is gone too; else those caches stay for it, and only references to this model must go
    alone = not process["holders"]
    if alone:
        assert not state.hook_installed()
        assert not any(state.cached_tensors().values()), state.cached_tensors()
    assert set(_module_containers_holding(model, tensors=alone)) <= set(process["containers"])


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"])
    return get_peft_model(tiny_model("llama"), config)


@pytest.mark.parametrize("options", [{}, {"gradient_checkpointing": "auto"}, {"gradient_checkpointing": "offload"}])
def test_patch_model_restore_leaves_no_state(options):
    model = _lora_llama()
    before, global_hooks, process = _state_of(model), _global_hooks(), _process_state(model)
    handle = fastplug.patch_model(model, **options)
    _train_step(model)
    handle.restore()
    _assert_nothing_left(model, before, global_hooks, process)


@pytest.mark.parametrize("loaded_with", [True, False, "auto"])
def test_fast_model_restore_leaves_no_state(tmp_path, loaded_with):
    """get_peft_model's "auto" plan belongs to the patch: restore() takes its hooks off too."""
    from transformers import AutoModelForCausalLM

    from fastplug import FastModel, KernelOptions
    from fastplug.models.structure import unwrap
    from fastplug.patch.engine import active_handle

    path = save_tiny(tmp_path, "llama")
    # what the model is without fastplug: the same checkpoint loaded by transformers, then peft's adapters
    plain = AutoModelForCausalLM.from_pretrained(path)
    before = _state_of(unwrap(_peft(plain)))
    global_hooks, process = _global_hooks(), _process_state(plain)
    model, _ = FastModel.from_pretrained(path, options=KernelOptions(gradient_checkpointing=loaded_with))
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="auto")
    _train_step(peft_model)
    FastModel.for_training(FastModel.for_inference(peft_model))
    _train_step(peft_model)
    active_handle(peft_model).restore()
    before["config"] = {name: getattr(plain.config, name, None) for name in _CONFIG_ATTRIBUTES}
    _assert_nothing_left(model, before, global_hooks, process, allowed=_FAST_MODEL_ATTRIBUTES | {"fast_generate"})


def _peft(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
