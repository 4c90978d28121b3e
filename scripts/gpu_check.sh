#!/usr/bin/env bash
# Everything the GPU path needs from a GPU machine, in one command that fits one ~9-minute call.
#
# Stages, in priority order; each gets at most its own cap and never more than what the budget
# (GPU_CHECK_BUDGET_S, default 540 s) leaves after the caps reserved for the required stages after it,
# so that a slow stage cannot starve a later one:
#   build            drmoo_kernels._C (stable ABI) and _C_cuda in place with the CUDA kernels (needs nvcc);
#                    with GPU_CHECK_PREBUILT=DIR first the kernels built elsewhere (DIR/*.so) loaded and
#                    their CUDA tests run (stage "prebuilt"),
#   tests            the kernel, optimizer and reliability tests, the GPU-exercising files first; every
#                    failure is named in the summary (written as it happens: a cut-off run keeps them),
#   launches         bench/launches.py --device cuda: ops and host syncs per step, with torch's own
#                    set_sync_debug_mode count beside (ResNet18, MGDA and Double-Clip, both head layouts),
#   tasks_scaling    bench/tasks_scaling.py --device cuda --all-cells, batch 256, m = 2, 8, 40, 100, both head
#                    layouts: plain, rep-grad, parameters (auto, loop, batched), features (MGDA, Double-Clip),
#                    TorchJD when installed; eager steps interleaved with plain ones,
#   tasks_graph      the same cells with --cuda-graph: each step eager, its host-issue time and one replay
#                    of the step captured as a CUDA graph,
#   train_graph      drmoo train --cuda-graph timed against eager drmoo train (scripts/gpu_step_timing.py),
#                    and a graphed run resumed,
#   kernels_device   scripts/gpu_bandwidth.py: the kernels' device time alone (CUDA events; one CUDA graph
#                    replay of 20 calls) beside their synchronised wall-clock time,
# then, with what is left: bench (the kernel benchmarks, bench/run.py), bench_iter (every method's
# seconds per iteration), cuda_round_trip (train -> resume -> eval through the checkpoint format).
#
# Every stage's outcome -- ran (exit 0) / failed (its exit status, or cut at its cap) / skipped (why) --
# is one line of $logs/summary.txt ("stage NAME: OUTCOME (...)"), plus the failing tests' names.
# Logs and results are packed into $OUT/gpu_check.tar.gz (plus the summary) when $OUT is set.
#
#   bash scripts/gpu_check.sh              # every stage
#   bash scripts/gpu_check.sh tests        # build and tests only: the whole budget for the tests
#   bash scripts/gpu_check.sh bench        # every stage but the tests
#   DRMOO_GPU_CHECK_DRY=1 bash scripts/gpu_check.sh
#       the dry run on a CPU (tests/reliability/test_gpu_check_dry.py runs it): every stage at tiny sizes
#       with its device-specific part stubbed by a CPU equivalent, named in the summary ("dry: ..."), so
#       that a stage which would crash or silently skip on the GPU fails here first.  Logs and results go
#       to GPU_CHECK_LOGS (default bench/results/logs; the dry run's results under it, never bench/results).
#
# Uses .venv when it exists (scripts/setup_env.sh), else $PYTHON or python3 with torch already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench]" >&2; exit 2 ;; esac
dry=0
[ "${DRMOO_GPU_CHECK_DRY:-0}" = 1 ] && dry=1

python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && python=.venv/bin/python
logs="${GPU_CHECK_LOGS:-bench/results/logs}"
mkdir -p "$logs"
results=bench/results
[ "$dry" = 1 ] && results="$logs/results" && mkdir -p "$results"
summary="$logs/summary.txt"
: > "$summary"
start=$(date +%s)
deadline=$(( start + ${GPU_CHECK_BUDGET_S:-540} ))
status=0
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}"

# note STAGE OUTCOME: one line of the summary.
note() { echo "stage $1: $2" | tee -a "$summary"; }

# step NAME CAP RESERVE COMMAND...: runs COMMAND for at most min(CAP, time left - RESERVE) seconds, RESERVE
# being the caps of the required stages after it, and records the outcome.
step() {
    local name=$1 cap=$2 reserve=$3; shift 3
    # The dry run's CPU is no GPU (and may be shared): its stages get 4 times their caps.
    [ "$dry" = 1 ] && cap=$(( cap * 4 ))
    local left=$(( deadline - $(date +%s) - reserve ))
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$cap" -lt 10 ]; then
        note "$name" "skipped (no time left in the budget)"; status=1; return
    fi
    local t0 rc
    t0=$(date +%s)
    set +e
    timeout "$cap" "$@" > "$logs/$name.log" 2>&1
    rc=$?
    set -e
    tail -15 "$logs/$name.log"
    local took=$(( $(date +%s) - t0 )) how=""
    [ "$dry" = 1 ] && how="; ${dry_stub[$name]:-dry: the GPU command at tiny sizes on the CPU}"
    if [ "$rc" -eq 0 ]; then
        note "$name" "ran (exit 0 in ${took}s of its ${cap}s$how)"
    elif [ "$rc" -eq 124 ]; then
        note "$name" "failed (cut at its ${cap}s cap$how)"; status=1
    else
        note "$name" "failed (exit $rc in ${took}s$how)"; status=1
    fi
}

