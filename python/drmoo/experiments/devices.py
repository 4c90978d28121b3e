"""Where a run executes: its device, the kernel backend there, and the process group torchrun describes.

Each refusal is one line naming the option (``--device``, ``--backend``), given before anything is
written.  Under torchrun (``WORLD_SIZE`` > 1) every process joins one group, one GPU per process with
NCCL or gloo between CPU processes, and :func:`agreed` turns one rank's decision (a signal arrived)
into every rank's, so all stop after the same step.
"""

from __future__ import annotations

import os

import torch

from drmoo import distributed
from drmoo.store import UsageError
from drmoo_kernels import resolve_backend, why_unavailable

__all__ = ["agreed", "check_backend", "resolve_device", "setup_distributed"]


def resolve_device(text: str) -> torch.device:
    """``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` as a device this machine has; a clear error otherwise."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown --device {text!r}; valid choices: auto, cpu, cuda, cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device {text}: drmoo runs on cpu or cuda (auto, cpu, cuda, cuda:N)")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {text}: no CUDA GPU is usable on this machine (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_backend(backend: str | None, device: torch.device | None) -> None:
    """Refuse (one line) a kernel backend that does not exist or cannot run on ``device`` here.

    The backend is ``backend`` (``--backend``) when given, else the ``DRMOO_BACKEND`` environment
    variable, which the ops read the same way: both are checked here, and the message names the one
    that chose it.  ``device`` None checks only that the backend can run on this machine at all (the
    device is not known yet, e.g. ``drmoo eval`` before it reads the run).
    """
    name: str | None
    if backend is not None:
        name, source = backend, f"--backend {backend}"
    else:
        name = os.environ.get("DRMOO_BACKEND") or None
        source = f"DRMOO_BACKEND={name}"
    if name is None:
        return
    try:
        if device is None:
            reason = why_unavailable(name.strip().lower())
            if reason is not None:
                raise RuntimeError(f"drmoo backend {name.strip().lower()!r} is not available: {reason}")
        else:
            resolve_backend(name, device)
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        unset = "" if backend is not None else " (unset DRMOO_BACKEND for the automatic choice)"
        raise UsageError(f"{source}: {reason}{unset}") from None


def setup_distributed(device_text: str) -> tuple[bool, torch.device]:
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns (created it, this process's device)."""
    device = resolve_device(device_text)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return False, device
    if device.type == "cuda":  # one GPU per process, NCCL between them
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True, device


def agreed(flag: bool, device: torch.device) -> bool:
    """True on every rank as soon as it is true on one (a no-op in a single process)."""
    if not distributed.is_distributed():
        return flag
    return bool(distributed.all_reduce_max(torch.tensor([int(flag)], device=device)).item())
