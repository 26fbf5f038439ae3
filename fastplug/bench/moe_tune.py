"""python -m fastplug.bench moe-tune: time every launch config of the MoE grouped GEMM kernels for one shape.

    python -m fastplug.bench moe-tune --n 1536 --k 2048 --experts 64 --rows 65536 [--kinds fwd,dw] [--out DIR]

Writes moe_tune.csv, moe_tune.md and moe_tune.png (matplotlib optional) under --out and prints the table,
fastest first. From Python, `moe_tune_dataframe(...)` returns the same rows as a pandas DataFrame.
"""

from __future__ import annotations

import argparse
import os

import torch

from ..kernels.moe import tuning
from ..kernels.moe.grouped_gemm import sweep as sweep_configs
from ._report import fmt, grouped_bar_plot, markdown_table, write_csv

COLUMNS = ["kind", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "smem_KiB", "ms", "TFLOPs", "skipped"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def moe_tune_rows(
    n: int, k: int, experts: int, rows: int, kinds=tuning.KINDS, dtype: str = "bf16", device: str = "cuda"
) -> list[dict]:
    """Every config of each kernel kind timed on this shape, fastest first within a kind."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}; got {dtype!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("moe-tune times Triton kernels on a CUDA device; none is available")
    out = []
    for kind in kinds:
        timed = sweep_configs(kind, n, k, experts, rows, _DTYPES[dtype], device)
        out += sorted(timed, key=lambda r: (r["ms"] is None, r["ms"] or 0.0))
    return out


def moe_tune_dataframe(
    n: int, k: int, experts: int, rows: int, kinds=tuning.KINDS, dtype: str = "bf16", device: str = "cuda"
):
    """`moe_tune_rows` as a pandas DataFrame (pandas is optional: ImportError says how to get it)."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError("moe_tune_dataframe needs pandas: pip install pandas (or use moe_tune_rows)") from exc
    return pd.DataFrame(moe_tune_rows(n, k, experts, rows, kinds, dtype, device))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastplug.bench moe-tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, default=1536, help="output width of the GEMM (expert width x2 for gate_up)")
    parser.add_argument("--k", type=int, default=2048, help="reduction width (hidden size)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=65536, help="routed rows (tokens x top-k)")
    parser.add_argument("--kinds", default="fwd,dw", help="comma list of: " + ", ".join(tuning.KINDS))
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in tuning.KINDS]
    if bad:
        parser.error(f"unknown kind(s) {', '.join(bad)}; choose from {', '.join(tuning.KINDS)}")
    rows = moe_tune_rows(args.n, args.k, args.experts, args.rows, kinds, args.dtype)
    shown = [{c: fmt(r[c]) for c in COLUMNS} for r in rows]
    table = markdown_table(shown, COLUMNS)
    title = (
        f"MoE grouped GEMM configs: N={args.n} K={args.k} experts={args.experts} rows={args.rows} {args.dtype}, "
        f"{torch.cuda.get_device_name()}"
    )
    print(f"{title}\n\n{table}")
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "moe_tune.csv"), rows, ["N", "K", "E", "M", "dtype"] + COLUMNS)
    with open(os.path.join(args.out, "moe_tune.md"), "w") as f:
        f.write(f"{title}\n\n{table}\n")
    timed = [r for r in rows if r["ms"] is not None]
    label = lambda r: f"{r['BLOCK_M']}x{r['BLOCK_N']}x{r['BLOCK_K']} w{r['num_warps']} s{r['num_stages']}"  # noqa: E731
    groups = sorted({label(r) for r in timed})
    panels = [("ms per launch (lower is better)", "ms", {(label(r), r["kind"]): r["ms"] for r in timed})]
    print(grouped_bar_plot(os.path.join(args.out, "moe_tune.png"), groups, kinds, panels))
    return 0
