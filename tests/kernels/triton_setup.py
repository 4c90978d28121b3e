"""Importing Triton for the triton-backend tests: compiled on a GPU, interpreted on a CPU-only machine.

Triton fixes interpreted vs compiled execution when it is first imported (its ``tl.zeros``,
``tl.sum``... are decorated then), so :func:`import_triton` sets ``TRITON_INTERPRET=1`` before the
import and puts the variable back as it was right after: other test modules must not see the triton
backend become "available" on a CPU-only machine.  While a triton test module runs,
:func:`interpreter_flag` sets it again, because the dispatcher (``backend="triton"``) checks it.

Loaded by path from the test modules (tests/ is not a package; pytest imports with importlib).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch


class TritonSetup(NamedTuple):
    interpreted: bool  # no CUDA device: kernels run in Triton's interpreter on CPU tensors
    device: torch.device  # where the tests put their tensors
    skip_reason: str | None  # why the triton tests cannot run here, or None


def import_triton() -> TritonSetup:
    """Import triton (interpreted without a CUDA device) and say whether its tests can run."""
    interpreted = not torch.cuda.is_available()
    device = torch.device("cpu" if interpreted else "cuda")
    saved_flag = os.environ.get("TRITON_INTERPRET")
    if interpreted:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        try:
            import triton  # noqa: F401
        except ImportError as error:  # pragma: no cover - depends on the environment
            return TritonSetup(interpreted, device, f"triton is not importable here ({error})")
        from drmoo_kernels.triton_kernels import triton_interpreted

        if interpreted and not triton_interpreted():
            return TritonSetup(interpreted, device, (
                "no CUDA device, and triton was already imported in compiled mode by something earlier in this "
                "process, before this module could set TRITON_INTERPRET=1 (run this file on its own)"
            ))
        return TritonSetup(interpreted, device, None)
    finally:
        if saved_flag is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_flag


def interpreter_flag(interpreted: bool) -> Iterator[None]:
    """Body of a module-scoped fixture: TRITON_INTERPRET=1 while that module's tests run."""
    with pytest.MonkeyPatch.context() as patch:
        if interpreted:
            patch.setenv("TRITON_INTERPRET", "1")
        yield
