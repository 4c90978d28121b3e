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

__all__ = ["interpreter_problem", "load_kernels", "triton_interpreted"]

_LOCK = threading.Lock()
_MODULE: ModuleType | None = None
_INTERPRETER_PROBLEM: list[str | None] = []  # empty until probed


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


def interpreter_problem() -> str | None:
    """None when the interpreter runs the kernels here, else why not (probed once per process).

    Triton 3.6's interpreter converts a loop bound with ``int()`` of a 1-element array, which
    numpy 2.4 turned into an error: every kernel with a runtime loop bound fails there.
    """
    if not _INTERPRETER_PROBLEM:
        import numpy
        import torch
        import triton

        out = torch.zeros(1, dtype=torch.int32)
        try:
            load_kernels().loop_bound_probe_kernel[(1,)](out, 3)
        except Exception as error:  # the interpreter wraps what failed in its own error type
            _INTERPRETER_PROBLEM.append(
                f"Triton {triton.__version__}'s interpreter cannot run the kernels with numpy {numpy.__version__} "
                f"({type(error).__name__}: {error}); with Triton 3.6 install numpy<2.4"
            )
        else:
            _INTERPRETER_PROBLEM.append(None if int(out[0]) == 3 else "the Triton interpreter miscounted a loop")
    return _INTERPRETER_PROBLEM[0]
