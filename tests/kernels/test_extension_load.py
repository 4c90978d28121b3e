"""Loading drmoo_kernels._C and _C_cuda (both on the stable ABI): a missing, failing or mismatched
extension warns once, never silently; a stable-ABI build loads under every torch >= its target, and an
older drmoo's regular-ABI _C_cuda (no stable marker) only under the torch it was built with.

The failures are simulated (the loader's view of the file system and of the import are replaced):
no second torch is needed to show what a build for another torch does.  That the real stable-ABI
build loads under the oldest supported torch is shown by scripts/test_oldest.sh, which installs the
wheel built against the pinned torch into a torch 2.11 venv and runs these tests there.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from drmoo_kernels import KernelsUnavailableWarning, _ops

RUNNING = str(torch.__version__)


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that has not tried yet (the process's real result is put back afterwards), in a process with no
    other drmoo_kernels further down sys.path (a source checkout run with PYTHONPATH=python also sees the
    venv's installed copy; test_layout.py covers that case)."""
    monkeypatch.setattr(_ops, "_load_reasons", {})
    monkeypatch.setattr(_ops, "_shadowed_build", lambda extension: None)


def _fake_extension(monkeypatch: pytest.MonkeyPatch, path: Path | None, extension: str = _ops.EXTENSION) -> None:
    """Make find_spec(extension) answer ``path`` (None: not installed); other lookups unchanged."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):
        if name != extension:
            return real_find_spec(name, package)
        if path is None:
            return None
        return importlib.machinery.ModuleSpec(name, None, origin=str(path))

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _fail_import(monkeypatch: pytest.MonkeyPatch, error: Exception | None,
                 extension: str = _ops.EXTENSION) -> list[str]:
    """Importing ``extension`` raises ``error`` (None: succeeds); returns the list of its import attempts."""
    attempts: list[str] = []
    real_import = importlib.import_module

    def import_module(name: str, package: str | None = None):
        if name != extension:
            return real_import(name, package)
        attempts.append(name)
        if error is not None:
            raise error
        return None

    monkeypatch.setattr(importlib, "import_module", import_module)
    return attempts


def _so_with_marker(tmp_path: Path, version: str | None, stable_target: str | None = None) -> Path:
    """A stand-in shared object: filler bytes around the markers of csrc/ops.cpp and csrc/cuda/module.cpp
    (stable ABI: with a target), of an older drmoo's regular-ABI _C_cuda (without), or none."""
    path = tmp_path / "_C.abi3.so"
    marker = b"" if version is None else b"drmoo-built-with-torch=" + version.encode() + b";"
    if stable_target is not None:
        marker += b"drmoo-stable-abi-target=" + stable_target.encode() + b";"
    path.write_bytes(b"\x7fELF" + b"\0" * 5000 + marker + b"\0" * 5000)
    return path


def _load_twice() -> tuple[str | None, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a second warning would show even under -W always
        reason = _ops.load()
        assert _ops.load() == reason
    return reason, [w for w in caught if issubclass(w.category, KernelsUnavailableWarning)]


def test_a_build_for_another_torch_is_not_loaded_and_warns_once_with_both_versions(
        fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, "2.9.0"))
    attempts = _fail_import(monkeypatch, None)
    reason, caught = _load_twice()
    assert reason is not None and attempts == []  # never imported: another torch's ABI
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"built against torch 2.9.0, but torch {RUNNING} is running" in message
    assert "pip install --no-build-isolation --force-reinstall --no-deps ." in message
    assert "'reference' backend" in message and "2x slower" in message


def test_a_failing_load_warns_once_naming_both_versions(fresh_loader: None, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    built = RUNNING.split("+")[0]
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, built))
    _fail_import(monkeypatch, ImportError("undefined symbol: _ZN3c1015SmallVectorBaseIjE8grow_podEPKvmm"))
    reason, caught = _load_twice()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"failed to load under torch {RUNNING} (it was built against torch {built})" in message
    assert "undefined symbol" in message and "pip install --no-build-isolation" in message
    assert reason is not None and "undefined symbol" in reason


def test_a_build_without_the_marker_is_still_tried_and_its_failure_explained(
        fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, None))
    attempts = _fail_import(monkeypatch, OSError("libc10.so: cannot open shared object file"))
    _, caught = _load_twice()
    assert attempts == [_ops.EXTENSION] and len(caught) == 1
    assert "built against an unknown torch version" in str(caught[0].message)


