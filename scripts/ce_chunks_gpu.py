"""The fused linear+CE with a trained LM head at several logits-chunk budgets (and row programs per SM), on
a CUDA GPU: time (CUDA-graph replays, as the micro bench's graph timing), peak MiB above the inputs, and
the per-kernel split of the default. What README's trained-head CE paragraph quotes.

    python3 scripts/ce_chunks_gpu.py [--rows 8192 --hidden 4096 --vocab 128256] [--chunks-mib 256 384 512]

torch.compile's figure for the same op: `python -m fastplug.bench micro --ops cross_entropy_head_grad`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fastplug.bench.micro import _graph_ms, kernel_table, peak_mib  # noqa: E402

ce = importlib.import_module("fastplug.kernels.cross_entropy")  # the package's `cross_entropy` is the function


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks-mib", type=int, nargs="+", default=[256, 384, 512])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[ce.ROW_PROGRAMS_PER_SM])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    hidden = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * args.hidden**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    leaves = [hidden, weight]

    def step():
        ce.fused_linear_cross_entropy(hidden, weight, labels).backward()

    defaults = ce.LOGITS_CHUNK_BYTES, ce.ROW_PROGRAMS_PER_SM
    rows = []
    for chunk_mib in args.chunks_mib:
        for programs in args.programs_per_sm:
            ce.LOGITS_CHUNK_BYTES, ce.ROW_PROGRAMS_PER_SM = chunk_mib * 2**20, programs
            rows.append((chunk_mib, programs, _graph_ms(step, leaves, 50, 400), peak_mib(step, leaves, device)))
            print(
                f"chunk {chunk_mib} MiB, {programs} row programs/SM: {rows[-1][2]:.2f} ms, {rows[-1][3]:.0f} MiB",
                flush=True,
            )
    ce.LOGITS_CHUNK_BYTES, ce.ROW_PROGRAMS_PER_SM = defaults
    print(f"\nkernels per step at the defaults ({defaults[0] >> 20} MiB, {defaults[1]} per SM):")
    print(kernel_table(step, leaves, steps=2, top=8))
    print("\n| logits chunk | row programs per SM | ms (graph) | peak MiB above inputs |\n|---|---|---|---|")
    for chunk_mib, programs, ms, mib in rows:
        print(f"| {chunk_mib} MiB | {programs} | {ms:.2f} | {mib:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
