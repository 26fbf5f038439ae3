"""The gated delta rule's scan kernels compiled for an H100 (sm_90) without a GPU: every launch the launchers make at
Qwen3.5's head size (128) and the largest supported (256), both precisions, fits sm_90's shared memory. The CPU
interpreter has no shared memory, so only a compile shows this (Triton's default three stages needed 385 KiB)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastplug.kernels.delta_rule import HOPPER_SHARED_MEMORY

REPO_ROOT = Path(__file__).resolve().parents[2]

COMPILE = """
import json, sys
sys.path.insert(0, "scripts")
from decode_ptx import stand_in_sm90_driver
stand_in_sm90_driver()
import torch
from triton.runtime.jit import JITFunction
from fastplug.kernels import delta_rule

run, found = JITFunction.run, []

def compile_only(self, *args, grid, warmup, **kwargs):
    kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
    found.append([self.fn.__name__, kwargs.get("PRECISION"), kernel.metadata.shared])
    return kernel

JITFunction.run = compile_only
for dk, precisions in ((128, ("tf32", "tf32x3")), (256, ("tf32",))):
    bh, chunks = 2, 2
    tokens = chunks * delta_rule.CHUNK
    parts = (torch.randn(bh, tokens, dk), torch.randn(bh, tokens, dk), torch.randn(bh, tokens, dk),
             torch.randn(bh, tokens, dk), torch.randn(bh, chunks, delta_rule.CHUNK, delta_rule.CHUNK),
             torch.rand(bh, chunks))
    for precision in precisions:
        delta_rule._scan(parts, True, precision)
        delta_rule._scan_backward(parts, torch.randn(bh, tokens, dk), None, precision)
print(json.dumps(found))
"""


def test_scan_kernels_fit_hopper_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env
    )
    if result.returncode and "ptxas" in result.stderr:
        pytest.skip(f"Triton cannot compile for sm_90 here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    launches = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(launches) == 9  # per head size and precision: output scan, states scan, reverse scan
    too_large = [launch for launch in launches if launch[2] > HOPPER_SHARED_MEMORY]
    assert not too_large, f"over sm_90's {HOPPER_SHARED_MEMORY} bytes of shared memory: {too_large}"
