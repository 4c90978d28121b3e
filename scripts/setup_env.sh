#!/usr/bin/env bash
# Create .venv (or $DRMOO_VENV) with the pinned dev/test requirements, build drmoo's wheel against the
# venv's torch (--no-build-isolation) into dist/, and install it: the CPU kernels always (on torch's
# stable ABI: the same wheel serves every torch >= 2.11, which scripts/test_oldest.sh proves), the
# CUDA kernels when a GPU is visible or DRMOO_BUILD_CUDA=1 (setup.py).  Here a kernel that does not
# compile fails the set-up (DRMOO_BUILD_KERNELS=1), instead of the one-line skip a user's
# `pip install` gets, so that the tests never run on a silently kernel-less install.
# Idempotent: rerunning it rebuilds and reinstalls drmoo.
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
echo "[setup] building drmoo's wheel (compiles csrc/; MAX_JOBS=${MAX_JOBS:-2}) and installing it"
start=$(date +%s)
wheels="${DRMOO_WHEEL_DIR:-dist}"
rm -f "$wheels"/drmoo-*.whl
DRMOO_BUILD_KERNELS="${DRMOO_BUILD_KERNELS:-1}" MAX_JOBS="${MAX_JOBS:-2}" \
    "$venv/bin/pip" wheel --quiet --no-build-isolation --no-deps --wheel-dir "$wheels" .
wheel=$(ls "$wheels"/drmoo-*.whl)
built=$(date +%s)
"$venv/bin/pip" install --quiet --no-deps --force-reinstall "$wheel"
echo "[setup] $(basename "$wheel"): built in $(( built - start ))s, $(( $(stat -c %s "$wheel") / 1024 )) KiB"
# Asked from / so that nothing but the venv is on the path.
venv_python="$(cd "$venv" && pwd)/bin/python"
backends=$(cd / && "$venv_python" -c 'import drmoo_kernels as k; print(", ".join(k.available_backends()))')
echo "[setup] drmoo installed in $(( $(date +%s) - start ))s; backends available here: $backends"
