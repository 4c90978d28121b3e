"""Loader of the Triton kernels (``_kernels.py``), kept free of any triton import until first use.

Triton decides compiled vs interpreted execution when a function is decorated with ``triton.jit``,
and its own library functions (``tl.zeros``, ``tl.sum``, ``tl.sigmoid``...) are decorated when
``triton.language`` is first imported.  The mode is therefore fixed for the whole process by the
value of ``TRITON_INTERPRET`` at the first ``import triton``; the drmoo kernels are decorated in
that same mode, whatever the variable says later, so that the two halves always agree.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

__all__ = ["load_kernels", "triton_interpreted"]

_LOCK = threading.Lock()
_MODULE: ModuleType | None = None


def triton_interpreted() -> bool:
    """Whether triton's language library was loaded in interpreter mode (imports triton)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def load_kernels() -> ModuleType:
    """The kernel module, decorated in the mode triton itself was imported in."""
    global _MODULE
    with _LOCK:
        if _MODULE is None:
            from triton import knobs

            interpret = triton_interpreted()
            # knobs.runtime.scope() restores the knob and the TRITON_INTERPRET variable afterwards.
            with knobs.runtime.scope():
                knobs.runtime.interpret = interpret
                _MODULE = importlib.import_module(f"{__name__}._kernels")
        return _MODULE
