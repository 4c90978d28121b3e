#!/usr/bin/env bash
# Measure the install paths of docs/install.md on this machine, from a fresh clone of HEAD, in a
# venv that already has torch (the user's environment).  Takes minutes (one kernel compile); not part
# of the test suite.  Usage:
#
#   python -m venv /tmp/v && /tmp/v/bin/pip install torch numpy      # once: "an environment with torch"
#   bash scripts/measure_install.sh /tmp/v [VENV_WITH_ANOTHER_TORCH]
#
# The venv is modified (drmoo is installed and uninstalled, setuptools>=77 and ninja are added).  The
# optional second venv (e.g. torch 2.13) receives the wheel built here against the first venv's torch,
# to show that its stable-ABI CPU kernels load there (the `cpp` backend is listed) and, on a GPU
# machine, that its CUDA kernels, built for one torch, are refused with one warning.  Prints a markdown table and keeps the logs in
# $LOGS (default: a temporary folder).
set -euo pipefail
venv="$(cd "$1" && pwd)"
other="${2:+$(cd "$2" && pwd)}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
logs="${LOGS:-$(mktemp -d)}"
work="$(mktemp -d)"
git clone -q "$repo" "$work/drmoo"
src="$work/drmoo"
pip="$venv/bin/pip"
torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
rows=()

timed() {  # timed NAME COMMAND...: run in the clone, log to $logs/NAME.log; sets $seconds and $rc
    local name="$1"; shift
    local start; start=$(date +%s.%N)
    set +e
    (cd "$src" && "$@") > "$logs/$name.log" 2>&1
    rc=$?
    set -e
    seconds=$(python3 -c "print(f'{$(date +%s.%N) - $start:.0f}')")
}
drmoo_lines() { grep -h "drmoo:" "$logs/$1.log" | sed 's/^ *//' | sort -u | head -3 || true; }
torch_downloads() { grep -ciE "(Collecting|Downloading|Processing) .*torch-[0-9]" "$logs/$1.log" || true; }

"$pip" uninstall -q -y drmoo > /dev/null 2>&1 || true
echo "[measure] torch $torch_version in $venv; load average: $(cut -d' ' -f1-3 /proc/loadavg); logs in $logs"

# 1. The plain install (pip's build isolation: no torch in the build environment).
timed isolated "$pip" install -v .
rows+=("| \`pip install .\` | ${seconds} s, rc $rc, torch wheels fetched for the build: $(torch_downloads isolated) | $(drmoo_lines isolated) |")
missing=$(cd / && "$venv/bin/drmoo" train --out "$work/run" 2>&1 | tail -1; echo "rc ${PIPESTATUS[0]}")
rows+=("| then \`drmoo train\` (no torchvision) | | $(echo "$missing" | tr '\n' ' ') |")
backends=$(cd / && "$venv/bin/python" -W always -c 'import drmoo_kernels as k; print(k.available_backends())' 2>&1 \
    | grep -v "^ *warnings.warn" | tr '\n' ' ')
rows+=("| then \`available_backends()\` | | $backends |")
"$pip" uninstall -q -y drmoo

# 2. Against the installed torch: needs setuptools>=77 (and ninja for a parallel build) in the venv.
"$pip" install -q 'setuptools>=77' ninja
timed compiled env MAX_JOBS="${MAX_JOBS:-2}" "$pip" install -v --no-build-isolation .
backends=$(cd / && "$venv/bin/python" -c 'import drmoo_kernels as k; print(k.available_backends())' 2>&1 | tail -1)
rows+=("| \`pip install --no-build-isolation .\` | ${seconds} s, rc $rc | $(drmoo_lines compiled) backends: $backends |")
if [ -n "$other" ]; then
    (cd "$src" && MAX_JOBS="${MAX_JOBS:-2}" "$pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" .) \
        > "$logs/wheel.log" 2>&1
    "$other/bin/pip" uninstall -q -y drmoo > /dev/null 2>&1 || true
    "$other/bin/pip" install -q --no-deps "$work"/dist/drmoo-*.whl
    other_torch=$("$other/bin/python" -c 'import torch; print(torch.__version__)')
    warned=$(cd / && "$other/bin/python" -W always -c \
        'import drmoo_kernels as k; print(k.available_backends()); print(k.available_backends())' 2>&1 \
        | grep -v "^ *warnings.warn" | tr '\n' ' ')
    rows+=("| the wheel built against torch $torch_version, installed beside torch $other_torch | | $warned |")
    "$other/bin/pip" uninstall -q -y drmoo
fi
"$pip" uninstall -q -y drmoo

# 3. No compiler.
timed nocompiler env CC=/bin/false CXX=/bin/false "$pip" install -v --no-build-isolation .
rows+=("| \`CC=/bin/false CXX=/bin/false pip install --no-build-isolation .\` | ${seconds} s, rc $rc | $(drmoo_lines nocompiler) |")
"$pip" uninstall -q -y drmoo
timed badcompiler env CXX=/nonexistent/c++ "$pip" install -v --no-build-isolation .
rows+=("| \`CXX=/nonexistent/c++ pip install --no-build-isolation .\` | ${seconds} s, rc $rc | $(drmoo_lines badcompiler) |")
"$pip" uninstall -q -y drmoo

# 4. Editable, then drmoo from the clone's parent folder (which holds drmoo/, the clone).
timed editable env DRMOO_BUILD_KERNELS=0 "$pip" install --no-build-isolation -e .
from_parent=$(cd "$work" && "$venv/bin/python" -m drmoo --version 2>&1 | tail -1; \
    "$venv/bin/python" -c 'import drmoo; print(drmoo.__file__)' 2>&1 | tail -1)
rows+=("| \`pip install -e .\`, then \`python -m drmoo --version\` from the clone's parent | ${seconds} s, rc $rc | $(echo "$from_parent" | tr '\n' ' ') |")
"$pip" uninstall -q -y drmoo

echo
echo "| what a user does (torch $torch_version, $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)) | time | what it says |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
rm -rf "$work"
