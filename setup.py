"""Build script: the packages and metadata come from pyproject.toml; this file adds the compiled kernels.

What gets compiled (README, "Install" and "One build for every supported torch"):

* ``drmoo_kernels._C``: the op schemas and the CPU kernels (csrc/ops.cpp, csrc/cpu/), on torch's
  LibTorch stable ABI with ``TORCH_TARGET_VERSION`` = the oldest supported torch (``MIN_TORCH`` of
  drmoo_kernels/_compat.py, 2.11) and Python's limited API: built once, it loads under torch 2.11
  and every later torch, on any CPython >= 3.10 (an abi3 wheel).
* ``drmoo_kernels._C_cuda``: the CUDA kernels (csrc/cuda/), on the same stable ABI, target and limited
  API as ``_C`` (plus the C shim's CUDA functions, ``-DUSE_CUDA``): it too loads under torch 2.11 and
  every later torch -- one whose CUDA runtime has the major version of the building torch's (it links
  libcudart.so.<major>).
* The kernels are built only when torch is importable *in the build environment*: ``pip install
  --no-build-isolation .`` (or ``python setup.py build_ext --inplace``) with torch installed.  pip's
  default build isolation has no torch (pyproject.toml does not ask for one: that used to download
  a second torch with its CUDA wheels), so a plain ``pip install .`` installs the pure-Python
  packages, whose ``reference`` backend is complete, and prints one line saying how to get the
  kernels.
* ``DRMOO_BUILD_KERNELS``: unset = build them if possible, else one line and the pure-Python install
  (no compiler, a compiler error); ``1`` = required (any failure fails the install: the project's
  scripts set it, so CI never silently loses the kernels); ``0`` = skip them.
* The CUDA extension is built when ``DRMOO_BUILD_CUDA=1``, or, with ``DRMOO_BUILD_CUDA`` unset, when
  a GPU is visible (torch.cuda or ``nvidia-smi -L``) or ``TORCH_CUDA_ARCH_LIST`` is set to a
  non-empty value; ``DRMOO_BUILD_CUDA=0`` never.  A toolkit on PATH alone does not trigger it
  (minutes of nvcc for kernels nothing can run).  CI has nvcc but no GPU, so .ci/run asks with
  ``DRMOO_BUILD_CUDA=1`` to prove the CUDA sources compile.  Unless the kernels are required, a
  CUDA compile error skips the CUDA kernels only (one line), not the CPU ones.

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
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from setuptools import find_packages, setup

DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
CUDA_EXTENSION = "drmoo_kernels._C_cuda"  # the stable-ABI CUDA kernels (README, "Supported versions")
HOW_TO_BUILD = "with torch and a C++ compiler installed: pip install --no-build-isolation ."
# A build without the compiled kernels gets this PEP 440 local version label (``0.2.0+nokernels``):
# `pip list` then tells the two builds apart, and installing the wheel with the kernels (``0.2.0``)
# over such an install replaces it.  With one version string for both, pip keeps the kernel-less
# install ("already installed with the same version as the provided wheel") and drmoo stays on its
# reference backend.  An sdist keeps the plain version: pip requires a package built from an sdist to
# carry the version in the sdist's file name.
NO_KERNELS_LABEL = "nokernels"
HERE = os.path.dirname(os.path.abspath(__file__))
VERSION_FILE = os.path.join(HERE, "python", "drmoo", "_version.py")


class KernelBuildError(RuntimeError):
    """The kernels were required (DRMOO_BUILD_KERNELS=1 / DRMOO_BUILD_CUDA=1) but cannot be built."""


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


def _switch(environ: Mapping[str, str], name: str) -> bool | None:
    """An on/off environment variable: True for "1", False for "0", None when unset or empty."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise KernelBuildError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def kernels_mode(environ: Mapping[str, str]) -> str:
    """``DRMOO_BUILD_KERNELS`` as 'auto' (unset), 'required' (1) or 'off' (0)."""
    switch = _switch(environ, "DRMOO_BUILD_KERNELS")
    return "auto" if switch is None else ("required" if switch else "off")


def gpu_visible() -> bool:
    """Whether this machine shows a CUDA GPU: torch says so, or ``nvidia-smi -L`` lists one."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listing.returncode == 0 and "GPU" in listing.stdout


def cuda_wanted(environ: Mapping[str, str], has_gpu: Callable[[], bool] = gpu_visible) -> tuple[bool, bool, str]:
    """(build the CUDA sources?, did the user insist?, why) from the environment and the machine.

    The user insists with ``DRMOO_BUILD_CUDA=1`` (then a missing toolkit is an error); a non-empty
    ``TORCH_CUDA_ARCH_LIST`` or a visible GPU asks for them without insisting.
    """
    switch = _switch(environ, "DRMOO_BUILD_CUDA")
    if switch is not None:
        return switch, switch, f"DRMOO_BUILD_CUDA={int(switch)}"
    if environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        return True, False, "TORCH_CUDA_ARCH_LIST is set"
    if has_gpu():
        return True, False, "a GPU is visible"
    return False, False, "no GPU is visible (DRMOO_BUILD_CUDA=1 or TORCH_CUDA_ARCH_LIST builds them anyway)"


def _is_cuda_source(path: str) -> bool:
    return os.path.normpath(path).split(os.sep)[:2] == ["csrc", "cuda"]


def _min_torch() -> tuple[int, int]:
    """drmoo_kernels._compat.MIN_TORCH, read without importing the package (its __init__ imports torch)."""
    # python/drmoo_kernels: the link to drmoo_kernels/ in a checkout, the package's real folder in an sdist
    # (which holds the files the link reaches, under python/).
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "drmoo_kernels", "_compat.py")
    spec = importlib.util.spec_from_file_location("_drmoo_compat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MIN_TORCH


# The stable-ABI extension targets the oldest supported torch: it may use only the stable API that
# torch already had, and then loads under that torch and every later one.
STABLE_ABI_TARGET = ".".join(str(part) for part in _min_torch())
# The wheel tag of Python's limited API (abi3) for the oldest Python that pyproject.toml allows; torch's
# BuildExtension compiles py_limited_api extensions with -DPy_LIMITED_API for that same Python 3.10.
LIMITED_API_TAG = "cp310"


def stable_abi_flags(target: str = STABLE_ABI_TARGET) -> list[str]:
    """The compiler flags of the stable-ABI build for torch ``target`` ("2.11")."""
    major, minor = (int(part) for part in target.split("."))
    # TORCH_TARGET_VERSION: [major][minor][patch][5 bytes of ABI tag], as torch/headeronly/version.h packs it.
    version = f"0x{major:02x}{minor:02x}000000000000"
    # (-DPy_LIMITED_API comes from torch's BuildExtension for every py_limited_api extension.)
    return [f"-DTORCH_TARGET_VERSION={version}", f'-DDRMOO_STABLE_TARGET="{target}"']


def cuda_compile_args(arch_flags: list[str], target: str = STABLE_ABI_TARGET) -> dict[str, list[str]]:
    """The compiler flags of drmoo_kernels._C_cuda: the stable-ABI build of ``target``, as for _C, for both
    compilers (the .cu files' host code includes the stable headers too), with ``USE_CUDA``, without which
    torch's C shim does not declare its CUDA functions (``aoti_torch_get_current_cuda_stream``)."""
    stable = [*stable_abi_flags(target), "-DUSE_CUDA"]
    return {"cxx": ["-O3", "-std=c++20", *stable], "nvcc": ["-O3", "-std=c++20", "-lineinfo", *stable, *arch_flags]}


def stable_abi_problem(torch_version: str) -> str | None:
    """Why the stable-ABI kernels cannot be compiled against ``torch_version``'s headers, or None."""
    release = tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2])
    target = tuple(int(part) for part in STABLE_ABI_TARGET.split("."))
    if release >= target:
        return None
    return f"torch {torch_version} is older than {STABLE_ABI_TARGET}, whose stable ABI the kernels target"


