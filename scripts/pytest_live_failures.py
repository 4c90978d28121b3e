"""A pytest plugin that writes every failure, with its traceback, to a file the moment it is reported.

For runs that may be cut off (a GPU machine lent for minutes, ``timeout``): pytest prints its tracebacks
only at the end of the session, and a killed run (or pytest-xdist's controller) leaves none.  Load it
with ``-p pytest_live_failures`` (scripts/ on PYTHONPATH); the file is ``$DRMOO_LIVE_FAILURES``, default
``live-failures.txt`` in the working directory, appended to and flushed per failure.
"""

from __future__ import annotations

import os
from typing import Any

_IN_WORKER: list[bool] = []


def pytest_configure(config: Any) -> None:
    # Under pytest-xdist every report reaches the controller too: only it writes, so each failure is there once.
    _IN_WORKER.append(hasattr(config, "workerinput"))


def pytest_runtest_logreport(report: Any) -> None:
    if not report.failed or (_IN_WORKER and _IN_WORKER[-1]):
        return
    path = os.environ.get("DRMOO_LIVE_FAILURES", "live-failures.txt")
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
