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
    slower reference backend) or ``drmoo_kernels._C_cuda`` (the CUDA kernels, e.g. built for a newer torch).

    Issued once per process and extension, at the first use of a compiled backend, with the reason and the fix.
    Choosing ``DRMOO_BACKEND=reference`` (or ``backend="reference"``) never loads the extension and
    so never warns; ``warnings.filterwarnings("ignore", category=KernelsUnavailableWarning)`` silences it.
    """


# ------------------------------------------------------------------------- where a warning points
_KERNELS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _skipped_dirs() -> tuple[str, ...]:
    """The folders of drmoo_kernels, drmoo and torch, as this process imported them.

    drmoo's is asked of the imported module, not derived from this file's: the two need not share a
    parent (a checkout's top-level drmoo_kernels/ beside python/drmoo/, when the checkout's root is on
    sys.path before python/).
    """
    found = [_KERNELS_DIR]
    for name in ("drmoo", "torch"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            found.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(found)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the user's line.

    That is the first frame outside drmoo, drmoo_kernels, torch (whose optimizer wrapper calls
    ``step``) and the import machinery: a fixed ``stacklevel`` would point at whichever drmoo line the
    first use happened to come through (``_ops.py`` for an optimizer built with the default backend).
    """
    skipped = _skipped_dirs()
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
