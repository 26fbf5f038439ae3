#!/usr/bin/env bash
# Run fastplug's GPU checks and benchmarks on a machine with no network, from the repo root.
#
#   scripts/gpu_run.sh [PART [ARGS...]] ...
#
# PARTs run in the order given (default: doctor tests micro e2e):
#   doctor                 python -m fastplug doctor
#   tests [PYTEST ARGS]    tests/gpu over every GPU of the machine (one pytest-xdist worker per GPU; the 2-GPU tests,
#                          marker gpu2, on the last two meanwhile), each test limited to $FASTPLUG_TEST_TIMEOUT s
#                          (240), each pytest run to $FASTPLUG_TESTS_BUDGET s (420). $OUT/tests_report.tsv gets each
#                          outcome as it comes; the part ends with the failures and the files that never reported
#   micro [ARGS]           python -m fastplug.bench micro ARGS
#   e2e [ARGS]             python -m fastplug.bench e2e ARGS   (e.g. e2e --models llama --impls transformers,fastplug)
#   maxseq [ARGS]          python -m fastplug.bench e2e --offload-max-seq ARGS
#   frameworks [ARGS]      python -m fastplug.bench frameworks ARGS   (TRL SFT, HF Trainer, Lightning, with and without fastplug)
#   varlen [ARGS]          python -m fastplug.bench varlen ARGS       (LoRA SFT on variable-length real text, as users train)
#   probe [ARGS]           python scripts/precision_probe.py ARGS      (loss bias and LoRA grad error vs an fp32 truth)
#   convergence [ARGS]     python scripts/convergence.py all ARGS      (120 real-text steps, e.g. lora:hf,lora:fastplug)
#   generate [ARGS]        python -m fastplug.bench generate ARGS      (fast_generate vs transformers' generate)
#   grpo [ARGS]            python -m fastplug.bench grpo ARGS          (a GRPO step: TRL, TRL + Liger, FastGRPOTrainer)
#   qlora [ARGS]           python -m fastplug.bench.qlora ARGS         (4-bit bases: kernels and e2e vs bitsandbytes)
#   moe [ARGS]             python scripts/moe_gpu.py ARGS              (grouped GEMM, MoE block, Mixtral rows)
#   attention [ARGS]       python scripts/attention_gpu.py ARGS        (flash kernel vs SDPA, Gemma2 rows)
#   fp8 [ARGS]             python scripts/fp8_gpu.py ARGS              (FP8 block-scaled GEMM and projections)
#   host [ARGS]            python scripts/host_overhead.py ARGS        (host µs per op call)
#   compile [ARGS]         python scripts/compile_gpu.py ARGS          (compiled vs eager losses, kernel by kernel)
#   gdn [ARGS]             python scripts/gated_delta_gpu.py ARGS      (Qwen3.5's Gated DeltaNet with and without fla)
# Arguments after a PART belong to it until the next PART name.
#
# Wheels the image lacks (trl, datasets, liger-kernel; scripts/fetch_gpu_wheels.sh downloads them here)
# are installed from .whl/ into /tmp/site when present. Outputs and each part's log go to $OUT (if set,
# else bench_out/). Exit status: the first failing part's, after all parts ran.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
PY="$(command -v python3)"

# FASTPLUG_GPU_INSTALLED=1: an earlier run on this machine installed everything below (several runs at once,
# ../shared/tools/gpuq jobs, must not install into the same folders together): this checkout and the wheels go on
# PYTHONPATH as they left them
if [[ -n "${FASTPLUG_GPU_INSTALLED:-}" ]]; then
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    [[ -d /tmp/site-fla ]] && export FASTPLUG_BENCH_FLA=/tmp/site-fla
else
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { echo "gpu_run: installing .whl/ failed"; exit 1; }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # flash-linear-attention (.whl/fla/, from scripts/fetch_gpu_wheels.sh) is unpacked apart, into /tmp/site-fla:
    # only the rows that ask for it see it (the e2e impls ending in _fla, scripts/gated_delta_gpu.py, tests/gpu),
    # so the plain transformers rows of Qwen3.5 run its torch delta rule
    if compgen -G ".whl/fla/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-fla \
            .whl/fla/*.whl || { echo "gpu_run: installing .whl/fla/ failed"; exit 1; }
        export FASTPLUG_BENCH_FLA=/tmp/site-fla
    fi
    # fastplug itself: installed from this checkout with --no-deps into the Python that already has torch,
    # triton and transformers (editable, so edits need no reinstall). Offline pip needs setuptools in that
    # Python to build; without it the checkout goes first on PYTHONPATH instead, which imports the same code.
    if "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . > "$OUT_DIR/install.log" 2>&1; then
        echo "gpu_run: fastplug installed from $PWD (pip --no-deps, editable)"
    else
        echo "gpu_run: pip could not build fastplug offline (see $OUT_DIR/install.log); using PYTHONPATH=$PWD"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

PARTS="doctor tests micro e2e maxseq frameworks varlen probe convergence generate grpo qlora moe attention fp8 host compile gdn"
is_part() { [[ " $PARTS " == *" $1 "* ]]; }

