"""Shared test helpers: relative error against float64 references."""

import torch

# ||out - ref|| / ||ref|| bounds from DESIGN.md
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype, name="output", tol=None):
    err = rel_err(out, ref)
    bound = TOL[dtype] if tol is None else tol
    assert err < bound, f"{name}: relative error {err:.3e} >= {bound:.1e} ({dtype})"


def checkpointing_on(model) -> bool:
    """transformers 5.23 renamed is_gradient_checkpointing; the GPU image's 5.17 has only the old name."""
    if hasattr(model, "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing
