"""Where a run was made: ``environment.json`` in every run directory, one entry per training session.

A run's floats depend on more than its settings: torch's CPU kernels pick their vector code (AVX2,
AVX-512, ...) by the CPU they run on, reductions split their work by torch's thread count, and
torch releases change kernels.  A retrain repeats a run bit for bit only with the same CPU type (or
GPU), the same number of threads and the same torch; anywhere else it agrees only statistically (the
committed runs retrained on another CPU diverged from step 9-20 and ended within the seed spread).
So the trainer records, at the start of every session (a fresh run, then each ``--resume``), what
decides that:

``drmoo`` and ``torch`` versions, ``python``; ``kernel_backend`` (drmoo's resolved kernel set);
``device``, ``torch_threads`` (``torch.get_num_threads()``) and ``world_size`` (processes);
``cpu_model`` (``/proc/cpuinfo``'s model name) and ``cpu_isa`` (the vector code torch's CPU kernels
use here, ``torch.backends.cpu.get_cpu_capability()``); ``gpu`` and ``cuda`` (None on a CPU);
``platform``; and ``from_step``, the step the session started from.  ``drmoo report`` shows them.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from drmoo import __version__, distributed
from drmoo.store import UsageError, read_json, read_text, write_json

__all__ = ["ENVIRONMENT", "MAX_SESSIONS", "cpu_model", "describe_environment", "read_environment",
           "record_environment", "same_arithmetic"]

ENVIRONMENT = "environment.json"  # in the run directory
MAX_SESSIONS = 1000  # sessions kept (the first and the latest): a run resumed more often than this is odd
# The fields on which a retrain's floats depend: two sessions alike on all of them compute the same bits.
ARITHMETIC_FIELDS = ("torch", "kernel_backend", "device", "torch_threads", "world_size", "cpu_model", "cpu_isa", "gpu")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of it."""
    try:
        for line in read_text(Path("/proc/cpuinfo"), what="CPU description").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, ValueError):  # no /proc (not Linux), or refused by the store: platform's name
        pass
    return platform.processor() or platform.machine()


def describe_environment(device: torch.device, kernel_backend: str) -> dict[str, Any]:
    """This process's environment as a session of ``environment.json`` records it (``from_step`` aside)."""
    cuda = device.type == "cuda"
    return {
        "recorded": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "drmoo": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "kernel_backend": kernel_backend, "device": str(device), "torch_threads": torch.get_num_threads(),
        "world_size": distributed.world_size(), "cpu_model": cpu_model(),
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(device) if cuda else None, "cuda": torch.version.cuda if cuda else None,
        "platform": platform.platform(),
    }


def read_environment(run_dir: Path) -> list[dict[str, Any]]:
    """The sessions recorded in ``run_dir`` (oldest first); [] when none are, or the file is not drmoo's."""
    path = run_dir / ENVIRONMENT
    if not path.is_file():
        return []
    try:
        recorded = read_json(path, what="environment record")
    except (UsageError, OSError):
        return []
    sessions = recorded.get("sessions") if isinstance(recorded, dict) else None
    if not isinstance(sessions, list) or not all(isinstance(s, dict) for s in sessions):
        return []
    return sessions


def record_environment(run_dir: Path, step: int, device: torch.device, kernel_backend: str) -> None:
    """Append this session (starting at ``step``) to ``run_dir``'s ``environment.json``.

    The file is history, not a setting: an unreadable one starts a new list rather than stopping a run.
    """
    sessions = read_environment(run_dir) if step > 0 else []  # a fresh run starts a new history
    sessions.append({"from_step": step, **describe_environment(device, kernel_backend)})
    if len(sessions) > MAX_SESSIONS:
        sessions = [sessions[0], *sessions[-(MAX_SESSIONS - 1):]]
    write_json(run_dir / ENVIRONMENT, {"sessions": sessions})


def same_arithmetic(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two sessions compute the same floats from the same settings (:data:`ARITHMETIC_FIELDS` alike)."""
    return all(first.get(key) == second.get(key) for key in ARITHMETIC_FIELDS)
