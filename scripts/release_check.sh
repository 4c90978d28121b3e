#!/usr/bin/env bash
# Check what a release would upload to PyPI, as .github/workflows/release.yml does before publishing:
# the wheel and the sdist in dist/ (or $DRMOO_WHEEL_DIR), which scripts/build_wheel.sh makes
# (scripts/setup_env.sh runs it; `--build` here runs it first).  Exits non-zero, naming the problem, unless:
#
# * the version in python/drmoo/_version.py is a plain release (X.Y.Z, no local label: PyPI refuses
#   `+nokernels`), and, for a tag ($DRMOO_RELEASE_TAG, or the tag GitHub Actions is building), the
#   tag is vX.Y.Z and CHANGELOG.md has that version's dated section;
# * dist/ holds exactly drmoo-X.Y.Z-cp310-abi3-manylinux_2_NN_x86_64.whl and drmoo-X.Y.Z.tar.gz;
# * the wheel carries the compiled kernels (drmoo_kernels/_C.abi3.so), no library grafted by auditwheel
#   (torch's own must never ship twice), and metadata of that version; the sdist carries csrc/ and no
#   compiled file;
# * `twine check --strict` passes both (the metadata and the README render as PyPI will show them);
# * `auditwheel show` finds the wheel's symbols within its manylinux tag, and no shared library outside
#   that tag but torch's and CUDA's.
#
# Needs the venv $DRMOO_VENV (default .venv) with twine, cmarkgfm and auditwheel (requirements-dev.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DRMOO_VENV:-.venv}"
out="${DRMOO_WHEEL_DIR:-dist}"
if [ "${1:-}" = --build ]; then
    DRMOO_VENV="$venv" DRMOO_WHEEL_DIR="$out" bash scripts/build_wheel.sh
elif [ $# -gt 0 ]; then
    echo "usage: bash scripts/release_check.sh [--build]" >&2
    exit 2
fi
fail() { echo "[release] error: $*" >&2; exit 1; }
for tool in python twine auditwheel; do
    [ -x "$venv/bin/$tool" ] || fail "$venv/bin/$tool is missing: run scripts/setup_env.sh, or set DRMOO_VENV"
done
start=$(date +%s)

version=$(sed -nE 's/^__version__ = "([^"]+)"$/\1/p' python/drmoo/_version.py)
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] \
    || fail "python/drmoo/_version.py says '$version': a release is MAJOR.MINOR.PATCH (CHANGELOG.md, top)"
tag="${DRMOO_RELEASE_TAG:-}"
[ -z "$tag" ] && [ "${GITHUB_REF_TYPE:-}" = tag ] && tag="${GITHUB_REF_NAME:-}"
if [ -n "$tag" ]; then
    [ "$tag" = "v$version" ] || fail "the tag is $tag, but python/drmoo/_version.py says $version (tag v$version)"
    grep -qE "^## ${version//./\\.} — [0-9]{4}-[0-9]{2}-[0-9]{2}$" CHANGELOG.md \
        || fail "CHANGELOG.md has no dated section '## $version — YYYY-MM-DD' for the tag $tag"
fi

shopt -s nullglob
wheels=("$out"/drmoo-*.whl)
sdists=("$out"/drmoo-*.tar.gz)
[ ${#wheels[@]} -eq 1 ] && [ ${#sdists[@]} -eq 1 ] \
    || fail "$out/ must hold one drmoo wheel and one sdist, found: ${wheels[*]:-no wheel} ${sdists[*]:-no sdist}" \
            "(bash scripts/release_check.sh --build makes them)"
wheel=${wheels[0]}
sdist=${sdists[0]}
[[ "$(basename "$wheel")" =~ ^drmoo-${version//./\\.}-cp310-abi3-(manylinux_2_[0-9]+_x86_64)\.whl$ ]] \
    || fail "$(basename "$wheel") is not drmoo-$version-cp310-abi3-manylinux_2_NN_x86_64.whl (a kernel-less or" \
            "unrepaired wheel must not be uploaded)"
platform=${BASH_REMATCH[1]}
[ "$(basename "$sdist")" = "drmoo-$version.tar.gz" ] || fail "$(basename "$sdist") is not drmoo-$version.tar.gz"

# What is inside: read with the standard library, nothing installed or imported.
"$venv/bin/python" - "$wheel" "$sdist" "$version" <<'EOF' || exit 1
import sys, tarfile, zipfile

wheel, sdist, version = sys.argv[1:]
problems = []
with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
if "drmoo_kernels/_C.abi3.so" not in names:
    problems.append("the wheel lacks the compiled kernels, drmoo_kernels/_C.abi3.so")
problems += [f"the wheel carries a library grafted by auditwheel: {n}" for n in names if ".libs/" in n]
if f"\nVersion: {version}\n" not in metadata:
    problems.append(f"the wheel's METADATA does not say Version: {version}")
with tarfile.open(sdist) as archive:
    members = archive.getnames()
    info = archive.extractfile(f"drmoo-{version}/PKG-INFO")
    pkg_info = info.read().decode() if info is not None else ""
if not any(m.startswith(f"drmoo-{version}/csrc/") for m in members):
    problems.append("the sdist lacks csrc/, the kernels' sources")
problems += [f"the sdist carries a compiled file: {m}" for m in members if m.endswith((".so", ".o", ".pyc"))]
if f"\nVersion: {version}\n" not in pkg_info:
    problems.append(f"the sdist's PKG-INFO does not say Version: {version}")
for problem in problems:
    print(f"[release] error: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF

"$venv/bin/twine" check --strict "$wheel" "$sdist" >"$out/.twine-check.log" 2>&1 \
    || { cat "$out/.twine-check.log" >&2; fail "twine check --strict refused what would be uploaded"; }
rm -f "$out/.twine-check.log"
# auditwheel show: the platform tag the wheel's own symbols allow must be the one in its file name, and the
# only shared libraries it needs beyond that tag's must be torch's and CUDA's, which the user's torch
# brings (scripts/build_wheel.sh keeps them out of the wheel).
PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" show --json "$wheel" >"$out/.auditwheel.json" 2>&1 \
    || { cat "$out/.auditwheel.json" >&2; rm -f "$out/.auditwheel.json"; fail "auditwheel show failed"; }
"$venv/bin/python" - "$out/.auditwheel.json" "$platform" <<'EOF' || { rm -f "$out/.auditwheel.json"; exit 1; }
import json, re, sys

with open(sys.argv[1]) as report:
    shown = json.load(report)
platform = sys.argv[2]
problems = []
if shown["sym_tag"] != platform:
    problems.append(f"auditwheel show allows {shown['sym_tag']}, but the wheel is tagged {platform}")
torch_or_cuda = re.compile(r"lib(torch\w*|c10\w*|cudart|cuda|nvrtc\w*|nvToolsExt\w*)\.so[.\d]*")
others = [lib for lib in shown["external_libs"] if not torch_or_cuda.fullmatch(lib)]
if others:
    problems.append(f"the wheel needs shared libraries that neither its platform tag nor torch provides: {others}")
for problem in problems:
    print(f"[release] error: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
rm -f "$out/.auditwheel.json"

echo "[release] ready to upload (checked in $(( $(date +%s) - start ))s): $(basename "$wheel") (cp310-abi3, $platform)" \
     "and $(basename "$sdist")${tag:+, for the tag $tag}"
