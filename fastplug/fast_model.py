"""Kept for `from fastplug.fast_model import FastModel`: it lives in fastplug/generate/fast_model.py."""

from .generate.fast_model import FastModel

__all__ = ["FastModel"]
