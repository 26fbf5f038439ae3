#!/usr/bin/env bash
# Multi-GPU checks and benchmark (issue 17) on one host with 2+ GPUs and no network, from the repo root:
#
#   scripts/multi_gpu.sh [PART [ARGS...]] ...
#
# PARTs run in the order given (default: tests bench):
#   tests [PYTEST ARGS]   pytest -m gpu2 tests/gpu/test_distributed_gpu.py: DDP and FSDP2 through torch, the HF
#                         Trainer (accelerate launch and torchrun), FastSFTTrainer and Lightning, against one
#                         process (4 launches; cut at 230 s)
#   bench [ARGS]          python -m fastplug.bench multi --nproc 2 ARGS: transformers vs fastplug on 1 GPU, DDP
#                         and FSDP2; tokens/s and peak memory per GPU (3 launches sharing the time left)
# Everything stays within $MULTI_GPU_BUDGET seconds (default 525: under 9 minutes with the set-up).
# Outputs and each part's log go to $OUT (if set, else bench_out/). The last lines are a summary of the parts
# and the benchmark's markdown table. Exit status: the first failing part's, after all parts ran.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these machines; every other NCCL setting is the default
OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
PY="$(command -v python3)"
START=$SECONDS
BUDGET="${MULTI_GPU_BUDGET:-525}"  # seconds for everything: the machine's run must stay under 9 minutes

# trl, datasets (FastSFTTrainer) are not on the GPU image: wheels from .whl/ (scripts/fetch_gpu_wheels.sh).
# The checkout goes first on PYTHONPATH; the torchrun workers inherit both.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT_DIR/multi_install.log" 2>&1 || echo "multi_gpu: installing .whl/ failed (see $OUT_DIR/multi_install.log)"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$PY" - <<'EOF'
import torch
n = torch.cuda.device_count()
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
print(f"multi_gpu: torch {torch.__version__}, {n} GPU(s): {names}")
for name in ("transformers", "accelerate", "peft", "lightning", "trl", "triton"):
    try:
        print(f"  {name} {__import__(name).__version__}")
    except ImportError:
        print(f"  {name}: not installed")
EOF

PARTS="tests bench"
is_part() { [[ " $PARTS " == *" $1 "* ]]; }
SUMMARY=()
BENCH_RAN=0
TESTS_RAN=0

run_part() {  # run_part NAME ARGS...: runs it under a time limit, tees its log into $OUT_DIR/multi_NAME.log
    local name="$1"; shift
    local cmd limit
    local left=$((BUDGET - (SECONDS - START)))
    case "$name" in
        tests) limit=$(( left - 200 < 230 ? left - 200 : 230 ))  # leaves the bench at least 200 s
               cmd=("$PY" -m pytest -v -m gpu2 tests/gpu/test_distributed_gpu.py -p no:cacheprovider -rfEP "$@") ;;
        bench) limit=$((left - 5))  # what the tests left, shared by its 3 launches
               cmd=("$PY" -m fastplug.bench multi --nproc 2 --time-limit $(( (limit - 15) / 3 )) --out "$OUT_DIR" "$@") ;;
    esac
    if (( limit < 30 )); then
        echo "=== multi_gpu: $name skipped: ${left} s of the ${BUDGET} s budget left"
        SUMMARY+=("$name: skipped, out of time")
        return 1
    fi
    echo "=== multi_gpu: $name: ${cmd[*]}"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$OUT_DIR/multi_$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    echo "=== multi_gpu: $name finished with exit code $rc in $took s"
    case "$name" in
        tests) TESTS_RAN=1
               SUMMARY+=("tests: exit $rc, ${took} s: $(grep -E ' in [0-9.]+s' "$OUT_DIR/multi_tests.log" | tail -1)")
               SUMMARY+=("$(grep -E '^rank 0 .*FSDP units' "$OUT_DIR/multi_tests.log" | sort -u)") ;;
        bench) BENCH_RAN=1
               SUMMARY+=("bench: exit $rc, ${took} s")
               SUMMARY+=("$(sed -n '/^targets (issue 17):/,/^$/p' "$OUT_DIR/multi_bench.log")") ;;
    esac
    return "$rc"
}

[[ $# -eq 0 ]] && set -- $PARTS
status=0
while [[ $# -gt 0 ]]; do
    name="$1"; shift
    is_part "$name" || { echo "multi_gpu: unknown part '$name' (parts: $PARTS)"; exit 2; }
    args=()
    while [[ $# -gt 0 ]] && ! is_part "$1"; do args+=("$1"); shift; done
    run_part "$name" "${args[@]+"${args[@]}"}" || { rc=$?; [[ $status -eq 0 ]] && status=$rc; }
done

echo
echo "=== multi_gpu summary ($((SECONDS - START)) s in all; logs in $OUT_DIR/multi_*.log)"
# one line per test, written as each finishes (so a run cut by the time limit still says what passed)
[[ $TESTS_RAN -eq 1 ]] && grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT_DIR/multi_tests.log" \
    | sed -E 's/^tests\/gpu\/test_distributed_gpu.py::/  /; s/ +\[ *[0-9]+%\]$//' | cut -c1-200
printf '%s\n' "${SUMMARY[@]}"
if [[ $BENCH_RAN -eq 1 ]]; then
    echo
    sed -n '/^| model /,$p' "$OUT_DIR/multi_bench.log"
fi
exit "$status"
