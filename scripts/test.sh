#!/usr/bin/env bash
# Set up everything (scripts/setup_env.sh), then lint, type-check, build the documentation site and run the whole
# test suite against the installed package.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv="${DRMOO_VENV:-.venv}"
# What a release tag would publish (.github/workflows/release.yml): the wheel and sdist setup_env.sh just
# built into dist/, checked by twine and auditwheel (not rebuilt; seconds).
echo "[test] release check: scripts/release_check.sh on dist/"
bash scripts/release_check.sh
echo "[test] ruff"
"$venv/bin/ruff" check .
# The documentation site (mkdocs.yml, docs/): --strict turns every warning (a broken link, an
# unresolved API reference, a missing included file, a docstring griffe cannot parse) into a
# failure.  site/ is git-ignored.  NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner.
echo "[test] docs: mkdocs build --strict"
start=$(date +%s)
# Not --quiet: it also mutes the warnings --strict counts (a broken anchor then passes).
if ! docs_log=$(NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir site 2>&1); then
    grep -v "^INFO" <<< "$docs_log" >&2
    echo "[test] docs: mkdocs build --strict failed (the warnings above)" >&2
    exit 1
fi
echo "[test] docs built in $(( $(date +%s) - start ))s (site/)"
# mypy, strict, over the package tree (pyproject.toml's [tool.mypy]); its cache, .mypy_cache, is the
# one tests/typing uses, so the typing tests that pytest runs next start warm.
echo "[test] mypy python/"
start=$(date +%s)
"$venv/bin/mypy" python/
echo "[test] mypy done in $(( $(date +%s) - start ))s"
echo "[test] pytest (includes tests/typing: mypy on python/ and on typed usage, pyright on typed usage)"
# The pytest entry point (not `python -m pytest`) keeps the source tree off sys.path, so the tests
# import the installed drmoo_kernels with its compiled _C, not the uncompiled copy in the checkout.
"$venv/bin/pytest" -q "$@"
