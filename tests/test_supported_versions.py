"""The declared torch / Triton range: refused below it at import, declared the same everywhere.

No old torch is installed for this: the version check is called with version strings, and the
import-time refusal is shown in a subprocess whose torch reports an old ``__version__``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drmoo_kernels import _compat

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.11.0+cpu", "2.11.0a0+git5d1e2b4", "2.14.1",
                                     "2.20.0", "3.0.0"])
def test_supported_torch_versions_pass(version: str) -> None:
    assert _compat.torch_version_problem(version) is None
    _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.1", "2.10.0+cu128", "2.4.0", "1.13.1", "2.9.0a0+gitabc"])
def test_older_torch_is_an_import_error_that_says_what_to_do(version: str) -> None:
    with pytest.raises(ImportError) as raised:
        _compat.check_torch_version(version)
    message = str(raised.value)
    assert f"torch {version} is installed" in message
    assert "torch >= 2.11" in message and "pip install" in message


def test_the_running_torch_is_supported() -> None:
    assert _compat.torch_version_problem(str(torch.__version__)) is None


@pytest.mark.parametrize("statement", ["import drmoo_kernels", "import drmoo.optim",
                                       "import drmoo; drmoo.dual_objective", "from drmoo import optim"])
def test_import_refuses_an_old_torch(statement: str) -> None:
    """Importing drmoo_kernels, or the first use of drmoo, under a torch that reports 2.10 raises ImportError.

    (A bare ``import drmoo`` imports no torch -- ``drmoo --help`` stays fast -- so it has nothing to check yet.)
    """
    code = (
        "import torch\n"
        "torch.__version__ = '2.10.2+cu126'\n"
        "try:\n"
        f"    {statement}\n"
        "except ImportError as error:\n"
        "    print('REFUSED:', error)\n"
        "else:\n"
        "    print('IMPORTED')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO),
                                                       os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "REFUSED: drmoo needs torch >= 2.11, but torch 2.10.2+cu126 is installed" in done.stdout, done.stdout


def test_the_same_import_succeeds_with_the_real_version() -> None:
    """The control of the test above: the subprocess set-up itself imports drmoo fine."""
    code = "import drmoo, drmoo_kernels; print('IMPORTED')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO),
                                                       os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "IMPORTED" in done.stdout


@pytest.mark.parametrize(("version", "ok"), [("3.6.0", True), ("3.8.0", True), ("4.0.1", True),
                                             ("3.5.1", False), ("3.1.0", False), ("2.3.1", False)])
def test_triton_lower_bound(version: str, ok: bool) -> None:
    problem = _compat.triton_version_problem(version)
    if ok:
        assert problem is None
    else:
        assert problem is not None and f"triton {version} is older than the supported 3.6" in problem


def test_no_triton_is_not_a_version_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert _compat.installed_triton_version() is None
    assert _compat.triton_version_problem() is None


def test_an_old_triton_makes_the_triton_backend_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from drmoo_kernels.backends import triton as triton_backend

    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is a test requirement (requirements-dev.txt brings it with torch)")
    monkeypatch.setattr(_compat, "installed_triton_version", lambda: "3.5.0")
    reason = triton_backend.availability()
    assert reason is not None and "triton 3.5.0 is older than the supported 3.6" in reason


def test_pyproject_and_readme_declare_the_same_lower_bounds() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_min = ".".join(str(p) for p in _compat.MIN_TORCH)
    triton_min = ".".join(str(p) for p in _compat.MIN_TRITON)
    dependencies = pyproject[pyproject.index("\ndependencies = [") :]
    dependencies = dependencies[: dependencies.index("]")]
    assert f'"torch>={torch_min}"' in dependencies
    # No torch in the build requirements: build isolation would install a second one (docs/install.md).
    build_requires = re.search(r"^requires = \[(.*)\]$", pyproject, re.M)
    assert build_requires is not None and "torch" not in build_requires.group(1)
    assert re.search(rf'^triton = \["triton>={re.escape(triton_min)}"\]$', pyproject, re.M)
    install_page = (REPO / "docs" / "install.md").read_text()
    section = install_page[install_page.index("## Supported versions"):]
    section = section[: section.find("\n## ", 3)]
    assert f"torch >= {torch_min}" in section and f"Triton >= {triton_min}" in section
    # The oldest versions the CI matrix installs are exactly the declared lower bounds.
    oldest = (REPO / "requirements-oldest.txt").read_text()
    assert re.search(rf"^torch=={re.escape(torch_min)}\.0\s*$", oldest, re.M), oldest
    assert re.search(rf"^triton=={re.escape(triton_min)}\.0\s*$", oldest, re.M), oldest
    pinned = (REPO / "requirements-dev.txt").read_text()
    dev_torch = re.search(r"^torch==(\S+)", pinned, re.M)
    assert dev_torch is not None and _compat.torch_version_problem(dev_torch.group(1)) is None
