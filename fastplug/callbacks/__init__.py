"""The Hugging Face TrainerCallback (importing this imports transformers)."""

from .hf import FastKernels

__all__ = ["FastKernels"]
