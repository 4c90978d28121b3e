#!/usr/bin/env bash
# Set up everything (scripts/setup_env.sh), then lint and run the whole test suite against the
# installed package.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv="${DRMOO_VENV:-.venv}"
echo "[test] ruff"
"$venv/bin/ruff" check .
echo "[test] pytest"
# The pytest entry point (not `python -m pytest`) keeps the source tree off sys.path, so the tests
# import the installed drmoo_kernels with its compiled _C, not the uncompiled copy in the checkout.
"$venv/bin/pytest" -q "$@"
