"""bitsandbytes' 4-bit layers while the self-check runs: computed in float64 from their bytes on the CPU.

bitsandbytes' CPU output is no reference (0.50.2): with AVX-512F its dequantizer gives a block that straddles two
rows the absmax of another block (0.15-0.27 off), and with AVX512-BF16 its forward repacks the weight in place at
the first eval forward without grad (bf16 absmax and output, no input gradient afterwards; it raises where
out % 32 or in % blocksize is not 0), which the check's own eval forward would do to the user's model. While
`float64_4bit_forwards(model)` is open, each Linear4bit of `model` given a CPU input computes x @ W.T (+ bias) in
float64 from the float64 values of its bytes (`dequantize_4bit_reference`), cast to x's dtype: bitsandbytes'
forward (and so its repack) does not run. CUDA inputs keep bitsandbytes' forward, whose values are these.

The class's forward is swapped, not the instances': a forward in an instance's __dict__ would make the fused path
decline the layer (`peft_lora._has_hooks`). Other models' layers keep bitsandbytes' forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.quant import dequantize_4bit_reference, layout_reason
from .peft_lora import _bnb_linear_4bit_class


@contextlib.contextmanager
def float64_4bit_forwards(model: nn.Module):
    cls = _bnb_linear_4bit_class()
    ours = {id(m) for m in model.modules() if cls is not None and isinstance(m, cls)}
    if not ours:
        yield
        return
    original = cls.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if id(self) not in ours or x.device.type != "cpu" or layout_reason(self.weight) is not None:
            return original(self, x)
        bias = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), dequantize_4bit_reference(self.weight, torch.float64), bias).to(x.dtype)

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original
