"""The paper's experiments: problems, runners, reporting.  ``drmoo`` on the command line drives them.

Public here: :func:`read_checkpoint`, the verified state a run directory of ``drmoo train`` /
``drmoo compare`` holds (imported on first use, so that importing this package imports no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoints import read_checkpoint

__all__ = ["read_checkpoint"]


def __getattr__(name: str) -> Any:
    if name != "read_checkpoint":
        raise AttributeError(f"module 'drmoo.experiments' has no attribute {name!r}")
    value = importlib.import_module("drmoo.experiments.checkpoints").read_checkpoint
    globals()[name] = value  # later lookups skip this function
    return value
