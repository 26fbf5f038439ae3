"""Kept for `from fastplug.generation import ...`: generation lives in fastplug/generate/ (api.py, decoder.py, ...)."""

from .generate.api import fast_generate, graph_status

__all__ = ["fast_generate", "graph_status"]