# What the dry run puts in place of each stage's device-specific part (written into the summary).
declare -A dry_stub=(
    [build]="dry: no build (the installed extension is used)"
    [tests]="dry: GPU_CHECK_TESTS (default tests/optim/test_cuda_graph.py, skipped without CUDA) on the CPU"
    [launches]="dry: --device cpu, small trunk, m = 2 (no set_sync_debug_mode count without CUDA)"
    [tasks_scaling]="dry: --device cpu, a two-layer trunk, batch 2, m = 2, no memory probe"
    [tasks_graph]="dry: --graph-stand-in, each capture replaced by the eager step"
    [train_graph]="dry: --stand-in on the CPU, LeNet, batch 8: both runs eager"
    [kernels_device]="dry: compiled only (CUDA events and graph replays have no CPU equivalent)"
    [bench]="dry: argument parsing only (the kernel benchmarks time the device)"
    [bench_iter]="dry: --device cpu, LeNet, batch 8, MGDA, 1 repeat"
    [cuda_round_trip]="dry: --device cpu, LeNet, batch 8"
)

if [ "$dry" = 1 ]; then
    # One OpenMP thread: on a CPU shared with other jobs, torch's idle threads spin-wait and burn CPU time
    # (the train_graph stage took twice the CPU time with two threads); the code paths are the same.
    export OMP_NUM_THREADS=1
    echo "[gpu_check] DRY RUN on the CPU: every stage at tiny sizes, device-specific parts stubbed (see the summary)" \
        | tee -a "$summary"
else
    "$python" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device here; this script is for a GPU machine "
             "(DRMOO_GPU_CHECK_DRY=1 walks its stages on a CPU)")
print(f"[gpu_check] {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
fi

# The caps of the required stages (each one's RESERVE is the sum of those after it).
cap_tests=150 cap_launches=50 cap_tasks=110 cap_graph=70 cap_train=50 cap_kernels=40
if [ "$what" = tests ]; then
    cap_launches=0 cap_tasks=0 cap_graph=0 cap_train=0 cap_kernels=0
    cap_tests=$(( ${GPU_CHECK_BUDGET_S:-540} - 60 ))
fi
[ "$what" = bench ] && cap_tests=0
reserve_kernels=0
reserve_train=$cap_kernels
reserve_graph=$(( reserve_train + cap_train ))
reserve_tasks=$(( reserve_graph + cap_graph ))
reserve_launches=$(( reserve_tasks + cap_tasks ))
reserve_tests=$(( reserve_launches + cap_launches ))
reserve_build=$(( reserve_tests + cap_tests ))

# The optional modules the stages adapt to, each probed by importing it, all in one interpreter (torchjd
# imports cvxpy and torch: separate probes paid those imports again, seconds each).
probe=(cvxpy torchjd)
[ "$dry" = 0 ] && probe+=(xdist pytest_timeout)
importable=" $("$python" - "${probe[@]}" 2>/dev/null <<'EOF' || true  # no interpreter: none of them
import importlib
import sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:  # whatever stops the import: the stage goes without the module
        continue
    print(name, end=" ")
EOF
) "
has() { [[ "$importable" == *" $1 "* ]]; }

parallel=()  # pytest-xdist spreads the tests over the machine's cores when it is there
if [ "$dry" = 0 ]; then
    has xdist && parallel=(-n 16)
    has pytest_timeout && parallel+=(--timeout 180)  # a hung test fails alone
fi

