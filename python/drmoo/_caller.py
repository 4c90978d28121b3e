"""Where a warning raised deep in a step should point: the user's line that called drmoo."""

from __future__ import annotations

import sys
from typing import Any


def user_stacklevel() -> int:
    """The ``stacklevel`` (for ``warnings.warn`` called by the caller of this function) of the first frame
    outside drmoo and torch: the user's ``Balancer.backward`` / ``optimizer.step`` / constructor call, however
    many of drmoo's frames (and torch's optimizer wrappers around ``step``) lie between."""
    frame: Any = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(("drmoo", "torch")):
        frame = frame.f_back
        level += 1
    return level
