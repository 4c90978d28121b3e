"""Warnings of drmoo_kernels, in a module of their own: importing it must not import the compiled
ops' module (``_ops`` decorates a function with ``torch.compiler``, which imports torch._dynamo and,
through it, Triton when it is installed; ``import drmoo_kernels`` must stay light)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["KernelsUnavailableWarning"]


class KernelsUnavailableWarning(RuntimeWarning):
    """The compiled kernels cannot be used: ``drmoo_kernels._C`` (the CPU kernels: drmoo runs on the ~2x
    slower reference backend) or ``drmoo_kernels._C_cuda`` (the CUDA kernels, e.g. built for another torch).

    Issued once per process and extension, at the first use of a compiled backend, with the reason and the fix.
    Choosing ``DRMOO_BACKEND=reference`` (or ``backend="reference"``) never loads the extension and
    so never warns; ``warnings.filterwarnings("ignore", category=KernelsUnavailableWarning)`` silences it.
    """


# ------------------------------------------------------------------------- where a warning points
_PACKAGES_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds drmoo_kernels/ and drmoo/
_OWN_DIRS = tuple(os.path.join(_PACKAGES_DIR, package) + os.sep for package in ("drmoo_kernels", "drmoo"))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the user's line.

    That is the first frame outside drmoo, drmoo_kernels, torch (whose optimizer wrapper calls
    ``step``) and the import machinery: a fixed ``stacklevel`` would point at whichever drmoo line the
    first use happened to come through (``_ops.py`` for an optimizer built with the default backend).
    """
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)  # None while torch is not imported (or has no file)
    skipped = _OWN_DIRS + ((os.path.dirname(os.path.abspath(torch_file)) + os.sep,) if torch_file else ())
    frame = sys._getframe(1)  # the caller's frame: stacklevel 1
    level = 1
    while frame.f_back is not None and (
            os.path.abspath(frame.f_code.co_filename).startswith(skipped) or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
        level += 1
    return level


# ----------------------------------------------------------------- questions that must not warn
_questions_asked = 0


@contextlib.contextmanager
def only_asking() -> Iterator[None]:
    """Inside: the kernels' availability is only asked about (``available_backends()``), so a failed load
    is not warned about yet; the warning comes at the first real use, pointing there."""
    global _questions_asked
    _questions_asked += 1
    try:
        yield
    finally:
        _questions_asked -= 1


def only_asking_now() -> bool:
    return _questions_asked > 0
