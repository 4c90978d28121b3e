"""SIGTERM and Ctrl-C: how the commands that resume stop, and what they tell the user."""

from __future__ import annotations

import signal
from typing import Any

# The commands that go on where they stopped when run again with the same arguments, and what they keep.
RERUN_ADVICE = {
    "compare": "finished runs are kept and an interrupted run continues from its checkpoint: rerun the same "
               "command to resume",
    "ablate": "finished values are kept and skipped: rerun the same command to go on",
    "synthetic": "finished runs are kept and reused: rerun the same command to go on",
}


class _Terminated(KeyboardInterrupt):
    """SIGTERM in a command of :data:`RERUN_ADVICE`: it unwinds as Ctrl-C does (comparison workers are
    told to save and stop), and the command exits with 143, as a process SIGTERM ends."""


def _raise_terminated(_signum: int, _frame: Any) -> None:
    raise _Terminated


def _catch_sigterm() -> Any:
    """SIGTERM raises :class:`_Terminated` from now on; returns the handler it replaced (None off the main
    thread, where signals cannot be handled; a training loop's own handler takes over while it runs)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        return None
