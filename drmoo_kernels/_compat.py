"""The supported torch / Triton range (docs/install.md, "Supported versions"), checked when drmoo is imported.

Lower bounds only: torch 2.11 and Triton 3.6 are what current GPU images ship and what the CI
matrix's second leg installs (scripts/test_oldest.sh); the pinned development torch
(requirements-dev.txt) is the upper end that is tested.  An older torch is refused at
``import drmoo_kernels`` with an ImportError: an untested torch does not fail loudly, a behaviour
difference there shows up as wrong numbers (torch 2.11 itself silently zeroed some heads' gradients
before the optimizers were fixed for it).  Triton is optional: an older Triton only makes the
``triton`` backend unavailable, with the reason.

pyproject.toml declares the same bounds; tests/test_supported_versions.py keeps the two in step.
"""

from __future__ import annotations

import importlib.metadata
import re

MIN_TORCH: tuple[int, int] = (2, 11)
MIN_TRITON: tuple[int, int] = (3, 6)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.11.0+cu130" -> (2, 11, 0), "2.12.0a0+git1" -> (2, 12, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _dotted(parts: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in parts)


def torch_version_problem(version: str) -> str | None:
    """Why torch ``version`` is not supported, or None when it is.

    Pre-releases of a supported minor version (nightlies, source builds such as "2.11.0a0+git") count
    as that version.
    """
    if release(version)[:2] >= MIN_TORCH:
        return None
    return (
        f"drmoo needs torch >= {_dotted(MIN_TORCH)}, but torch {version} is installed. Older torch versions are "
        f"not tested and can train wrongly without an error. Upgrade torch, e.g. "
        f"pip install 'torch>={_dotted(MIN_TORCH)}' (see docs/install.md, 'Supported versions')."
    )


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError when the installed torch (or ``version``) is older than MIN_TORCH."""
    if version is None:
        import torch

        version = str(torch.__version__)
    problem = torch_version_problem(version)
    if problem is not None:
        raise ImportError(problem)


def installed_triton_version() -> str | None:
    """The installed triton's version from its package metadata (triton itself is not imported), or None."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_version_problem(version: str | None = None) -> str | None:
    """Why the installed triton (or ``version``) cannot back the ``triton`` backend; None when it can or is absent."""
    if version is None:
        version = installed_triton_version()
        if version is None:
            return None
    if release(version)[:2] >= MIN_TRITON:
        return None
    return (
        f"triton {version} is older than the supported {_dotted(MIN_TRITON)} (the Triton kernels are tested with "
        f"triton >= {_dotted(MIN_TRITON)}); pip install 'triton>={_dotted(MIN_TRITON)}'"
    )
