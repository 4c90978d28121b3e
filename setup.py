"""Build script: the packages come from pyproject.toml; this file adds the compiled kernels.

``drmoo_kernels._C`` is always built from the C++ sources in csrc/ (CPU kernels and the op schemas).
The CUDA sources (csrc/**/*.cu) are compiled into the same extension whenever a CUDA toolkit is
found, GPU or not, so that a CPU-only CI still proves they compile; ``DRMOO_BUILD_CUDA=0`` skips
them.  A compiler error fails the install.

``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures; when it is unset we build for Ampere (8.0)
and Hopper (9.0), rather than torch's default of probing a local GPU
(there is none in CI) or compiling every architecture the toolkit knows (slow).
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import find_packages, setup

DEFAULT_CUDA_ARCHS = "8.0;9.0"


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
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        # No --use_fast_math: the kernels are memory bound, and approximate exp/log/pow would only
        # widen the gap to the reference the CUDA backend is tested against.
        extra["nvcc"] = ["-O3", "-std=c++20", "-lineinfo"]
        ext = CUDAExtension(
            "drmoo_kernels._C", cpp_sources + cuda_sources, extra_compile_args=extra,
            define_macros=[("DRMOO_WITH_CUDA", "1")], libraries=libraries,
        )
    else:
        ext = CppExtension("drmoo_kernels._C", cpp_sources, extra_compile_args=extra, libraries=libraries)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(
    packages=find_packages("python") + find_packages(".", include=["drmoo_kernels", "drmoo_kernels.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
