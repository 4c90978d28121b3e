"""The repository's layout is the design card's, and the trap that layout sets is loud.

The card (DESIGN.md, "Layers and layout") puts ``drmoo_kernels/`` at the top level, beside ``csrc/`` and
``python/``.  setuptools still sees one import root, ``python/``: ``python/drmoo_kernels`` is a committed
link to ``../drmoo_kernels``, so an editable install stays one static .pth entry (tests/test_packaging.py,
the editable install run from a folder that holds a ``drmoo/`` clone).

The trap: run from the repository's root, Python puts the working directory (``python -c``, ``python -m``)
or the script's folder first on sys.path, so ``import drmoo_kernels`` finds the top-level source folder --
never compiled there -- instead of the installed, compiled package, while ``drmoo`` still comes from
site-packages: a silent mix on the ~2x slower reference backend.  The missing-kernels warning now says
which folder shadows which.  Both packages are fabricated in tmp_path (a fake ``_C.abi3.so`` is enough:
the shadowed build is found, never loaded), so these tests need no compiled kernels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import drmoo
import drmoo_kernels

REPO = Path(__file__).resolve().parents[1]


def test_drmoo_kernels_is_a_top_level_folder_that_python_links_to() -> None:
    top = REPO / "drmoo_kernels"
    assert top.is_dir() and not top.is_symlink(), "drmoo_kernels/ must be a real folder at the repository's root"
    assert (top / "__init__.py").is_file() and (top / "py.typed").is_file()
    link = REPO / "python" / "drmoo_kernels"
    assert link.is_symlink(), "python/drmoo_kernels must be a link (setuptools' one import root is python/)"
    assert os.readlink(link) == "../drmoo_kernels", "a relative link, so that copies of the checkout keep it"
    assert link.resolve() == top.resolve()
    assert (REPO / "python" / "drmoo").is_dir() and not (REPO / "python" / "drmoo").is_symlink()


def _package_copy(destination: Path, compiled: bool) -> Path:
    """A copy of the imported drmoo_kernels' sources at ``destination/drmoo_kernels``, with a stand-in
    ``_C.abi3.so`` when ``compiled``, with no shared object at all otherwise."""
    source = Path(drmoo_kernels.__file__).resolve().parent
    package = destination / "drmoo_kernels"
    shutil.copytree(source, package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if compiled:
        (package / "_C.abi3.so").write_bytes(b"a compiled build (found, never loaded)")
    return package


def _python(arguments: list[str], cwd: Path, path: list[Path]) -> subprocess.CompletedProcess[str]:
    """Python in ``cwd`` with only ``path`` added to sys.path (PYTHONPATH), warnings shown every time."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "DRMOO_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(str(folder) for folder in path)
    return subprocess.run([sys.executable, "-W", "always", *arguments], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


LOAD = "import drmoo_kernels, drmoo_kernels._ops as ops; print(drmoo_kernels.__file__); ops.load()"


def test_an_uncompiled_checkout_that_shadows_an_installed_build_says_so(tmp_path: Path) -> None:
    """`python -c` at a checkout's root, with the compiled drmoo_kernels further down sys.path: the warning
    names both folders and what to do (before: "drmoo_kernels._C is not installed ... rebuild drmoo")."""
    checkout = _package_copy(tmp_path / "checkout", compiled=False)
    installed = _package_copy(tmp_path / "site-packages", compiled=True)
    ran = _python(["-c", LOAD], cwd=checkout.parent, path=[installed.parent])
    assert ran.returncode == 0, ran.stderr
    assert Path(ran.stdout.split()[0]).parent == checkout  # the trap: '' comes first
    warning = " ".join(ran.stderr.split())
    assert "KernelsUnavailableWarning" in warning, ran.stderr
    assert f"drmoo_kernels._C is not in {checkout}, the drmoo_kernels this process imported" in warning
    assert f"the drmoo_kernels in {installed} has it (_C.abi3.so)" in warning
    assert f"the uncompiled folder {checkout.parent} comes first on sys.path" in warning
    assert "run from another folder, or build the kernels in place there" in warning


def test_the_shadowing_warning_points_at_the_users_line(tmp_path: Path) -> None:
    """A script at the checkout's root imports the top-level drmoo_kernels but drmoo from elsewhere: the warning
    still points at the script's line, not at a line of drmoo (which used to be found only beside
    drmoo_kernels' own folder)."""
    checkout = _package_copy(tmp_path / "checkout", compiled=False)
    installed = _package_copy(tmp_path / "site-packages", compiled=True)
    (installed.parent / "drmoo").symlink_to(Path(drmoo.__file__).resolve().parent)
    script = checkout.parent / "train.py"
    script.write_text("import torch\nfrom drmoo.optim import MGDA\n\n"
                      "MGDA(torch.nn.Linear(3, 2).parameters(), num_tasks=2)\n")
    ran = _python([str(script)], cwd=checkout.parent, path=[installed.parent])
    assert ran.returncode == 0, ran.stderr
    assert f"{script}:4: KernelsUnavailableWarning: " in ran.stderr, ran.stderr
    assert f"the drmoo_kernels in {installed} has it" in " ".join(ran.stderr.split())