def compiler_problem(environ: Mapping[str, str]) -> str | None:
    """Why the C/C++ compilers the build would use cannot run, or None when they answer ``--version``.

    Checked before torch's own compiler probe, which fails with a traceback (CC=/bin/false) or a
    wrong "compiler version 0.0.0" message (a compiler that does not exist).
    """
    for variable, default in (("CXX", "c++"), ("CC", "cc")):
        command = shlex.split(environ.get(variable, "") or default)
        if not command:
            continue
        named = f"{variable}={' '.join(command)}" if environ.get(variable) else f"{command[0]} ({variable} unset)"
        if shutil.which(command[0]) is None:
            return f"no C++ compiler: {named} is not found"
        try:
            probe = subprocess.run([*command, "--version"], capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as error:
            return f"no working C++ compiler: {named} does not run ({error})"
        if probe.returncode != 0:
            return f"no working C++ compiler: `{' '.join(command)} --version` exited with status {probe.returncode}"
    return None


def skipped_line(reason: str, how: str = HOW_TO_BUILD) -> str:
    """The one line printed when the kernels are not built."""
    return (
        f"drmoo: the fused kernels (drmoo_kernels._C) were skipped: {reason}. drmoo works without them (pure-torch "
        f"'reference' backend, ~2x slower per optimizer step); to build them, {how}"
    )


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


# The setup.py commands that build or install code.  pip runs setup.py several times per install
# (egg_info / dist_info for the metadata, then bdist_wheel or editable_wheel); the build decision is
# the same each time, and only the build says it, so that `pip install -v` shows it once.
BUILD_COMMANDS = frozenset({"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"})


def read_version(path: str = VERSION_FILE) -> str:
    """``__version__`` of python/drmoo/_version.py, read as text (the build may have no torch to import drmoo with)."""
    with open(path, encoding="utf-8") as handle:
        match = re.search(r'^__version__ = "([^"]+)"$', handle.read(), re.M)
    if match is None:
        raise KernelBuildError(f"{path} holds no line __version__ = \"X.Y.Z\"")
    return match.group(1)


def distribution_version(version: str, with_kernels: bool, argv: list[str], from_sdist: bool) -> str:
    """The version pip records: ``version`` itself, or ``version+nokernels`` for a kernel-less build from a
    source tree (not for the sdist itself, nor for a build from an unpacked sdist, whose version pip checks
    against the sdist's file name)."""
    if with_kernels or "sdist" in argv or from_sdist:
        return version
    return f"{version}+{NO_KERNELS_LABEL}"


def _say(line: str) -> None:
    # stderr: pip shows a build's output only with -v (or when the build fails); the README and the
    # run-time warning of drmoo_kernels._ops say the same thing for those who miss it.
    if BUILD_COMMANDS.intersection(sys.argv[1:]):
        print(line, file=sys.stderr, flush=True)


def _extensions(environ: Mapping[str, str]) -> tuple[list[Any], dict[str, Any]]:
    """The extension to build and its build command, or ([], {}) with one line saying why not."""
    mode = kernels_mode(environ)
    if mode == "off":
        _say(skipped_line("DRMOO_BUILD_KERNELS=0", "unset DRMOO_BUILD_KERNELS and " + HOW_TO_BUILD))
        return [], {}
    # csrc/ops.cpp and csrc/cpu/ make the stable-ABI extension; csrc/cuda/ (module.cpp and the .cu
    # files) the CUDA one.
    cpp_sources = sorted(p for p in glob.glob("csrc/**/*.cpp", recursive=True) if not _is_cuda_source(p))
    if not cpp_sources:  # an sdist without csrc/ cannot happen (MANIFEST), but a trimmed copy can
        return _skip_or_fail(mode, "csrc/ holds no C++ sources")
    try:
        import torch
    except ImportError:
        return _skip_or_fail(
            mode, "torch is not importable in the build environment (pip's build isolation)",
            "install torch first, then: pip install --no-build-isolation .",
        )
    problem = compiler_problem(environ)
    if problem is not None:
        return _skip_or_fail(mode, problem, "install g++ (or clang++), then: pip install --no-build-isolation .")

    want_cuda, insisted, why_cuda = cuda_wanted(environ)
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    _locate_cuda_home()  # also keeps torch from warning that it guessed CUDA_HOME
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    missing_cuda = None
    if want_cuda and CUDA_HOME is None:
        missing_cuda = "no CUDA toolkit (nvcc) was found; set CUDA_HOME"
    elif want_cuda and torch.version.cuda is None:
        missing_cuda = f"torch {torch.__version__} is a CPU-only build"
    if missing_cuda is not None:
        if insisted:
            raise KernelBuildError(f"{why_cuda} asks for the CUDA kernels, but {missing_cuda}")
        _say(f"drmoo: CPU kernels only: {why_cuda}, but {missing_cuda}")
        want_cuda = False

    problem = stable_abi_problem(str(torch.__version__))
    if problem is not None:
        return _skip_or_fail(mode, problem, "install torch >= " + STABLE_ABI_TARGET + ", then: " + HOW_TO_BUILD)

    # drmoo_kernels._C: the schemas and the CPU kernels on torch's stable ABI -- one build for torch
    # >= STABLE_ABI_TARGET (README, "One build for every supported torch").  torch >= 2.10 headers
    # need C++20.  No OpenMP flags: torch::stable::parallel_for runs in libtorch's own thread pool.
    stable = CppExtension(
        "drmoo_kernels._C", cpp_sources, extra_compile_args={"cxx": ["-O3", "-std=c++20", *stable_abi_flags()]},
        py_limited_api=True,
    )
    if not (want_cuda and cuda_sources):
        _say(f"drmoo: building the CPU kernels (stable ABI, torch >= {STABLE_ABI_TARGET}; not the CUDA ones: "
             f"{why_cuda})")
        return [stable], {"build_ext": _optional_build_command(mode)}
    arch_flags, arch_choice = cuda_arch_flags(environ)
    _say(f"drmoo: building the CPU kernels (stable ABI, torch >= {STABLE_ABI_TARGET}) and the CUDA kernels "
         f"({why_cuda}; stable ABI, torch >= {STABLE_ABI_TARGET}) for {arch_choice}")
    # drmoo_kernels._C_cuda: the CUDA kernels, on the same stable ABI and target as _C (one build for
    # torch >= STABLE_ABI_TARGET; cuda_compile_args).  Only Python's limited API (its module init), so the
    # wheel's abi3 tag holds for both shared objects.  No --use_fast_math: the kernels are memory bound, and
    # approximate exp/log/pow would only widen the gap to the reference the CUDA backend is tested
    # against.
    cuda = CUDAExtension(
        CUDA_EXTENSION, ["csrc/cuda/module.cpp", *cuda_sources], extra_compile_args=cuda_compile_args(arch_flags),
        py_limited_api=True,
    )
    return [stable, cuda], {"build_ext": _optional_build_command(mode)}


def _skip_or_fail(mode: str, reason: str, how: str = HOW_TO_BUILD) -> tuple[list[Any], dict[str, Any]]:
    if mode == "required":
        raise KernelBuildError(f"DRMOO_BUILD_KERNELS=1, but the kernels cannot be built: {reason}")
    _say(skipped_line(reason, how))
    return [], {}


def _optional_build_command(mode: str) -> type:
    """torch's BuildExtension (ninja), which in 'auto' mode turns a failed compile into one line.

    A failure in the CUDA extension costs only the CUDA kernels: the stable-ABI CPU extension is then
    built alone (a GPU machine whose nvcc cannot compile still gets the fused CPU kernels).
    """
    from torch.utils.cpp_extension import BuildExtension

    base = BuildExtension.with_options(use_ninja=True)

    class OptionalKernelsBuild(base):  # type: ignore[misc, valid-type]
        building: str | None = None  # the extension being compiled, to tell which one failed

        def build_extension(self, ext: Any) -> None:
            self.building = ext.name
            super().build_extension(ext)

        def _remove_shadowing_builds(self) -> None:
            # In place, and in build/lib*: a wheel packs whatever that directory holds, so a stale
            # per-Python build left there by an older drmoo would ship beside the abi3 one and win.
            # (In place: python/drmoo_kernels is the link to the top-level drmoo_kernels/.)
            package_dir = os.path.join("python" if self.inplace else self.build_lib, "drmoo_kernels")
            for path in shadowing_builds(package_dir):
                os.remove(path)
                _say(f"drmoo: removed {path}, an older build that would shadow the new abi3 one")
            if not self.inplace:
                # ... and an extension an earlier build made but this one does not (the CUDA kernels
                # of a DRMOO_BUILD_CUDA=1 build, any kernels after a failed compile) would ship too.
                built = {ext.name.rsplit(".", 1)[-1] for ext in self.extensions}
                for path in unbuilt_extensions(package_dir, built):
                    os.remove(path)
                    _say(f"drmoo: removed {path}, left by an earlier build: this build does not make it")

        def run(self) -> None:
            try:
                super().run()
                self._remove_shadowing_builds()
                return
            except Exception as error:  # compiler, linker, ninja: whatever stops the build
                if mode == "required":
                    raise
                failure = error
            if self.building == CUDA_EXTENSION:
                _say(f"drmoo: the CUDA kernels ({CUDA_EXTENSION}) were skipped: compiling csrc/cuda failed "
                     f"({_first_line(failure)}); building the CPU kernels alone (rerun with DRMOO_BUILD_KERNELS=1 "
                     f"and pip's -v to see the compiler's error)")
                self.extensions = [ext for ext in self.extensions if ext.name != CUDA_EXTENSION]
                self.distribution.ext_modules = list(self.extensions)
                self.compiler = None  # run() replaced the option by the compiler object it made; make a new one
                try:
                    super().run()
                    self._remove_shadowing_builds()
                    return
                except Exception as error:
                    failure = error
            _say(skipped_line(
                f"compiling csrc/ failed ({_first_line(failure)})",
                "rerun with DRMOO_BUILD_KERNELS=1 and pip's -v to see the compiler's error",
            ))
            # Nothing of the failed extensions may be installed: no outputs, no in-place copy, no
            # earlier build's copy in build/lib.
            self.extensions = []
            self.distribution.ext_modules = []
            self._remove_shadowing_builds()

    return OptionalKernelsBuild


def shadowing_builds(package_dir: str) -> list[str]:
    """In-place builds of the extensions under a per-Python name (``_C.cpython-311-x86_64-linux-gnu.so``, as
    drmoo built them before the stable-ABI port): Python imports those before ``_C.abi3.so``, so a stale
    one would keep being loaded after a rebuild."""
    found = []
    for name in ("_C", "_C_cuda"):
        found += sorted(glob.glob(os.path.join(package_dir, f"{name}.cpython-*.so")))
    return found


def unbuilt_extensions(package_dir: str, built: set[str]) -> list[str]:
    """The compiled extensions in ``package_dir`` (``_C.abi3.so``, ``_C_cuda.abi3.so``, any tag) whose module
    is not in ``built`` (``{"_C"}`` for a CPU-only build): an earlier build's, which a wheel would pack."""
    found = []
    for name in ("_C", "_C_cuda"):
        if name not in built:
            found += sorted(glob.glob(os.path.join(package_dir, f"{name}.*.so")))
    return found


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0]


# Guarded so that the tests can import this file for its helpers; pip's build backend and
# `python setup.py ...` both run it as __main__.
if __name__ == "__main__":
    try:
        ext_modules, cmdclass = _extensions(os.environ)
    except KernelBuildError as error:
        sys.exit(f"drmoo: error: {error}")
    setup(
        # pyproject.toml declares the version dynamic: it is _version.py's, labelled for a kernel-less build.
        version=distribution_version(read_version(), bool(ext_modules), sys.argv[1:],
                                     os.path.isfile(os.path.join(HERE, "PKG-INFO"))),
        # python/drmoo and python/drmoo_kernels, a link to the top-level drmoo_kernels/ (pyproject.toml,
        # [tool.setuptools]): find_packages walks with os.walk(followlinks=True), and build_py copies the
        # files it reaches through the link, so wheels and sdists hold real files.
        packages=find_packages("python"),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        # Both shared objects use only Python's limited API: one wheel serves every CPython >= 3.10.
        options={"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}} if ext_modules else {},
    )