# ------------------------------------------------------------------------------------------------ build
if [ -n "${GPU_CHECK_PREBUILT:-}" ] && [ "$dry" = 0 ]; then
    # The copies are removed again, whatever happens, so that the build compiles from the sources
    # (build_ext --inplace would take the newer copies for an up-to-date build and skip it).
    prebuilt=()
    for so in "$GPU_CHECK_PREBUILT"/*.so; do
        [ -e "$so" ] || continue
        cp "$so" drmoo_kernels/ && prebuilt+=("drmoo_kernels/$(basename "$so")")
    done
    if [ "${#prebuilt[@]}" -eq 0 ]; then
        note prebuilt "failed (no .so in $GPU_CHECK_PREBUILT)"; status=1
    else
        step prebuilt 90 "$reserve_build" bash -c '"$1" -c "import drmoo_kernels as k, torch; \
b = k.available_backends(); print(\"[prebuilt] torch\", torch.__version__, \"backends:\", \", \".join(b)); \
assert \"cuda\" in b and \"cpp\" in b" && "$1" -m pytest -q -p no:cacheprovider "${@:2}" \
            tests/kernels/test_extension_load.py tests/kernels/test_cuda_shapes.py' prebuilt "$python" "${parallel[@]}"
    fi
    rm -f "${prebuilt[@]}"
fi
list_backends='import drmoo_kernels as k; print("[gpu_check] backends:", ", ".join(k.available_backends()))'
if [ "$dry" = 1 ]; then
    step build 60 "$reserve_build" true
else
    # Both kernel sets, and a compile error fails (setup.py's defaults would skip CUDA without a visible
    # GPU and turn a compile error into a one-line skip).
    step build 150 "$reserve_build" bash -c 'DRMOO_BUILD_KERNELS=1 DRMOO_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" \
        "$1" setup.py build_ext --inplace && "$1" -c "$2"' build "$python" "$list_backends"
fi
grep "backends:" "$logs/build.log" >> "$summary" || true

# ------------------------------------------------------------------------------------------------ tests
if [ "$what" != bench ]; then
    # cvxpy (a dev requirement, checked against Nash-MTL's weights on the CPU) is not on GPU images.
    skip=()
    has cvxpy || skip=(--deselect tests/optim/test_baselines.py::test_nash_weights_match_cvxpy)
    # The files that exercise the GPU first (pytest-xdist hands tests out in this order), so that a stage
    # cut at its cap has run them; then the rest of the suites (a path given twice is collected once).
    # Every failure is written to failures.txt with its traceback the moment it happens.
    if [ -n "${GPU_CHECK_TESTS:-}" ]; then
        read -r -a selected <<< "$GPU_CHECK_TESTS"
    elif [ "$dry" = 1 ]; then
        selected=(tests/optim/test_cuda_graph.py)
    else
        selected=(tests/kernels/test_cuda_shapes.py tests/kernels/test_compiled_ops.py tests/kernels/test_conj_precision.py
            tests/kernels/test_determinism.py tests/kernels/test_gpu_codegen.py tests/kernels/test_extension_load.py
            tests/kernels/test_triton_launches.py
            tests/kernels/test_triton_ops.py tests/optim/test_capturable.py tests/optim/test_cuda_graph.py
            tests/optim/test_min_norm_exact.py tests/optim/test_features_jacobian.py tests/reliability/test_ops_checks.py
            tests/kernels tests/optim tests/reliability tests/test_objective.py)
    fi
    : > "$logs/failures.txt"
    step tests "$cap_tests" "$reserve_tests" env PYTHONPATH="scripts:$PYTHONPATH" \
        DRMOO_LIVE_FAILURES="$logs/failures.txt" "$python" -m pytest -q -p no:cacheprovider -p pytest_live_failures \
        -ra --durations=30 "${parallel[@]}" "${skip[@]}" "${selected[@]}" --junitxml="$logs/gpu-tests.xml"
    { grep "^==== FAILED" "$logs/failures.txt" || true; } | sort -u | sed 's/^==== FAILED/  test failed:/' \
        | tee -a "$summary"
fi

if [ "$what" != tests ]; then
    # --------------------------------------------------------------------------------------- launches
    if [ "$dry" = 1 ]; then
        launches=(--device cpu --trunks small --tasks 2 --methods mgda --apis balancer --strategies auto)
    else
        launches=(--device cuda --trunks resnet18 --methods mgda double-clip --apis balancer)
    fi
    step launches "$cap_launches" "$reserve_launches" "$python" bench/launches.py "${launches[@]}" \
        --out "$results/launches-cuda"

    # ---------------------------------------------------------------------------------- tasks scaling
    scaling_variants=(plain rep-grad parameters parameters-loop parameters-batched features features-double-clip)
    if has torchjd; then
        scaling_variants+=(torchjd-mgda torchjd-upgrad)
    else
        note torchjd "skipped in tasks_scaling and tasks_graph (TorchJD is not installed)"
    fi
    if [ "$dry" = 1 ]; then
        scaling=(--device cpu --trunks tiny --batch 2 --tasks 2 --rounds 1 --no-memory)
        graph=(--cuda-graph --graph-stand-in)
    else
        scaling=(--device cuda --trunks groupnorm --batch 256 --tasks 2 8 40 100 --rounds 5)
        graph=(--cuda-graph)
    fi
    step tasks_scaling "$cap_tasks" "$reserve_tasks" "$python" bench/tasks_scaling.py "${scaling[@]}" --all-cells \
        --heads separate shared --variants "${scaling_variants[@]}" --out "$results/tasks-scaling-gpu"
    step tasks_graph "$cap_graph" "$reserve_graph" "$python" bench/tasks_scaling.py "${scaling[@]}" --all-cells \
        --heads separate shared --variants "${scaling_variants[@]}" "${graph[@]}" --out "$results/tasks-scaling-gpu-graph"

    # ------------------------------------------------------------------------------------ train graph
    train_dir=$(mktemp -d)
    if [ "$dry" = 1 ]; then
        step train_graph "$cap_train" "$reserve_train" "$python" scripts/gpu_step_timing.py --out "$train_dir" \
            --steps 6 --device cpu --stand-in -- --model lenet --input-size 28 --batch-size 8 --train-size 64 \
            --test-size 16
    else
        step train_graph "$cap_train" "$reserve_train" "$python" scripts/gpu_step_timing.py --out "$train_dir" \
            --steps 20 --device cuda
    fi
    cp "$train_dir"/train-graph.* "$results/" 2>/dev/null || true

    # --------------------------------------------------------------------------------- kernels, device
    if [ "$dry" = 1 ]; then
        step kernels_device "$cap_kernels" "$reserve_kernels" "$python" -m py_compile scripts/gpu_bandwidth.py
    else
        step kernels_device "$cap_kernels" "$reserve_kernels" "$python" scripts/gpu_bandwidth.py --out "$logs" \
            --budget-s $(( cap_kernels - 10 ))
    fi

    # ------------------------------------------------------------------------ what is left of the budget
    # Paths reach the inner shells as their arguments ("$1"), never spliced into their text: a PYTHON or
    # TMPDIR with a space (or a quote) in it stays one word.
    if [ "$dry" = 1 ] && [ "${DRMOO_GPU_CHECK_DRY_ALL:-0}" != 1 ]; then
        for name in bench bench_iter cuda_round_trip; do
            note "$name" "skipped (dry: a training loop of minutes on a CPU; DRMOO_GPU_CHECK_DRY_ALL=1 runs it)"
        done
    elif [ "$dry" = 1 ]; then
        step bench 60 0 "$python" bench/run.py --help
        step bench_iter 150 0 bash -c '"$1" -m drmoo bench-iter --experiment multimnist2 --device cpu --methods mgda \
            --batch-size 8 --input-size 28 --repeats 1 --warmup 1 --out "$2" --quiet' bench_iter "$python" \
            "$results/wallclock"
    else
        step bench 120 0 env DRMOO_BENCH_BUDGET_S="${DRMOO_BENCH_BUDGET_S:-0.1}" "$python" bench/run.py \
            -k "not tasks_step"
        step bench_iter 150 0 bash -c '"$1" -m drmoo bench-iter --experiment multimnist2 --methods all \
            --batch-size 256 --repeats 20 --warmup 3 --out results/wallclock --quiet && \
            "$1" -m drmoo bench-iter --experiment multimnist2 --methods double-clip,mgda,nashmtl \
            --batch-size 32 --repeats 20 --warmup 3 --out results/wallclock --quiet' bench_iter "$python"
    fi
    if [ "$what" = all ] && { [ "$dry" = 0 ] || [ "${DRMOO_GPU_CHECK_DRY_ALL:-0}" = 1 ]; }; then
        round_trip=$(mktemp -d)
        device=cuda
        small=()
        [ "$dry" = 1 ] && device=cpu && small=(--model lenet --input-size 28 --batch-size 8 --train-size 64 --test-size 16)
        step cuda_round_trip 60 0 bash -c 'set -e; "$1" -m drmoo train --experiment multimnist2 --method double-clip \
            --preset quick --device "$3" --max-steps 2 --out "$2/run" --quiet "${@:4}"; \
            "$1" -m drmoo train --resume "$2/run" --max-steps 4 --quiet; \
            "$1" -m drmoo eval --run "$2/run" --eps 0,0.03 --quiet; cat "$2/run/eval.json"' \
            cuda_round_trip "$python" "$round_trip" "$device" "${small[@]}"
    fi
fi

echo "[gpu_check] done in $(( $(date +%s) - start ))s, exit status $status" | tee -a "$summary"
if [ -n "${OUT:-}" ]; then
    packed=("$results" "$logs")
    [ -d results/wallclock ] && packed+=(results/wallclock)  # absent when bench_iter did not run
    tar czf "$OUT/gpu_check.tar.gz" "${packed[@]}"
    cp "$summary" "$OUT/"
fi
exit "$status"
