"""4-bit weights of bitsandbytes (NF4 and FP4, with or without double quantization): dequantization and a
decode GEMV in Triton, reading the packed bytes directly. No bitsandbytes call runs here, and bitsandbytes is
never imported (a weight is recognised by its `quant_state`).

One module per stage:
    formats        the format, and what the kernels read of a weight (`unpack`, cached per weight), including the
                   CPU inference layout of bitsandbytes >= 0.49 read back into the standard one
    dequant        `dequantize_4bit`, `dequantize_4bit_scratch`, `dequantize_4bit_stacked` (QLoRA training)
    gemv_kernels   the GEMV's word-wise loop as `@triton.jit` functions (`words_row_sums`), which the one GEMV
                   kernel, the decode GEMV's (`fastplug.kernels.decode`), runs on 4-bit weights
    gemv_tile      its tile (`GemvConfig` by `gemv_config`, tuned through `kernels.tuning` as "gemv_4bit") and
                   `launch_checked`
    gemv           `gemv_4bit` (decode: a few rows of x times the packed weight, by the decode GEMV)
The inline PTX of the GEMV is in `fastplug.kernels.ptx`. Every name below stays importable from here.
"""

from __future__ import annotations

from ..ptx import layouts_agree
from .dequant import (
    DEQUANT_BLOCK,
    GROUP_MAX,
    block_scale,
    dequantize_4bit,
    dequantize_4bit_reference,
    dequantize_4bit_scratch,
    dequantize_4bit_stacked,
)
from .formats import (
    INSTALL_HINT,
    Packed4bit,
    is_4bit,
    layout_reason,
    require_bitsandbytes,
    shape_4bit,
    unpack,
)
from .gemv import gemv_4bit, gemv_4bit_reference
from .gemv_kernels import LOOKUP_GATHER, LOOKUP_LOAD, LOOKUP_SHFL, LOOKUPS, words_row_sums
from .gemv_tile import GEMV_MAX_ROWS, GemvConfig, default_gemv_config, gemv_config, launch_checked

__all__ = [
    "DEQUANT_BLOCK",
    "GEMV_MAX_ROWS",
    "GROUP_MAX",
    "INSTALL_HINT",
    "LOOKUPS",
    "LOOKUP_GATHER",
    "LOOKUP_LOAD",
    "LOOKUP_SHFL",
    "GemvConfig",
    "Packed4bit",
    "block_scale",
    "default_gemv_config",
    "dequantize_4bit",
    "dequantize_4bit_reference",
    "dequantize_4bit_scratch",
    "dequantize_4bit_stacked",
    "gemv_4bit",
    "gemv_4bit_reference",
    "gemv_config",
    "is_4bit",
    "launch_checked",
    "layout_reason",
    "layouts_agree",
    "require_bitsandbytes",
    "shape_4bit",
    "unpack",
    "words_row_sums",
]
