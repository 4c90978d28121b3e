"""Count what a training step asks of the device: aten ops (launches, roughly) and host syncs.

``OpCounter`` is a ``TorchDispatchMode``: every aten op that reaches the dispatcher's Python key while it
is active -- forward, autograd's backward (the engine carries the mode into its threads), vmapped
backwards (after their batching rules: the ops that actually run), optimizer steps -- is counted once,
by name.  Composite ops arrive decomposed, so the counts are the ops that run kernels.  View ops (``view``,
``select``, ``expand``, ``detach``, ...) launch nothing and are counted apart (``views``).

A *host sync* is an op whose result the host must wait for: the scalar reads (``bool(t)``, ``float(t)``,
``int(t)``, ``t.item()`` and ``if t:`` all dispatch ``aten::_local_scalar_dense`` in torch 2.x),
``aten::equal`` / ``aten::allclose`` / ``aten::is_nonzero`` (a Python bool out), the ops whose output
shape depends on values (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``, indexing with a bool mask), and ``Tensor.tolist()`` / ``Tensor.numpy()``, which on a CPU
tensor read memory without dispatching anything (so they are caught by wrapping the two methods while the
counter is active).  A device-to-host copy (``.cpu()``) syncs on a GPU but is a no-op on the CPU; it is
counted when its source is on an accelerator.  Each sync records where it came from: the innermost frame of
the ``drmoo`` package and the drmoo frame that called it (else the innermost frame outside torch).

The counts are exact and the same on any machine for the same code, torch version and shapes of the
control flow: they are not timings.

Usage::

    with OpCounter() as counter:
        step()
    counter.ops_total, counter.views, counter.syncs  # non-view ops, view ops, [Sync(op, where)]
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections import Counter
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNC_OPS", "OpCounter", "PackageDirs", "Sync", "package_dirs"]

# aten ops that make the host wait for the device (by packet name: every overload).
SYNC_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "item", "equal", "allclose", "nonzero", "masked_select", "unique",
    "_unique", "_unique2", "unique_consecutive", "unique_dim", "_assert_async_msg_sync",
})
_PYTHON_READS = ("tolist", "numpy")  # Tensor methods that read memory without an aten op on the CPU


@dataclass(frozen=True)
class Sync:
    """One host sync: the op (or Python read) and where in the code it was issued."""

    op: str
    where: str


@dataclass(frozen=True)
class PackageDirs:
    """Where the code that a sync's origin is sorted by lives: each a real directory, '/'-separated, ending in '/'.

    Decided by the imported packages' own locations, never by a folder name: a checkout (and its venv)
    in a folder named ``drmoo`` puts torch under ``.../drmoo/.venv/...``, which is not drmoo's code.
    """

    drmoo: str
    kernels: str
    torch: str


def _directory_of(module: ModuleType) -> str:
    file = module.__file__
    assert file is not None, f"{module.__name__} has no file"
    return os.path.dirname(os.path.realpath(file)).replace("\\", "/").rstrip("/") + "/"


@functools.cache
def package_dirs() -> PackageDirs:
    """The directories of the imported ``drmoo``, ``drmoo_kernels`` and ``torch`` packages."""
    return PackageDirs(*(_directory_of(importlib.import_module(name)) for name in ("drmoo", "drmoo_kernels", "torch")))


@functools.cache
def _real(path: str) -> str:
    """A code object's file as a real '/'-separated path (``<string>``, ``<frozen ...>``: as they are)."""
    return path if path.startswith("<") else os.path.realpath(path).replace("\\", "/")


def _short(path: str, dirs: PackageDirs) -> str:
    """``drmoo/<path in the package>`` for drmoo's code, else the file's last two path components."""
    real = _real(path)
    if real.startswith(dirs.drmoo):
        return "drmoo/" + real[len(dirs.drmoo):]
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def _origin(frame: FrameType | None, dirs: PackageDirs | None = None) -> str:
    """'drmoo/x.py:LINE function <- drmoo/y.py:LINE caller', or the first frame outside torch."""
    dirs = dirs or package_dirs()
    drmoo_frames: list[str] = []
    fallback = "?"
    while frame is not None:
        path = frame.f_code.co_filename
        real = _real(path)
        here = f"{_short(path, dirs)}:{frame.f_lineno} {frame.f_code.co_name}"
        if real.startswith(dirs.drmoo):
            drmoo_frames.append(here)
            if len(drmoo_frames) == 2:
                break
        elif (fallback == "?" and not real.startswith((dirs.torch, dirs.kernels))
              and os.path.basename(real) != "op_count.py"):
            fallback = here
        frame = frame.f_back
    return " <- ".join(drmoo_frames) if drmoo_frames else fallback


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops (by name), view ops, and host syncs with their origin (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0
        self.syncs: list[Sync] = []
        self._saved: dict[str, Any] = {}

    @property
    def ops_total(self) -> int:
        """Non-view aten ops (each a kernel launch, or a few for the fused multi-tensor ops)."""
        return sum(self.ops.values())

    def sync_origins(self) -> Counter[str]:
        """``{"op @ where": count}`` over the recorded syncs."""
        return Counter(f"{s.op} @ {s.where}" for s in self.syncs)

    def _record_sync(self, op: str) -> None:
        self.syncs.append(Sync(op, _origin(sys._getframe(2))))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.is_view:
            self.views += 1
        else:
            self.ops[name] += 1
        if (name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                 and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and len(args) < 2)
                or (name == "index" and _bool_index(args))
                or (name in ("_to_copy", "copy_") and self._to_host(func, args, kwargs))):
            self._record_sync(name)
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A copy from an accelerator to the CPU (a sync there); never true on a CPU-only run."""
        if func.overloadpacket.__name__ == "copy_":
            dst, src = args[0], args[1]
            return bool(src.device.type != "cpu" and dst.device.type == "cpu")
        device = kwargs.get("device")
        return bool(args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu")

    def __enter__(self) -> OpCounter:
        for method in _PYTHON_READS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def read(tensor: torch.Tensor, *args: Any, _name: str = method, _original: Any = original,
                     **kwargs: Any) -> Any:
                self._record_sync(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, read)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
