#!/usr/bin/env bash
# The CI matrix's second leg (.ci/run runs it after scripts/test.sh): the oldest supported torch and
# Triton (requirements-oldest.txt = the lower bounds in pyproject.toml) in a second venv, with the
# wheel that scripts/setup_env.sh built against the pinned torch (scripts/build_wheel.sh: repaired to
# a manylinux tag) installed there with --no-deps, as a user installs it -- not rebuilt: the CPU
# kernels are built on torch's stable ABI for torch 2.11, so that one wheel must load here -- and
# the tests of the ops, their autograd plumbing and the optimizers, with the compiled `cpp` backend
# required.  Extra arguments go to pytest.  The wheel: $DRMOO_WHEEL, default the one in dist/.
# The venv ($DRMOO_OLDEST_VENV, default .venv-oldest, gitignored) is created once (5.2 GB: PyPI's
# torch wheels bring 2.7 GB of CUDA runtime libraries) and reused.
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

# A glob, not `ls | head`: under `set -o pipefail` a failing ls (no wheel) ended the script with
# status 2 and no message, before the check below could say what is missing.
wheel="${DRMOO_WHEEL:-}"
if [ -z "$wheel" ]; then
    for candidate in dist/drmoo-*.whl; do
        [ -f "$candidate" ] && { wheel=$candidate; break; }
    done
fi
if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
    echo "[oldest] no drmoo wheel in dist/: run scripts/setup_env.sh (or scripts/test.sh) first, or set DRMOO_WHEEL" >&2
    exit 1
fi
echo "[oldest] installing $(basename "$wheel") (built against the pinned torch; not rebuilt here)"
"$venv/bin/pip" install --quiet --no-deps --force-reinstall "$wheel"
# The stable-ABI build must load under this torch: the `cpp` backend is required, not merely reported.
backends=$(cd / && "$venv_python" -c '
import drmoo_kernels as k
available = k.available_backends()
assert "cpp" in available, "the cpp backend is not available here: " + str(k.why_unavailable("cpp"))
print(", ".join(available))')
echo "[oldest] drmoo installed; backends available here: $backends"

echo "[oldest] pytest: ops, autograd plumbing, optimizers"
# As in scripts/test.sh: the pytest entry point keeps the checkout off sys.path, so the tests
# import the drmoo installed in this venv (with its compiled _C).
"$venv/bin/pytest" -q tests/kernels tests/optim tests/test_objective.py tests/test_jacobian_and_attacks.py \
    tests/test_supported_versions.py tests/reliability/test_ops_checks.py "$@"
echo "[oldest] done in $(( $(date +%s) - start ))s"
