"""Repository-wide pytest set-up: pytest-benchmark's timings are off unless asked for.

The test suite calls benchmarked functions once, untimed (`pytest`); `pytest bench/ --benchmark-only`
(or ``--benchmark-enable``) times them.  Written as a hook rather than ``--benchmark-disable`` in the
addopts, which pytest-benchmark refuses to combine with ``--benchmark-only`` (exit status 4).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's own pytest_configure reads the options
def pytest_configure(config: pytest.Config) -> None:
    option = config.option
    if not hasattr(option, "benchmark_disable"):  # pytest-benchmark is not installed
        return
    if not (option.benchmark_only or option.benchmark_enable):
        option.benchmark_disable = True
