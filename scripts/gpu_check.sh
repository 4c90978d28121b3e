#!/usr/bin/env bash
# Everything the GPU path needs from a GPU machine, in one command that fits one 10-minute call:
#   0. with GPU_CHECK_PREBUILT=DIR: the kernels built on another machine (DIR/*.so, e.g. the CPU build
#      machine's abi3 build against a newer torch) loaded under this machine's torch, and the CUDA
#      kernel tests run with them -- the "one build for every supported torch" check,
#   1. build drmoo_kernels._C (stable ABI) and _C_cuda in place with the CUDA kernels (sm_80, sm_90 + PTX; needs nvcc),
#   2. the kernel, optimizer and reliability tests on the GPU (cuda + compiled Triton backends,
#      capturable steps, CUDA-graph capture/replay of the optimizer step and of a whole training step),
#   3. scripts/gpu_bandwidth.py: gram_step's fraction of peak bandwidth, dual-op latency,
#   4. the kernel benchmarks: bench/results/gpu-<name>.{json,md} (python bench/run.py; the CPU-only
#      many-tasks step benchmark is left out, step 5 measures it on the GPU),
#   5. the many-tasks table on the GPU (ResNet18, batch 256, m = 2, 8, 40; plain, both Jacobians, every
#      method's features mode, TorchJD when installed): bench/results/tasks-scaling-gpu-<device>.*,
#   6. bench-iter: every method's seconds per iteration vs the common and its own algorithmic floor
#      (ResNet18, 128 px, batch 256 and 32): results/wallclock/gpu-<device>-b<batch>.*,
#   7. a CUDA train -> resume -> eval round trip through the checkpoint format,
#   8. drmoo train --cuda-graph: 5 steps (3 eager warm-up, a capture, a replay), resumed to 6.
# Logs and results are packed into $OUT/gpu_check.tar.gz (plus the summary log) when $OUT is set
# (the device runner's output folder, which returns at most 8 files).
#
# Uses .venv when it exists (scripts/setup_env.sh), else $PYTHON or python3 with torch already
# installed (a GPU machine without network access cannot run the pinned install).
#
#   bash scripts/gpu_check.sh              # every step (the tests capped at 280 s: not all of them run)
#   bash scripts/gpu_check.sh tests        # steps 0-2 only: the whole budget for the tests
#   bash scripts/gpu_check.sh bench        # steps 0-1, 3-7 only
# Each step gets what is left of GPU_CHECK_BUDGET_S (default 540 s) and at most its own cap, so a
# slow step cannot eat the whole call; a step cut short counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench]" >&2; exit 2 ;; esac

python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && python=.venv/bin/python
"$python" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device here; this script is for a GPU machine")
print(f"[gpu_check] {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

logs="bench/results/logs"
mkdir -p "$logs"
start=$(date +%s)
deadline=$(( start + ${GPU_CHECK_BUDGET_S:-540} ))
status=0
summary="$logs/summary.txt"
: > "$summary"

# step NAME CAP_SECONDS COMMAND...: runs COMMAND with min(CAP, time left) and records the outcome.
step() {
    local name=$1 cap=$2; shift 2
    local left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 10 ]; then
        echo "[gpu_check] $name: skipped, no time left" | tee -a "$summary"; status=1; return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    local t0 rc
    t0=$(date +%s)
    set +e
    timeout "$cap" "$@" > "$logs/$name.log" 2>&1
    rc=$?
    set -e
    tail -15 "$logs/$name.log"
    echo "[gpu_check] $name: exit $rc in $(( $(date +%s) - t0 ))s (cap ${cap}s)" | tee -a "$summary"
    [ "$rc" -eq 0 ] || status=1
}

