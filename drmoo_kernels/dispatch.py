"""Backend selection: which implementation of the drmoo ops a call runs.

Backends, each a module exposing the ops of :mod:`drmoo_kernels.reference` plus
``availability() -> str | None`` (``None`` when usable, else the reason it is not):

* ``reference`` - pure torch, any device, the semantics every other backend is tested against;
* ``cpp``       - the compiled CPU kernels in ``drmoo_kernels._C`` (csrc/);
* ``cuda``      - the compiled CUDA kernels in ``drmoo_kernels._C_cuda`` (csrc/cuda/);
* ``triton``    - Triton kernels (GPU; CPU only under ``TRITON_INTERPRET=1``, for tests).

Choice: an explicit ``backend=`` argument, else the ``DRMOO_BACKEND`` environment variable, else the
fastest available one for the tensors' device.  Asking for an unknown or unavailable backend is a
``ValueError`` / ``RuntimeError`` that says why.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from ._warnings import only_asking

__all__ = ["BACKENDS", "available_backends", "backend_module", "resolve_backend", "why_unavailable"]

BACKENDS: tuple[str, ...] = ("reference", "cpp", "cuda", "triton")

_MODULES = {
    "reference": "drmoo_kernels.reference",
    "cpp": "drmoo_kernels.backends.cpp",
    "cuda": "drmoo_kernels.backends.cuda",
    "triton": "drmoo_kernels.backends.triton",
}

# Preference order for automatic selection, per device type.
_AUTO_ORDER = {"cpu": ("cpp", "reference"), "cuda": ("cuda", "triton", "reference")}


def _load(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as error:
        return None, f"its module is missing ({error})"
    except ImportError as error:  # e.g. a compiled extension that fails to load
        return None, f"it failed to import ({error})"
    availability = getattr(module, "availability", None)
    reason = availability() if availability is not None else None
    return (module, None) if reason is None else (None, reason)


def why_unavailable(name: str) -> str | None:
    """``None`` if backend ``name`` can run here, else a sentence saying why it cannot.

    Args:
        name: one of :data:`BACKENDS`; another name raises ValueError.
    """
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; valid choices: {', '.join(BACKENDS)}")
    return _load(name)[1]


def available_backends() -> list[str]:
    """The backends that can run on this machine, in :data:`BACKENDS` order.

    Only a question: a kernel load that fails here warns at the first use of a backend, not here.
    """
    with only_asking():
        return [name for name in BACKENDS if why_unavailable(name) is None]


def resolve_backend(requested: str | None, device: torch.device | str) -> str:
    """The backend to use for tensors on ``device``: explicit, else ``DRMOO_BACKEND``, else auto.

    Args:
        requested: a backend name, or None for ``DRMOO_BACKEND`` or else the fastest one available.
        device: where the tensors are; a named backend that cannot run there raises RuntimeError.
    """
    device = torch.device(device)
    name = requested or os.environ.get("DRMOO_BACKEND") or None
    if name is not None:
        name = name.strip().lower()
        reason = why_unavailable(name)
        if reason is not None:
            raise RuntimeError(
                f"drmoo backend {name!r} is not available: {reason}. "
                f"Available here: {', '.join(available_backends())}"
            )
        if name == "cpp" and device.type != "cpu":
            raise RuntimeError(f"backend 'cpp' runs on CPU tensors, but the tensors are on {device}")
        if name == "cuda" and device.type != "cuda":
            raise RuntimeError(f"backend 'cuda' runs on CUDA tensors, but the tensors are on {device}")
        return name
    for candidate in _AUTO_ORDER.get(device.type, ("reference",)):
        if why_unavailable(candidate) is None:
            return candidate
    return "reference"


def backend_module(name: str) -> ModuleType:
    """The module implementing backend ``name`` (raises if it is not available)."""
    module, reason = _load(name) if name in _MODULES else (None, "unknown")
    if module is None:
        raise RuntimeError(f"drmoo backend {name!r} is not available: {reason}")
    return module
