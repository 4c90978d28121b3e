#!/usr/bin/env bash
# Create .venv (or $DRMOO_VENV) with the pinned dev/test requirements and install drmoo into it,
# compiling the kernels in csrc/ (CPU always; CUDA too when a CUDA toolkit is found).
# Idempotent: rerunning it only reinstalls drmoo.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DRMOO_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv with $("$python" --version)"
    "$python" -m venv "$venv"
fi
echo "[setup] installing the pinned requirements (torch takes a few minutes the first time)"
"$venv/bin/pip" install --quiet --progress-bar off -r requirements-dev.txt
echo "[setup] building and installing drmoo (compiles csrc/; MAX_JOBS=${MAX_JOBS:-2})"
start=$(date +%s)
MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/pip" install --quiet --no-build-isolation --no-deps .
# Ask from outside the checkout: here, `import drmoo_kernels` would find the uncompiled source folder.
venv_python="$(cd "$venv" && pwd)/bin/python"
backends=$(cd / && "$venv_python" -c 'import drmoo_kernels as k; print(", ".join(k.available_backends()))')
echo "[setup] drmoo installed in $(( $(date +%s) - start ))s; backends available here: $backends"
