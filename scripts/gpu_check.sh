#!/usr/bin/env bash
# Everything the kernels need from a GPU machine, in one command:
#   1. build drmoo_kernels._C in place with the CUDA kernels (needs nvcc; without it only Triton runs),
#   2. the kernel tests (cuda backend + compiled Triton kernels on CUDA tensors) and the optimizer
#      parity tests, on the GPU,
#   3. the full benchmark: bench/results/gpu-<name>.{json,md} (python bench/run.py).
# The logs and results are copied to $OUT when it is set (the device runner's output folder).
#
# Uses .venv when it exists (scripts/setup_env.sh), else $PYTHON or python3 with torch already
# installed (a GPU machine without network access cannot run the pinned install).
#
#   bash scripts/gpu_check.sh              # all three steps
#   bash scripts/gpu_check.sh tests        # steps 1-2 only
#   bash scripts/gpu_check.sh bench        # steps 1 and 3 only
# Device time is usually scarce: the benchmark measures each record for DRMOO_BENCH_BUDGET_S
# (0.25 s here, 1 s by default), and "tests" and "bench" fit separate 10-minute calls.
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
echo "[gpu_check] building the extension in place (MAX_JOBS=${MAX_JOBS:-8})"
MAX_JOBS="${MAX_JOBS:-8}" "$python" setup.py build_ext --inplace > "$logs/build.log" 2>&1 \
    || { tail -40 "$logs/build.log"; exit 1; }
export PYTHONPATH="python:.${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c 'import drmoo_kernels as k; print("[gpu_check] backends:", ", ".join(k.available_backends()))' \
    | tee "$logs/backends.txt"
echo "[gpu_check] built in $(( $(date +%s) - start ))s"

status=0
set +e  # run both steps and report both, whatever the first one does
if [ "$what" != bench ]; then
    echo "[gpu_check] kernel and optimizer tests on the GPU"
    "$python" -m pytest -q -p no:cacheprovider -ra tests/kernels tests/optim \
        --junitxml="$logs/gpu-tests.xml" 2>&1 | tee "$logs/gpu-tests.log" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" != tests ]; then
    echo "[gpu_check] benchmarks"
    DRMOO_BENCH_BUDGET_S="${DRMOO_BENCH_BUDGET_S:-0.25}" "$python" bench/run.py 2>&1 | tee "$logs/bench.log" | tail -5
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
set -e
if [ -n "${OUT:-}" ]; then
    cp -r bench/results "$OUT/"
fi
echo "[gpu_check] done in $(( $(date +%s) - start ))s, exit status $status"
exit "$status"
