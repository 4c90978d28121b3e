#!/usr/bin/env bash
# The FGSM eps-space evidence: one Double-Clip checkpoint, evaluated with eps in pixel and in
# normalised units, and both retention curves beside the paper's Table 1 shape.  About 40 minutes
# on the loaded 2-core CPU this was made on; pass a run directory to reuse a trained checkpoint
# (e.g. one from `drmoo compare --preset medium` on a GPU).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
run="${1:-$here/run-double-clip}"
drmoo="${DRMOO:-python -m drmoo}"
eps="0,0.01,0.03,0.05,0.08"
if [ ! -f "$run/done" ]; then
  $drmoo train --experiment multimnist2 --preset quick --method double-clip --input-size 64 --train-size 4000 \
    --test-size 1000 --batch-size 64 --epochs 3 --device cpu --out "$run" --quiet
fi
$drmoo eval --run "$run" --eps "$eps" --eps-space pixel --quiet > /dev/null && cp "$run/eval.json" "$here/pixel.json"
$drmoo eval --run "$run" --eps "$eps" --eps-space normalized --quiet > /dev/null && cp "$run/eval.json" "$here/normalized.json"
python "$here/shape.py" "$here/pixel.json" "$here/normalized.json" | tee "$here/shape.md"