def test_a_missing_extension_warns_once_and_says_how_to_build_it(fresh_loader: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_extension(monkeypatch, None)
    reason, caught = _load_twice()
    assert len(caught) == 1
    assert "drmoo_kernels._C is not installed" in str(caught[0].message)
    assert reason is not None and "pip install --no-build-isolation" in reason


def test_a_good_load_does_not_warn(fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, RUNNING.split("+")[0]))
    attempts = _fail_import(monkeypatch, None)
    monkeypatch.setattr(_ops, "_register_fakes", lambda: None)
    reason, caught = _load_twice()
    assert reason is None and caught == [] and attempts == [_ops.EXTENSION]


@pytest.mark.parametrize(("built", "running", "same"), [
    ("2.14.1", "2.14.1+cu130", True), ("2.14.1", "2.14.1", True), ("2.14.0", "2.14.1", False),
    ("2.14.1", "2.13.0+cpu", False), ("2.11.0", "2.11.0a0+git5d1e2b4", True),
])
def test_versions_match_by_release(built: str, running: str, same: bool) -> None:
    assert _ops._same_release(built, running) is same


def test_a_stable_abi_build_loads_under_every_torch_from_its_target(
        fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Built with a newer torch's headers, for the stable ABI of an older one (ours: built with the
    pinned torch, target = the oldest supported): imported, no warning."""
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, "99.0.0", stable_target="2.11"))
    attempts = _fail_import(monkeypatch, None)
    monkeypatch.setattr(_ops, "_register_fakes", lambda: None)
    reason, caught = _load_twice()
    assert reason is None and caught == [] and attempts == [_ops.EXTENSION]


def test_a_stable_abi_build_for_a_newer_torch_is_refused(fresh_loader: None, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, "99.1.0", stable_target="99.0"))
    attempts = _fail_import(monkeypatch, None)
    reason, caught = _load_twice()
    assert attempts == [] and len(caught) == 1
    assert f"built for the stable ABI of torch >= 99.0 (against torch 99.1.0), but torch {RUNNING}" in reason


def _cuda_load(monkeypatch: pytest.MonkeyPatch) -> tuple[str | None, list[warnings.WarningMessage]]:
    """load_cuda() twice, with _C counted as loaded already."""
    monkeypatch.setitem(_ops._load_reasons, _ops.EXTENSION, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = _ops.load_cuda()
        assert _ops.load_cuda() == reason
    return reason, [w for w in caught if issubclass(w.category, KernelsUnavailableWarning)]


def test_a_stable_cuda_build_loads_under_every_torch_from_its_target(
        fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """_C_cuda built with a newer torch's headers for the stable ABI of an older one (as csrc/cuda/module.cpp
    marks it): imported under the running torch, which is older than the build's but not than its target."""
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, "99.0.0", stable_target="2.11"), _ops.CUDA_EXTENSION)
    attempts = _fail_import(monkeypatch, None, _ops.CUDA_EXTENSION)
    reason, caught = _cuda_load(monkeypatch)
    assert reason is None and caught == [] and attempts == [_ops.CUDA_EXTENSION]


def test_a_stable_cuda_build_for_a_newer_torch_is_refused(fresh_loader: None, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, "99.1.0", stable_target="99.0"), _ops.CUDA_EXTENSION)
    attempts = _fail_import(monkeypatch, None, _ops.CUDA_EXTENSION)
    reason, caught = _cuda_load(monkeypatch)
    assert reason is not None and attempts == [] and len(caught) == 1
    message = str(caught[0].message)
    assert (f"drmoo_kernels._C_cuda was built for the stable ABI of torch >= 99.0 (against torch 99.1.0), but "
            f"torch {RUNNING} is running") in message
    assert "CUDA kernels are not available" in message


def test_a_cuda_build_for_another_torch_is_not_loaded_and_warns_once(
        fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An older drmoo's regular-ABI _C_cuda (no stable marker): the same-release rule, not the stable one."""
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, "2.9.0"), _ops.CUDA_EXTENSION)
    attempts = _fail_import(monkeypatch, None, _ops.CUDA_EXTENSION)
    reason, caught = _cuda_load(monkeypatch)
    assert reason is not None and attempts == [] and len(caught) == 1
    message = str(caught[0].message)
    assert f"drmoo_kernels._C_cuda was built against torch 2.9.0, but torch {RUNNING} is running" in message
    assert "CUDA kernels are not available" in message and "pip install --no-build-isolation" in message


