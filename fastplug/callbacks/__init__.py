"""Kept for `from fastplug.callbacks import FastKernels`: the callback lives in fastplug/integrations/hf_trainer.py."""

from ..integrations.hf_trainer import FastKernels

__all__ = ["FastKernels"]
