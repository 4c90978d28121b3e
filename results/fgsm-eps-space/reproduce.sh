#!/usr/bin/env bash
# The FGSM eps-space evidence: one Double-Clip checkpoint, evaluated with eps in pixel and in
# normalised units, and both retention curves beside the paper's Table 1 shape.  Training is the
# committed epoch-2 checkpoint's recipe (~1 hour on the loaded 2-core CPU this was made on; the
# batch order is seeded, so the run repeats, up to CPU floating-point differences).  Arguments:
# [RUN_DIR] to reuse a trained checkpoint (e.g. from `drmoo compare --preset medium` on a GPU),
# [OUT_DIR] for pixel.json, normalized.json and shape.md (default: rerun/ beside this script).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
run="${1:-$here/rerun/run-double-clip}"
out="${2:-$here/rerun}"
mkdir -p "$out"
drmoo="${DRMOO:-python -m drmoo}"
eps="0,0.01,0.03,0.05,0.08"
if [ ! -f "$run/done" ]; then
  $drmoo train --experiment multimnist2 --preset quick --method double-clip --input-size 64 --train-size 4000 \
    --test-size 1000 --batch-size 64 --epochs 2 --device cpu --out "$run" --quiet
fi
$drmoo eval --run "$run" --eps "$eps" --eps-space pixel --quiet > /dev/null && cp "$run/eval.json" "$out/pixel.json"
$drmoo eval --run "$run" --eps "$eps" --eps-space normalized --quiet > /dev/null && cp "$run/eval.json" "$out/normalized.json"
python "$here/shape.py" "$out/pixel.json" "$out/normalized.json" | tee "$out/shape.md"
