"""fastplug: Triton kernels for LLM fine-tuning, plugged into the trainers people already use.

    Trainer(..., callbacks=[FastKernels()])        # Hugging Face Trainer
    FastSFTTrainer(...) / FastDPOTrainer(...)      # TRL  (fastplug.integrations.trl)
    L.Trainer(strategy="fastkernels")              # Lightning, registered by `import fastplug`

Importing fastplug is light: transformers, TRL and Lightning are imported only when used.
"""

from .integrations._import_hooks import when_imported
from .options import KernelOptions

__version__ = "0.1.0"
__all__ = ["FastKernels", "KernelOptions", "PatchHandle", "patch_model", "__version__"]
__all__ += ["FastModel", "fast_generate"]

_LAZY = {
    "FastKernels": ("fastplug.integrations.hf_trainer", "FastKernels"),
    "patch_model": ("fastplug.patch.engine", "patch_model"),
    "PatchHandle": ("fastplug.patch.engine", "PatchHandle"),
    "FastModel": ("fastplug.generate.fast_model", "FastModel"),
    "fast_generate": ("fastplug.generate.api", "fast_generate"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'fastplug' has no attribute {name!r}")


def _register_lightning_strategies(strategies_module):
    from .integrations.lightning import register_strategies

    register_strategies(strategies_module)


def _register_attention(modeling_utils):
    from .models.fast_attention import register

    register()


# `attn_implementation="fastplug"` works as soon as transformers' models can be built.
when_imported("transformers.modeling_utils", _register_attention)

# Lightning's registry lives in its strategies package; lightning.pytorch and pytorch_lightning each have one.
for _name in ("lightning.pytorch.strategies", "pytorch_lightning.strategies"):
    when_imported(_name, _register_lightning_strategies)
