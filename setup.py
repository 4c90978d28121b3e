"""Build script: the packages come from pyproject.toml; this file adds the compiled kernels.

``drmoo_kernels._C`` is always built from the C++ sources in csrc/ (CPU kernels and the op schemas).
The CUDA sources (csrc/**/*.cu) are compiled into the same extension whenever a CUDA toolkit is
found, GPU or not, so that a CPU-only CI still proves they compile; ``DRMOO_BUILD_CUDA=0`` skips
them.  A compiler error fails the install.
"""

from __future__ import annotations

import glob
import os

from setuptools import find_packages, setup


def _extensions() -> tuple[list, dict]:
    cpp_sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not cpp_sources:
        return [], {}
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cuda_sources = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    want_cuda = os.environ.get("DRMOO_BUILD_CUDA", "1") != "0"
    extra = {"cxx": ["-O3", "-std=c++17", "-fopenmp"]}
    libraries = ["gomp"]
    if want_cuda and cuda_sources and CUDA_HOME is not None:
        extra["nvcc"] = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
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