export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}"
parallel=()  # pytest-xdist spreads the tests over the machine's cores when it is there
"$python" -c "import xdist" 2>/dev/null && parallel=(-n 16)
"$python" -c "import pytest_timeout" 2>/dev/null && parallel+=(--timeout 180)  # a hung test fails alone
if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
    # Step 0.  The copies are removed again, whatever happens, so that step 1 builds from the sources
    # (build_ext --inplace would take the newer copies for an up-to-date build and skip it).
    prebuilt=()
    for so in "$GPU_CHECK_PREBUILT"/*.so; do
        [ -e "$so" ] || continue
        cp "$so" drmoo_kernels/ && prebuilt+=("drmoo_kernels/$(basename "$so")")
    done
    if [ "${#prebuilt[@]}" -eq 0 ]; then
        echo "[gpu_check] prebuilt: no .so in $GPU_CHECK_PREBUILT" | tee -a "$summary"; status=1
    else
        step prebuilt 90 bash -c '"$1" -c "import drmoo_kernels as k, torch; b = k.available_backends(); \
print(\"[prebuilt] torch\", torch.__version__, \"backends:\", \", \".join(b)); assert \"cuda\" in b and \"cpp\" in b" && \
            "$1" -m pytest -q -p no:cacheprovider "${@:2}" tests/kernels/test_extension_load.py \
            tests/kernels/test_cuda_shapes.py' prebuilt "$python" "${parallel[@]}"
    fi
    rm -f "${prebuilt[@]}"
fi

echo "[gpu_check] building the extension in place (MAX_JOBS=${MAX_JOBS:-16})"
# Both kernel sets, and a compile error fails (setup.py's defaults would skip CUDA without a visible
# GPU and turn a compile error into a one-line skip).
DRMOO_BUILD_KERNELS=1 DRMOO_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$python" setup.py build_ext --inplace \
    > "$logs/build.log" 2>&1 \
    || { tail -40 "$logs/build.log"; exit 1; }
"$python" -c 'import drmoo_kernels as k; print("[gpu_check] backends:", ", ".join(k.available_backends()))' \
    | tee "$logs/backends.txt" | tee -a "$summary"
echo "[gpu_check] built in $(( $(date +%s) - start ))s" | tee -a "$summary"

if [ "$what" != bench ]; then
    # cvxpy (a dev requirement, checked against Nash-MTL's weights on the CPU) is not on GPU images.
    skip=()
    "$python" -c "import cvxpy" 2>/dev/null \
        || skip=(--deselect tests/optim/test_baselines.py::test_nash_weights_match_cvxpy)
    # The files that exercise the GPU first (pytest-xdist hands tests out in this order), so that a step cut
    # at its cap has run them; then the rest of the suites (a path given twice is collected once).  Every
    # failure is written to failures.txt with its traceback the moment it happens (pytest prints tracebacks
    # only at the end, which a cut-off step never reaches), and the 30 slowest tests are listed.
    gpu_first=(tests/kernels/test_cuda_shapes.py tests/kernels/test_compiled_ops.py tests/kernels/test_determinism.py
        tests/kernels/test_gpu_codegen.py tests/kernels/test_extension_load.py tests/kernels/test_triton_launches.py
        tests/kernels/test_triton_ops.py tests/optim/test_capturable.py tests/optim/test_cuda_graph.py
        tests/optim/test_min_norm_exact.py tests/optim/test_features_jacobian.py tests/reliability/test_ops_checks.py)
    : > "$logs/failures.txt"
    # In a full call the tests get 280 s: on an H200's 16 cores (2026-11-27) that ran 1,944 of the ~2,300
    # tests.  `gpu_check.sh tests` alone gives them what the build leaves of the budget (one whole call).
    tests_cap=280
    [ "$what" = tests ] && tests_cap=$(( ${GPU_CHECK_BUDGET_S:-540} - 60 ))
    step tests "$tests_cap" env PYTHONPATH="scripts:$PYTHONPATH" DRMOO_LIVE_FAILURES="$logs/failures.txt" \
        "$python" -m pytest -q -p no:cacheprovider -p pytest_live_failures -ra --durations=30 \
        "${parallel[@]}" "${skip[@]}" "${gpu_first[@]}" \
        tests/kernels tests/optim tests/reliability tests/test_objective.py --junitxml="$logs/gpu-tests.xml"
    grep "^==== FAILED" "$logs/failures.txt" | sort -u | tee -a "$summary" || true
fi
if [ "$what" != tests ]; then
    step bandwidth 90 "$python" scripts/gpu_bandwidth.py --out "$logs"
    step bench 120 env DRMOO_BENCH_BUDGET_S="${DRMOO_BENCH_BUDGET_S:-0.1}" "$python" bench/run.py -k "not tasks_step"
    jd_variants=()
    "$python" -c "import torchjd" 2>/dev/null && jd_variants=(torchjd-mgda torchjd-upgrad)
    step tasks_scaling 120 "$python" bench/tasks_scaling.py --device cuda --batch 256 --tasks 2 8 40 --rounds 20 \
        --variants plain parameters parameters-batched features features-double-clip features-famo features-nashmtl features-modo \
        features-sdmgrad features-double-loop "${jd_variants[@]}"
    # Paths reach the inner shell as its arguments ("$1"), never spliced into its text: a PYTHON or
    # TMPDIR with a space (or a quote) in it stays one word.
    step bench_iter 150 bash -c '"$1" -m drmoo bench-iter --experiment multimnist2 --methods all \
        --batch-size 256 --repeats 20 --warmup 3 --out results/wallclock --quiet && \
        "$1" -m drmoo bench-iter --experiment multimnist2 --methods double-clip,mgda,nashmtl \
        --batch-size 32 --repeats 20 --warmup 3 --out results/wallclock --quiet' bench_iter "$python"
fi
if [ "$what" = all ]; then
    round_trip=$(mktemp -d)
    step cuda_round_trip 60 bash -c 'set -e; "$1" -m drmoo train --experiment multimnist2 --method double-clip \
        --preset quick --device cuda --max-steps 2 --out "$2/run" --quiet; \
        "$1" -m drmoo train --resume "$2/run" --max-steps 4 --quiet; \
        "$1" -m drmoo eval --run "$2/run" --eps 0,0.03 --quiet; cat "$2/run/eval.json"' \
        cuda_round_trip "$python" "$round_trip"
    step cuda_graph_train 60 bash -c 'set -e; "$1" -m drmoo train --experiment multimnist2 --method double-clip \
        --preset quick --device cuda --cuda-graph --max-steps 5 --out "$2/graph" --quiet; \
        "$1" -m drmoo train --resume "$2/graph" --max-steps 6 --quiet; tail -3 "$2/graph/steps.csv"' \
        cuda_graph_train "$python" "$round_trip"
fi

echo "[gpu_check] done in $(( $(date +%s) - start ))s, exit status $status" | tee -a "$summary"
if [ -n "${OUT:-}" ]; then
    packed=(bench/results)
    [ -d results/wallclock ] && packed+=(results/wallclock)  # absent when bench-iter did not run
    tar czf "$OUT/gpu_check.tar.gz" "${packed[@]}"
    cp "$summary" "$OUT/"
fi
exit "$status"
