"""Fused LoRA projections: a LoRA linear, a LoRA QKV block and a LoRA MLP, each one autograd node.

A projection is y = x W^T + b + s * (x A^T) B^T. In plain peft that is three matmuls, a scale and two adds,
each its own autograd node saving its own inputs. Here the whole block is one torch.autograd.Function with a
hand-derived backward:

- the adapter term s * (x A^T) B^T is one matmul with alpha=s writing y, and the base matmul adds into it
  (no separate scale or add kernels, and y is read only in the big matmul's epilogue);
- projections that read the same x (q/k/v, gate/up) compute x A^T for all their adapters in one matmul on
  cat(A_1, A_2, ...) (ranks may differ), and in backward one matmul gives the adapters' share of dX and
  one gives every dA;
- dX is accumulated in one buffer (addmm_ with beta=1 for each contribution, the small one first);
- parameters are kept on ctx, not saved tensors (no checkpointing hooks for them), version-checked;
- the MLP saves only x and the gate/up outputs (plus the small [N, r] x A^T): the activation is recomputed
  in backward by `glu_backward`, which writes h, dgate and dup into buffers this function owns.

A base weight may be a frozen bitsandbytes 4-bit weight (QLoRA): it is dequantized by
`fastplug.kernels.quant` into one buffer shared by all layers just before each matmul that reads it, once
in forward and once more in backward for dX (never saved; no dW: 4-bit weights are frozen).
A base weight may also be a frozen FP8 block-scaled weight (`fastplug.kernels.fp8.fp8_parameter`): its forward
term runs on the FP8 GEMM (the input quantized once for all projections that read it), its dX term through
the weight dequantized into that shared buffer.

Matmuls run in the input dtype with fp32 accumulation (what torch's matmul does). The LoRA maths is plain
torch; the MLP activation uses the Triton kernels of `fastplug.kernels.activations`. Knows nothing of peft.

Under torch.compile (while Dynamo traces) the blocks are registered operators (`fastplug::lora_projections`,
`fastplug::lora_mlp` and their backward) that run the same forward and backward code, opaque to the compiler;
bases that patching stacked are found stacked in memory. Quantized bases keep the eager function (a graph
break).

One module per stage, each importing only from those above it in this list:
    projections  `LoRAProjection`, `StackedBase` (`QUANTIZED_STACK`, `is_stacked`), the input checks, the flat
                 parameter order (`_flatten`), the adapters of one input side by side (`_Adapters`)
    casts        the adapters' compute-dtype copies and their caches (`_CAST_CACHE`, the stacked adapters'
                 matrices `_STACKED_ADAPTERS`), one generation each: `invalidate_adapter_casts`; none
                 while a CUDA graph is captured (`adapters_cacheable`)
    maths        the forward and backward pieces: base GEMMs (dense, 4-bit, FP8), adapter matmuls, dX, grads,
                 per projection or stacked
    functions    the blocks' forward and backward (`_project`, `_mlp` and their grads) and the autograd nodes
                 (`_SharedInputLoRA`, `_LoRAMLP`)
    ops          the registered operators torch.compile traces (`fastplug::lora_projections`, `fastplug::lora_mlp`
                 and their backward)
    api          `lora_linear`, `lora_projections`, `lora_qkv`, `lora_mlp`: checks, then one node or operator
Only the public names are re-exported here; tests reach private ones in the module that owns them. Read a
rebound global (`casts._generation`) through its module, never by `from ... import`.
"""

from __future__ import annotations

from .api import lora_linear, lora_mlp, lora_projections, lora_qkv
from .casts import invalidate_adapter_casts
from .projections import QUANTIZED_STACK, LoRAProjection, StackedBase, is_stacked

__all__ = [
    "QUANTIZED_STACK",
    "LoRAProjection",
    "StackedBase",
    "invalidate_adapter_casts",
    "is_stacked",
    "lora_linear",
    "lora_mlp",
    "lora_projections",
    "lora_qkv",
]
