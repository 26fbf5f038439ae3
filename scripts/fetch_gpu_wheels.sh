#!/usr/bin/env bash
# Download, on a machine with internet, the wheels the GPU image lacks, into .whl/ (git-ignored).
# scripts/gpu_run.sh installs them there with --no-index --no-deps into /tmp/site.
#
# The GPU image (Python 3.12, see .library/device/KINDS.md) already has torch, triton, transformers,
# peft, accelerate, lightning, matplotlib, pandas, pyarrow, xxhash, fsspec, huggingface_hub, aiohttp...
# It lacks trl, datasets (trl's trainers import it) with its two small deps dill and multiprocess,
# liger-kernel (a benchmark baseline only) and bitsandbytes (4-bit bases: tests/gpu/test_quant_gpu.py, bench qlora;
# its wheels are tagged manylinux_2_24). datasets 4.8.x needs pyarrow>=21 and huggingface_hub<2;
# 5.x would need pyarrow>=24, newer than we can be sure the image has, so 4.8 is pinned.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    "trl==1.16.0"
    "datasets==4.8.5"
    "dill==0.4.1"
    "multiprocess==0.70.19"
    "liger-kernel==0.8.5"
    "bitsandbytes==0.50.2"
)

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
# flash-linear-attention's kernels (pure Python + Triton) for the Qwen3.5 rows, kept apart in .whl/fla/: gpu_run.sh
# puts them only on the path of the runs that ask for them
mkdir -p .whl/fla
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl/fla "fla-core==0.6.0" "einops==0.8.2"
ls -l .whl .whl/fla
du -sh .whl
