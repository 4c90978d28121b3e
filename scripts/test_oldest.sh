#!/usr/bin/env bash
# The CI matrix's second leg (.ci/run runs it after scripts/test.sh): the oldest supported torch and
# Triton (requirements-oldest.txt = the lower bounds in pyproject.toml) in a second venv, drmoo
# built and installed there, and the tests of the ops, their autograd plumbing and the optimizers.
# Extra arguments go to pytest.  The venv ($DRMOO_OLDEST_VENV, default .venv-oldest, gitignored) is
# created once (5.2 GB: PyPI's torch wheels bring 2.7 GB of CUDA runtime libraries) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DRMOO_OLDEST_VENV:-.venv-oldest}"
python="${PYTHON:-python3}"
start=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then
    echo "[oldest] creating $venv with $("$python" --version)"
    "$python" -m venv "$venv"
fi
echo "[oldest] installing requirements-oldest.txt (torch 2.11.0 and its CUDA libraries the first time)"
"$venv/bin/pip" install --quiet --progress-bar off -r requirements-oldest.txt
installed=$(date +%s)
# Asked from / so that nothing but the venv is on the path.
venv_python="$(cd "$venv" && pwd)/bin/python"
versions=$(cd / && "$venv_python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")')
echo "[oldest] $versions ($(( installed - start ))s)"

# The CPU kernels always (a compile error fails: DRMOO_BUILD_KERNELS=1); the CUDA kernels when a GPU
# is visible or DRMOO_BUILD_CUDA=1 (setup.py), to compile the CUDA sources against the oldest torch's
# headers too.  DRMOO_BUILD_CUDA=0 skips them.
echo "[oldest] building and installing drmoo (compiles csrc/; MAX_JOBS=${MAX_JOBS:-2})"
DRMOO_BUILD_KERNELS="${DRMOO_BUILD_KERNELS:-1}" MAX_JOBS="${MAX_JOBS:-2}" \
    "$venv/bin/pip" install --quiet --no-build-isolation --no-deps .
built=$(date +%s)
backends=$(cd / && "$venv_python" -c 'import drmoo_kernels as k; print(", ".join(k.available_backends()))')
echo "[oldest] drmoo built in $(( built - installed ))s; backends available here: $backends"

echo "[oldest] pytest: ops, autograd plumbing, optimizers"
# As in scripts/test.sh: the pytest entry point keeps the checkout off sys.path, so the tests
# import the drmoo installed in this venv (with its compiled _C).
"$venv/bin/pytest" -q tests/kernels tests/optim tests/test_objective.py tests/test_jacobian_and_attacks.py \
    tests/test_supported_versions.py "$@"
echo "[oldest] done in $(( $(date +%s) - start ))s"
