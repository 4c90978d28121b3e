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
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from drmoo import __version__, distributed
from drmoo.store import UsageError, read_json, read_text

__all__ = ["ENVIRONMENT", "MAX_ENVIRONMENT_BYTES", "MAX_SESSIONS", "cpu_model", "describe_environment",
           "distinct_environments", "environment_record", "read_environment", "read_sessions", "same_arithmetic"]

ENVIRONMENT = "environment.json"  # in the run directory
MAX_SESSIONS = 1000  # sessions kept (the first and the latest): a run resumed more often than this is odd
# What the trainer can write: a session is about 450 bytes (its longest fields are the CPU's and the
# platform's names), so 1,000 of them are about 0.45 MB; 2 MiB leaves room for long names.  A larger
# file is not drmoo's record and is refused before it is parsed.
MAX_ENVIRONMENT_BYTES = 2 << 20
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


def read_sessions(path: Path) -> list[dict[str, Any]]:
    """The sessions of the environment record ``path`` (oldest first), read bounded.

    Refused (:class:`~drmoo.store.UsageError`, one line) when it is not a regular file, holds more than
    :data:`MAX_ENVIRONMENT_BYTES` (checked before anything is parsed), is not a list of sessions, or
    lists more than the :data:`MAX_SESSIONS` the trainer keeps.
    """
    recorded = read_json(path, MAX_ENVIRONMENT_BYTES, "environment record")
    sessions = recorded.get("sessions") if isinstance(recorded, dict) else None
    if not isinstance(sessions, list) or not all(isinstance(s, dict) for s in sessions):
        raise UsageError(f"{path} is not a drmoo environment record (no list of sessions)")
    if len(sessions) > MAX_SESSIONS:
        raise UsageError(f"{path} lists {len(sessions)} training sessions, more than the {MAX_SESSIONS} drmoo keeps: "
                         "not drmoo's record (edited or crafted); refused")
    return sessions


def read_environment(run_dir: Path) -> list[dict[str, Any]]:
    """The sessions recorded in ``run_dir`` (oldest first); [] when none are, or the file is not drmoo's."""
    path = run_dir / ENVIRONMENT
    if not path.is_file():
        return []
    try:
        return read_sessions(path)
    except (UsageError, OSError):
        return []


def environment_record(run_dir: Path, step: int, device: torch.device, kernel_backend: str) -> dict[str, Any]:
    """``run_dir``'s ``environment.json`` with this session (starting at ``step``) appended: what the
    trainer writes (it writes every file of a session's start together, after checking each can be).

    The file is history, not a setting: an unreadable one starts a new list rather than stopping a run.
    """
    sessions = read_environment(run_dir) if step > 0 else []  # a fresh run starts a new history
    sessions.append({"from_step": step, **describe_environment(device, kernel_backend)})
    if len(sessions) > MAX_SESSIONS:
        sessions = [sessions[0], *sessions[-(MAX_SESSIONS - 1):]]
    return {"sessions": sessions}


def same_arithmetic(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two sessions compute the same floats from the same settings (:data:`ARITHMETIC_FIELDS` alike)."""
    return _arithmetic_key(first) == _arithmetic_key(second)


def _arithmetic_key(session: dict[str, Any]) -> tuple[Any, ...]:
    """The session's :data:`ARITHMETIC_FIELDS`, hashable (a value that is not a JSON scalar by its repr)."""
    return tuple(value if isinstance(value, (str, int, float, type(None))) else repr(value)
                 for value in (session.get(key) for key in ARITHMETIC_FIELDS))


def distinct_environments(sessions: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first session of each distinct environment (:func:`same_arithmetic`), in order; one pass, keyed
    by a dict: linear in the number of sessions."""
    first: dict[tuple[Any, ...], dict[str, Any]] = {}
    for session in sessions:
        first.setdefault(_arithmetic_key(session), session)
    return list(first.values())
