#!/usr/bin/env bash
# Create .venv (or $DRMOO_VENV) with the pinned dev/test requirements and install drmoo into it,
# compiling the kernels in csrc/ against the venv's torch (--no-build-isolation): the CPU kernels
# always, the CUDA kernels when a GPU is visible or DRMOO_BUILD_CUDA=1 (setup.py).  Here a kernel
# that does not compile fails the set-up (DRMOO_BUILD_KERNELS=1), instead of the one-line skip a
# user's `pip install` gets, so that the tests never run on a silently kernel-less install.
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
DRMOO_BUILD_KERNELS="${DRMOO_BUILD_KERNELS:-1}" MAX_JOBS="${MAX_JOBS:-2}" \
    "$venv/bin/pip" install --quiet --no-build-isolation --no-deps .
# Asked from / so that nothing but the venv is on the path.
venv_python="$(cd "$venv" && pwd)/bin/python"
backends=$(cd / && "$venv_python" -c 'import drmoo_kernels as k; print(", ".join(k.available_backends()))')
echo "[setup] drmoo installed in $(( $(date +%s) - start ))s; backends available here: $backends"
