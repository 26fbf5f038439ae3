"""A new batch length compiles no kernel: a LoRA training step of a patched Llama (or Qwen3-MoE) at one length
compiles the kernels for an H100 (sm_90, without a GPU), and steps at other lengths (odd ones, multiples of 8 but
not of 16, padded rows) compile nothing more. Triton specialises an integer argument on its divisibility by 16
unless told not to, so without `do_not_specialize` on the token counts a length of another residue compiled every
kernel again, about a second each on a GPU host, at the first batches of each kind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

STEPS = """
import json, sys
sys.path.insert(0, "scripts")
from host_step_without_gpu import _count_compiles, _stand_in_h100
_stand_in_h100()
import torch
from peft import LoraConfig, get_peft_model
import fastplug
import fastplug.kernels
from decode_ptx import kernels_take_cpu_tensors
from tests.models.tiny import tiny_model

kernels_take_cpu_tensors()
torch.manual_seed(0)
model = get_peft_model(tiny_model(sys.argv[1]), LoraConfig(r=8, target_modules="all-linear"))
fastplug.patch_model(model, self_check=False)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
vocab = model.config.vocab_size

def step(length, pads):
    ids = torch.randint(0, vocab, (2, length))
    mask, labels = torch.ones_like(ids), ids.clone()
    mask[1, length - pads :], labels[1, length - pads :] = 0, -100
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

step(1088, 40)  # compiles every kernel of the step
compiles = _count_compiles()
compiled = {}
for length, pads in ((1089, 7), (1096, 300), (1103, 1), (1500, 499), (2047, 1000)):
    before = len(compiles)
    step(length, pads)
    compiled[length] = compiles[before:]  # the kernels compiled again, by name
print(json.dumps(compiled))
"""


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_new_batch_lengths_compile_nothing(family):
    # the MoE autotuner would time candidates, which a stand-in driver cannot run: each launch takes its default
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"FASTPLUG_MOE_AUTOTUNE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", STEPS, family], capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=env
    )
    if result.returncode and "ptxas" in result.stderr:
        pytest.skip(f"Triton cannot compile for sm_90 here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert not any(compiled.values()), f"kernels compiled again for a new length: {compiled}"
