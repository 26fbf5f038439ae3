"""Decode kernels for small batches (1-16 rows, one token each): what `fast_generate` runs per decode step.

At batch 1 a decoder layer is bound by reading its weights once, and a step of ~20 small kernels per layer is
bound by their launches. These kernels do a layer in ~5 launches (LoRA adds one per input):

- `gemv`: y = x W^T for a few rows of x, reading W once. Optionally, in the same kernel: RMSNorm of x (the
  norm before the projection: every program recomputes the row statistics of x, a few KiB from L2), up to
  three weights read as one output (q/k/v: one launch, no concatenated copy of the weights), bias, the
  unmerged LoRA term s (x A^T) B^T added in the epilogue (x A^T comes from a `gemv` over the A's), the gated
  activation act(x Wg^T) * (x Wu^T) (gate and up in one program: the hidden is the only output), the
  residual add y = r + x W^T, and the logits' softcap with fp32 output (the LM head). The weights may be
  bitsandbytes 4-bit ones (NF4/FP4, QLoRA bases): each tile is decoded from the packed bytes in registers.
- `decode_attention`: one new token per row over a static KV cache, with q/k RMSNorm, RoPE, the write of the
  new key/value, softcap, sliding windows and ring caches in the same kernel (flash-decoding splits).
- `add_rms_norm`: h += RMSNorm(y) in place (Gemma2/3's norm of a sub-block's output before the residual add).
- `greedy_emit`: argmax of the logits and the bookkeeping of a decode step (pad for finished rows, EOS
  detection, the output column, the next input token, the position) in one launch.

One module per stage:
    config        limits (MAX_ROWS, ...), the argument tuples several kernels share (`Rows`, `Norm`), the dot
                  precision, and the GEMV's launch config (`DecodeGemvConfig` by `decode_gemv_config`, tuned
                  through `kernels.tuning` as "decode_gemv")
    gemv_kernels  the GEMV's `@triton.jit` kernel and its argument tuples (`GemvArgs`, `Segment`, and the constexpr
                  tuples `GemvFlags`, `Q4Format`, `GemvTile`, `WordsLoop`)
    gemv          `gemv` (checks, path and tile, launch), `gemv_reference`, `packed_reason`
    attention     `decode_attention`, its kernels and argument tuples, `decode_attention_reference`, `ring_columns`
    step          `add_rms_norm` and `greedy_emit`
Every name below stays importable from here; the decode step that runs them is `fastplug.generate.fast_decode`.

Rounding follows the unfused modules (transformers' RMSNorm rounds before its weight, each projection's output
is rounded once, LoRA's x A^T is rounded before B, logits are rounded to the model dtype before the argmax),
so greedy tokens match theirs. Every kernel has a torch reference (`*_reference`), the path for tensors Triton
cannot run.
"""

from __future__ import annotations

from .attention import decode_attention, decode_attention_reference, ring_columns
from .config import ACTIVATIONS, MAX_ROWS, MAX_SEGMENTS, WORDS_MAX_ROWS, DecodeGemvConfig, decode_gemv_config
from .gemv import gemv, gemv_reference, packed_reason
from .step import add_rms_norm, greedy_emit

_gemv_config = decode_gemv_config  # the name fastplug.bench.generate imports

__all__ = [
    "ACTIVATIONS",
    "MAX_ROWS",
    "MAX_SEGMENTS",
    "WORDS_MAX_ROWS",
    "DecodeGemvConfig",
    "add_rms_norm",
    "decode_attention",
    "decode_attention_reference",
    "decode_gemv_config",
    "gemv",
    "gemv_reference",
    "greedy_emit",
    "packed_reason",
    "ring_columns",
]
