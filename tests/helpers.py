"""Shared test helpers: relative error against float64 references, the float64 values of a bitsandbytes 4-bit weight,
a plain training loop."""

import torch
import torch.nn.functional as F

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


def dequantize_float64(weight) -> torch.Tensor:
    """The [out, in] float64 values of a bitsandbytes 4-bit weight in its standard layout, from its bytes as
    bitsandbytes documents them: elements row-major, two a byte, the first in the high nibble; value =
    code[index] * absmax[element // blocksize]; nested absmax = code2[q] * absmax2[block // blocksize2] + offset.
    The truth for 4-bit paths: bitsandbytes' own CPU dequantization is wrong on AVX-512 CPUs where a block
    straddles two rows (tests/test_bnb_layouts.py)."""
    qs = weight.quant_state
    assert not getattr(qs, "packing_format_for_cpu", False), "the standard layout only"
    out, k = qs.shape
    numel = out * k
    data = weight.data.reshape(-1).view(torch.uint8)
    index = torch.stack([data >> 4, data & 15], -1).reshape(-1)[:numel].long()
    absmax = qs.absmax.double()
    if qs.nested:
        s2 = qs.state2
        blocks = torch.arange(qs.absmax.numel())
        absmax = s2.code.double()[qs.absmax.long()] * s2.absmax.double()[blocks // s2.blocksize] + float(qs.offset)
    return (qs.code.double()[index] * absmax[torch.arange(numel) // qs.blocksize]).reshape(out, k)


class Float64Linear(torch.nn.Module):
    """A 4-bit layer's truth: x @ W.T (+ bias) in float64, W the float64 values of its bytes; output in x's dtype."""

    def __init__(self, layer):
        super().__init__()
        self.register_buffer("weight", dequantize_float64(layer.weight))
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().double())

    def forward(self, x):
        return F.linear(x.double(), self.weight, self.bias).to(x.dtype)


def float64_bases(model):
    """`model` with each bitsandbytes Linear4bit replaced, in place, by its Float64Linear (peft's LoRA layers keep
    their adapters and call it as their base)."""
    import bitsandbytes as bnb

    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                setattr(owner, name, Float64Linear(child))
    return model


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


def padding_reads_on_device(monkeypatch) -> list:
    """A list that grows by one at each read of a training batch's padding by fastplug's forward itself
    (`models.padding.padding_facts` called by `unmaskable`: on a GPU, a host sync), not at those made on the host
    where the batch was collated."""
    import sys

    from fastplug.models import padding

    calls = []
    read = padding.padding_facts

    def counted(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "unmaskable":
            calls.append(1)
        return read(*args, **kwargs)

    monkeypatch.setattr(padding, "padding_facts", counted)
    return calls
