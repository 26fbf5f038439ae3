"""Shared test helpers: relative error against float64 references, a plain training loop."""

import torch

# ||out - ref|| / ||ref|| bounds: the tolerance policy of docs/contributing.md
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


def train_losses(
    run, model, batches, fused: bool = False, make_optimizer=None, after_forward=None, accumulate: int = 1
) -> list[float]:
    """Per-step losses of plain LoRA steps: forward through `run` (the model, or it compiled), backward, an
    optimizer step on the model's trainable parameters (`make_optimizer(params)`, default AdamW lr 1e-3) after
    every `accumulate` batches (each loss divided by it), zero_grad. `after_forward(model)` runs between
    forward and backward (a check of the step's state)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params) if make_optimizer else torch.optim.AdamW(params, lr=1e-3, fused=fused)
    model.train()
    losses = []
    for i, ids in enumerate(batches):
        loss = run(input_ids=ids, labels=ids).loss
        if after_forward is not None:
            after_forward(model)
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
