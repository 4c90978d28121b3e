"""scripts/release_check.sh refuses what must never reach PyPI, naming the problem.

The passing case runs on the real dist/ in scripts/test.sh (after scripts/setup_env.sh built it); here each
refusal is provoked on a hand-made dist folder, which the script rejects before calling twine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^__version__ = "([^"]+)"$', (REPO / "python/drmoo/_version.py").read_text(), re.M).group(1)  # type: ignore[union-attr]

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or not (REPO / ".venv/bin/twine").exists(),
    reason="needs bash and the development venv's twine (scripts/setup_env.sh)",
)


def _wheel(folder: Path, name: str, *, kernels: bool = True) -> None:
    with zipfile.ZipFile(folder / name, "w") as archive:
        metadata = f"Metadata-Version: 2.4\nName: drmoo\nVersion: {VERSION}\n"
        archive.writestr(f"drmoo-{VERSION}.dist-info/METADATA", metadata)
        if kernels:
            archive.writestr("drmoo_kernels/_C.abi3.so", b"\x7fELF")


def _sdist(folder: Path) -> None:
    source = folder / "src" / f"drmoo-{VERSION}"
    (source / "csrc").mkdir(parents=True)
    (source / "csrc" / "ops.cpp").write_text("// kernels\n")
    (source / "PKG-INFO").write_text(f"Metadata-Version: 2.4\nName: drmoo\nVersion: {VERSION}\n")
    with tarfile.open(folder / f"drmoo-{VERSION}.tar.gz", "w:gz") as archive:
        archive.add(source, arcname=source.name)
    shutil.rmtree(folder / "src")


def _check(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "DRMOO_"))}
    return subprocess.run(
        ["bash", str(REPO / "scripts/release_check.sh")], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**clean, "DRMOO_VENV": str(REPO / ".venv"), "DRMOO_WHEEL_DIR": str(folder), **env},
    )


def test_a_kernel_less_wheel_is_refused(tmp_path: Path) -> None:
    _wheel(tmp_path, f"drmoo-{VERSION}+nokernels-py3-none-any.whl", kernels=False)
    _sdist(tmp_path)
    done = _check(tmp_path)
    assert done.returncode == 1
    assert f"is not drmoo-{VERSION}-cp310-abi3-manylinux_2_NN_x86_64.whl" in done.stderr


def test_a_wheel_without_the_compiled_kernels_is_refused(tmp_path: Path) -> None:
    _wheel(tmp_path, f"drmoo-{VERSION}-cp310-abi3-manylinux_2_34_x86_64.whl", kernels=False)
    _sdist(tmp_path)
    done = _check(tmp_path)
    assert done.returncode == 1
    assert "the wheel lacks the compiled kernels, drmoo_kernels/_C.abi3.so" in done.stderr


def test_a_missing_sdist_is_refused(tmp_path: Path) -> None:
    _wheel(tmp_path, f"drmoo-{VERSION}-cp310-abi3-manylinux_2_34_x86_64.whl")
    done = _check(tmp_path)
    assert done.returncode == 1 and "must hold one drmoo wheel and one sdist" in done.stderr


def test_a_tag_of_another_version_is_refused(tmp_path: Path) -> None:
    done = _check(tmp_path, GITHUB_REF_TYPE="tag", GITHUB_REF_NAME="v99.0.0")
    assert done.returncode == 1
    assert f"the tag is v99.0.0, but python/drmoo/_version.py says {VERSION}" in done.stderr
