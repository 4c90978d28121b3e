#!/usr/bin/env bash
# Set up everything (scripts/setup_env.sh), then run the main job.  Output: runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv="${DRMOO_VENV:-.venv}"
"$venv/bin/drmoo" synthetic --problem linear --methods double-clip,double-loop --steps 600 --seed 0 \
    --out runs/demo "$@"
echo "[demo] results: runs/demo/summary.md, runs/demo/convergence.png, runs/demo/metrics.csv"