def test_a_regular_abi_cuda_build_for_the_running_torch_loads(fresh_loader: None,
                                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_extension(monkeypatch, _so_with_marker(tmp_path, RUNNING.split("+")[0]), _ops.CUDA_EXTENSION)
    attempts = _fail_import(monkeypatch, None, _ops.CUDA_EXTENSION)
    reason, caught = _cuda_load(monkeypatch)
    assert reason is None and caught == [] and attempts == [_ops.CUDA_EXTENSION]


def test_a_build_without_cuda_kernels_is_a_reason_not_a_warning(fresh_loader: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_extension(monkeypatch, None, _ops.CUDA_EXTENSION)
    reason, caught = _cuda_load(monkeypatch)
    assert caught == [] and reason is not None and "without its CUDA kernels" in reason


def test_the_real_extension_is_a_stable_abi_build_for_the_oldest_supported_torch() -> None:
    """What this process loaded: built with some torch >= the target, for the stable ABI of torch 2.11 (the
    oldest supported), so it loads here whether this is the torch that built it or not."""
    from drmoo_kernels._compat import MIN_TORCH, release

    spec = importlib.util.find_spec(_ops.EXTENSION)
    if spec is None or spec.origin is None:
        pytest.fail("drmoo_kernels._C is not built (pip install --no-build-isolation . or "
                    "python setup.py build_ext --inplace)")
    assert _ops.stable_abi_target(spec.origin) == ".".join(map(str, MIN_TORCH))
    built = _ops.built_with_torch(spec.origin)
    assert built is not None and release(built)[:2] >= MIN_TORCH
    assert _ops.load() is None


def _cuda_extension_path() -> str:
    """The built drmoo_kernels._C_cuda (skips where it is not built: DRMOO_BUILD_CUDA=0, no GPU at build time)."""
    spec = importlib.util.find_spec(_ops.CUDA_EXTENSION)
    if spec is None or spec.origin is None:
        pytest.skip("drmoo_kernels._C_cuda is not built (DRMOO_BUILD_CUDA=1 python setup.py build_ext --inplace)")
    return spec.origin


def test_the_real_cuda_extension_is_a_stable_abi_build_for_the_oldest_supported_torch() -> None:
    """The built _C_cuda carries _C's markers (csrc/cuda/module.cpp): built with some torch >= the target, for
    the stable ABI of torch 2.11, so the loader accepts it under any torch >= 2.11, not only its own."""
    from drmoo_kernels._compat import MIN_TORCH, release

    path = _cuda_extension_path()
    assert _ops.stable_abi_target(path) == ".".join(map(str, MIN_TORCH))
    built = _ops.built_with_torch(path)
    assert built is not None and release(built)[:2] >= MIN_TORCH
    assert _ops._version_problem(_ops.CUDA_EXTENSION, path, ".".join(map(str, MIN_TORCH)) + ".0") is None
    assert "stable ABI of torch >= 2.11" in str(_ops._version_problem(_ops.CUDA_EXTENSION, path, "2.10.0"))


@pytest.mark.parametrize("extension", [_ops.EXTENSION, _ops.CUDA_EXTENSION])
def test_the_stable_abi_build_imports_no_torch_cxx_symbol(extension: str) -> None:
    """What makes _C and _C_cuda loadable under another torch: besides Python's, the C++ runtime's (and,
    for _C_cuda, the CUDA runtime's), their only imports are the C shim's functions (aoti_torch_*, torch_*),
    never a mangled c10::/at::/torch:: C++ symbol, whose ABI changes between torch releases.
    (scripts/test_oldest.sh runs this under torch 2.11, where each of those functions must also resolve:
    the import above would fail otherwise.)"""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    if extension == _ops.CUDA_EXTENSION:
        origin = _cuda_extension_path()
    else:
        spec = importlib.util.find_spec(extension)
        assert spec is not None and spec.origin is not None
        origin = spec.origin
    listed = subprocess.run([nm, "-D", "--undefined-only", origin], capture_output=True, text=True, check=True)
    imported = [line.split()[-1] for line in listed.stdout.splitlines() if line.strip()]
    torch_cxx = [name for name in imported if name.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch", "_ZNK3c10",
                                                               "_ZNK2at", "_ZNK5torch"))]
    assert torch_cxx == []
    assert any(name.startswith("aoti_torch_") for name in imported)
    assert not any(name.startswith("_ZN") and "torch" in name for name in imported)
    if extension == _ops.CUDA_EXTENSION:
        # The current stream comes from the C shim, not from c10::cuda (docs/install.md, "One build for every
        # supported torch"); the kernels launch through the CUDA runtime.
        assert "aoti_torch_get_current_cuda_stream" in imported
        assert any(name.startswith("__cudaLaunchKernel") for name in imported)


def test_choosing_the_reference_backend_never_loads_the_extension(fresh_loader: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from drmoo_kernels import resolve_backend

    _fake_extension(monkeypatch, None)
    monkeypatch.setenv("DRMOO_BACKEND", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelsUnavailableWarning)
        assert resolve_backend(None, "cpu") == "reference"
    assert _ops._load_reasons == {}
