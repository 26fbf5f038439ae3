"""Kept for `from fastplug.patching import ...`: the patch engine lives in fastplug/patch/engine.py."""

from .patch.engine import PatchHandle, active_handle, kernel_path_of, patch_for_run, patch_model, unwrap

__all__ = ["PatchHandle", "active_handle", "kernel_path_of", "patch_for_run", "patch_model", "unwrap"]