gpu_tests() {  # tests/gpu over the machine's GPUs; a summary even when a time limit cuts it
    local ids gpus report single pair pair_pid rc=0 r
    # the GPUs this process may use: $CUDA_VISIBLE_DEVICES when set, else every one nvidia-smi lists
    ids=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd,)}
    ids=${ids:-0}
    gpus=$(tr ',' '\n' <<< "$ids" | wc -l)
    report="$OUT_DIR/tests_report.tsv"
    : > "$report"
    # Every GPU takes single-GPU tests (one pytest-xdist worker each); the 2-GPU tests (marker gpu2: torchrun and
    # accelerate launches of small models) share the last two meanwhile (4 GPUs or more), or run after the rest on
    # the first two (2 or 3 GPUs). One GPU skips them.
    single=$ids pair=""
    if ((gpus >= 4)); then
        pair=$(cut -d, -f$((gpus - 1))- <<< "$ids")
    elif ((gpus >= 2)); then
        pair=$(cut -d, -f1-2 <<< "$ids")
    fi
    "$PY" -m pytest -q --collect-only -m "gpu$([[ -n $pair ]] && echo ' or gpu2' || echo ' and not gpu2')" \
        -p no:cacheprovider tests/gpu "$@" | grep '::' > "$OUT_DIR/tests_collected.txt"
    # idle workers steal queued tests (pytest-xdist >= 3.2), so one long test does not hold back a worker's queue
    dist=$("$PY" -c 'import xdist; print("worksteal" if tuple(map(int, xdist.__version__.split(".")[:2])) >= (3, 2) else "load")')
    run_single() {  # one pytest-xdist worker per GPU (a file's tests may spread)
        FASTPLUG_TEST_REPORT="$report" FASTPLUG_TEST_GPUS="$single" timeout -s INT -k 30 "${FASTPLUG_TESTS_BUDGET:-420}" \
            "$PY" -m pytest -q -m "gpu and not gpu2" -n "$(tr ',' '\n' <<< "$single" | wc -l)" --dist "$dist" \
            --timeout "${FASTPLUG_TEST_TIMEOUT:-240}" -p no:cacheprovider tests/gpu "$@"
    }
    run_pair() {
        FASTPLUG_TEST_REPORT="$report" CUDA_VISIBLE_DEVICES="$pair" timeout -s INT -k 30 "${FASTPLUG_TESTS_BUDGET:-420}" \
            "$PY" -m pytest -q -m gpu2 --timeout 400 -p no:cacheprovider tests/gpu "$@"
    }
    if ((gpus >= 4)); then
        run_pair "$@" > "$OUT_DIR/tests_gpu2.log" 2>&1 &
        pair_pid=$!
        run_single "$@" || rc=$?
        wait "$pair_pid" || { r=$?; ((rc)) || rc=$r; }
        echo "=== the 2-GPU tests (GPUs $pair):"; tail -5 "$OUT_DIR/tests_gpu2.log"
    else
        run_single "$@" || rc=$?
        if [[ -n $pair ]]; then run_pair "$@" || { r=$?; ((rc)) || rc=$r; }; fi
    fi
    "$PY" scripts/gpu_tests_summary.py "$OUT_DIR/tests_collected.txt" "$report" || { ((rc)) || rc=1; }
    return "$rc"
}

run_part() {  # run_part NAME ARGS...: runs it, tees its log into $OUT_DIR/NAME.log
    local name="$1"; shift
    local cmd
    case "$name" in
        doctor) cmd=("$PY" -m fastplug doctor "$@") ;;
        tests)  cmd=(gpu_tests "$@") ;;
        micro)  cmd=("$PY" -m fastplug.bench micro --out "$OUT_DIR" "$@") ;;
        e2e)    cmd=("$PY" -m fastplug.bench e2e --out "$OUT_DIR" "$@") ;;
        maxseq) cmd=("$PY" -m fastplug.bench e2e --offload-max-seq --out "$OUT_DIR" "$@") ;;
        frameworks) cmd=("$PY" -m fastplug.bench frameworks --out "$OUT_DIR" "$@") ;;
        varlen) cmd=("$PY" -m fastplug.bench varlen --out "$OUT_DIR" "$@") ;;
        probe)  cmd=("$PY" scripts/precision_probe.py "$@") ;;
        convergence) cmd=("$PY" scripts/convergence.py all "$@") ;;
        generate) cmd=("$PY" -m fastplug.bench generate "$@") ;;
        grpo)   cmd=("$PY" -m fastplug.bench grpo --out "$OUT_DIR" "$@") ;;
        qlora)  cmd=("$PY" -m fastplug.bench.qlora "$@") ;;
        moe)    cmd=("$PY" scripts/moe_gpu.py "$@") ;;
        attention) cmd=("$PY" scripts/attention_gpu.py "$@") ;;
        fp8)    cmd=("$PY" scripts/fp8_gpu.py "$@") ;;
        host)   cmd=("$PY" scripts/host_overhead.py "$@") ;;
        compile) cmd=("$PY" scripts/compile_gpu.py "$@") ;;
        gdn)    cmd=("$PY" scripts/gated_delta_gpu.py "$@") ;;
    esac
    echo "=== gpu_run: $name: ${cmd[*]}"
    local start=$SECONDS
    "${cmd[@]}" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== gpu_run: $name finished with exit code $rc in $((SECONDS - start)) s"
    return "$rc"
}

[[ $# -eq 0 ]] && set -- $PARTS
status=0
while [[ $# -gt 0 ]]; do
    name="$1"; shift
    is_part "$name" || { echo "gpu_run: unknown part '$name' (parts: $PARTS)"; exit 2; }
    args=()
    while [[ $# -gt 0 ]] && ! is_part "$1"; do args+=("$1"); shift; done
    run_part "$name" "${args[@]+"${args[@]}"}" || { rc=$?; [[ $status -eq 0 ]] && status=$rc; }
done
exit "$status"
