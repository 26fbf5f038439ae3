"""Flash attention, forward and backward: causal or not, sliding window, logit softcap (Gemma2), GQA/MQA,
head_dim up to 256 (any size: the head dim is padded to a power of two by masking), packed rows (varlen),
attention sinks (gpt-oss: a learned logit per head that joins each row's softmax denominator and adds no value).

Layout as transformers' attention functions receive it: q (B, Hq, T, D), k/v (B, Hkv, S, D), any strides;
the output is (B, T, Hq, D) like `sdpa_attention_forward` returns it. GQA reads k/v head `h // (Hq // Hkv)`
and never repeats k/v in memory; dK/dV programs loop over the query heads of their group, so no atomics.

Forward keeps the output and the log-sum-exp (base 2, fp32); backward recomputes the probabilities in two
kernels and no T x S matrix is ever in memory. fp32 accumulation; fp32 inputs use IEEE fp32 dots (no TF32).

One module per stage:
    config     limits (MAX_HEAD_DIM) and the input checks, the launch config (`AttentionConfig` by
               `attention_config` from `AttentionTables`, tuned through `kernels.tuning` as "attention"), TMA or
               pointers (`_use_tma`), the problem (`_Problem`) and the structured arguments every kernel takes
               from it (`Operand`, `Heads`, `Scores`, `Mask`, `Tile`: `_launch_args`)
    tiles      the `@triton.jit` helpers the three kernels share: which keys a query row sees (`_row_bounds`, the
               one masking rule: causal, sliding window, document bounds), the block split, tile reads, scores
    forward    the forward kernel `_attn_fwd` (sinks included) and its launcher `_flash_forward`
    backward   the dQ kernel (it forms delta too) and the dK/dV kernel, their launchers, `_flash_backward`, the
               sinks' gradient
    varlen     packed rows: per-token document bounds from cu_seqlens, position_ids or a right-padding mask
    reference  the torch reference (`attention_reference`) and the masking rule spelled out (`visible_keys`)
    ops        the autograd Function `FlashAttention` (eager) and the registered operators torch.compile traces
    dispatch   `attention` (checked) and `flash_attention` (unchecked): the torch reference, SDPA or the kernel
Every name below stays importable from here, the private ones tests, scripts and benches reach included.
`importlib.import_module("fastplug.kernels.attention")` gives this package (`fastplug.kernels.attention`, the
attribute, is the function). A monkeypatch of a name here reaches callers that look it up here at call time
(`models.fast_attention`), not the modules of this package, which import from each other.
"""

from __future__ import annotations

# The private names (underscored) are here for the tests, scripts and benches that reach them: not an API.
from .._utils import next_power_of_2  # noqa: F401  (fastplug.bench.micro)
from .backward import (  # noqa: F401
    _attn_bwd_dkdv,
    _attn_bwd_dq,
    _flash_backward,
    _launch_dkdv,
    _launch_dq,
    _sinks_grad,
)
from .config import (  # noqa: F401
    ATTENTION_TABLES,
    INTERPRETER_TILE,
    LOG2E,
    MAX_HEAD_DIM,
    AttentionConfig,
    AttentionTables,
    Heads,
    Mask,
    Operand,
    Scores,
    Tile,
    _bucket,
    _check_inputs,
    _config,
    _launch_args,
    _operand,
    _Problem,
    _problem,
    _tma_alloc,
    _use_tma,
    attention_config,
)
from .dispatch import _normalise_window, _sdpa, _sdpa_suits, attention, flash_attention  # noqa: F401
from .forward import _attn_fwd, _flash_forward  # noqa: F401
from .ops import FlashAttention, _flash_attention_backward_op, _flash_attention_op  # noqa: F401
from .reference import _reference, attention_reference, visible_keys  # noqa: F401
from .varlen import bounds_from_cu_seqlens, cu_seqlens_from_position_ids, packed_bounds, right_padding_bounds

__all__ = [
    "ATTENTION_TABLES",
    "INTERPRETER_TILE",
    "LOG2E",
    "MAX_HEAD_DIM",
    "AttentionConfig",
    "AttentionTables",
    "FlashAttention",
    "attention",
    "attention_config",
    "attention_reference",
    "bounds_from_cu_seqlens",
    "cu_seqlens_from_position_ids",
    "flash_attention",
    "packed_bounds",
    "right_padding_bounds",
    "visible_keys",
]
