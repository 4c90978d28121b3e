"""Build script: the packages come from pyproject.toml; this file adds the compiled kernels.

``drmoo_kernels._C`` is always built from the C++ sources in csrc/ (CPU kernels and the op schemas).
The CUDA sources (csrc/**/*.cu) are compiled into the same extension whenever a CUDA toolkit is
found, GPU or not, so that a CPU-only CI still proves they compile; ``DRMOO_BUILD_CUDA=0`` skips
them.  A compiler error fails the install.

GPU architectures: unless ``TORCH_CUDA_ARCH_LIST`` is set (to anything but an empty string), the
CUDA kernels are built for a fixed list, ``DEFAULT_CUDA_ARCHS`` = "8.0;9.0+PTX": machine code for
Ampere (sm_80, also runs on sm_86/sm_89) and Hopper (sm_90), plus compute_90 PTX that the driver
compiles for newer GPUs (Blackwell).  The list is passed to nvcc as explicit ``-gencode`` flags,
which switches torch's own choice off: left alone, torch builds only for the GPUs visible at build
time (an H200 build would have no kernels for an A100) and, with no GPU, for every architecture the
toolkit knows (slow).  An empty ``TORCH_CUDA_ARCH_LIST`` (some images export one) counts as unset.
A non-empty one is the user's choice and is handed to torch unchanged ("native", named or numbered
architectures, "+PTX").
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping

from setuptools import find_packages, setup

DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def cuda_arch_flags(environ: Mapping[str, str]) -> tuple[list[str], str]:
    """The nvcc ``-gencode`` flags to add and a one-line description of the architecture choice.

    Returns no flags when the user set ``TORCH_CUDA_ARCH_LIST``: torch then derives them from it.
    Otherwise the flags of ``DEFAULT_CUDA_ARCHS``; torch adds none of its own when nvcc's flags
    already name an architecture.
    """
    user = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if user:
        return [], f"TORCH_CUDA_ARCH_LIST={user!r} (set by the user, passed to torch)"
    flags = []
    for arch in DEFAULT_CUDA_ARCHS.split(";"):
        number = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags, f"{DEFAULT_CUDA_ARCHS!r} (drmoo's default; set TORCH_CUDA_ARCH_LIST to change it)"


def _locate_cuda_home() -> None:
    """Point CUDA_HOME at the toolkit that owns the nvcc on PATH when it is not set.

    torch guesses CUDA_HOME from nvcc's location: /usr/local/bin/nvcc (a symlink or a wrapper
    script on these machines) -> /usr/local, where libcudart is not, and the link fails.  Take the
    first candidate that holds the runtime library.  Must run before torch.utils.cpp_extension is
    imported.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in candidates:
        if glob.glob(os.path.join(home, "lib*", "libcudart.so*")):
            os.environ["CUDA_HOME"] = home
            return


def _extensions() -> tuple[list, dict]:
    cpp_sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not cpp_sources:
        return [], {}
    _locate_cuda_home()
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cuda_sources = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    want_cuda = os.environ.get("DRMOO_BUILD_CUDA", "1") != "0"
    # torch >= 2.10 headers need C++20.  -fopenmp: at::parallel_for is an inline OpenMP region,
    # serial without it; libgomp is the runtime torch itself loads (same soname).
    extra = {"cxx": ["-O3", "-std=c++20", "-fopenmp"]}
    libraries = ["gomp"]
    if want_cuda and cuda_sources and CUDA_HOME is not None:
        arch_flags, arch_choice = cuda_arch_flags(os.environ)
        print(f"drmoo: building the CUDA kernels for {arch_choice}")
        # No --use_fast_math: the kernels are memory bound, and approximate exp/log/pow would only
        # widen the gap to the reference the CUDA backend is tested against.
        extra["nvcc"] = ["-O3", "-std=c++20", "-lineinfo", *arch_flags]
        ext = CUDAExtension(
            "drmoo_kernels._C", cpp_sources + cuda_sources, extra_compile_args=extra,
            define_macros=[("DRMOO_WITH_CUDA", "1")], libraries=libraries,
        )
    else:
        ext = CppExtension("drmoo_kernels._C", cpp_sources, extra_compile_args=extra, libraries=libraries)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


# Guarded so that the tests can import this file for cuda_arch_flags; pip's build backend and
# `python setup.py ...` both run it as __main__.
if __name__ == "__main__":
    ext_modules, cmdclass = _extensions()
    setup(
        packages=find_packages("python") + find_packages(".", include=["drmoo_kernels", "drmoo_kernels.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
