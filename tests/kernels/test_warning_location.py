"""The missing-kernels warning points at the user's line, and asking what runs does not warn.

A plain ``pip install .`` installs no compiled kernels; the first optimizer then warns once.  That
warning used to name drmoo's own ``_ops.py`` (a fixed ``stacklevel``), and
``drmoo_kernels.available_backends()`` -- a question, which the README suggests running -- issued it
too.  The missing extension is simulated, as in test_extension_load.py.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import drmoo_kernels
from drmoo.optim import MGDA
from drmoo_kernels import KernelsUnavailableWarning, _ops


@pytest.fixture
def kernels_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has not looked for drmoo_kernels._C yet, and will not find it (nor another drmoo_kernels
    that has it further down sys.path: test_layout.py covers that case)."""
    monkeypatch.setattr(_ops, "_load_reasons", {})
    monkeypatch.setattr(_ops, "_shadowed_build", lambda extension: None)
    monkeypatch.setattr(_ops, "_availability_cache", {})
    monkeypatch.setattr(_ops, "_pending_warnings", {}, raising=False)
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):
        return None if name == _ops.EXTENSION else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delenv("DRMOO_BACKEND", raising=False)


def _caught(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, KernelsUnavailableWarning)]


def test_available_backends_only_answers_and_the_first_use_warns_at_the_users_line(kernels_not_installed: None) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        backends = drmoo_kernels.available_backends()
        assert _caught(record) == []
        assert "cpp" not in backends and "reference" in backends
        assert drmoo_kernels.available_backends() == backends  # asked twice: still no warning

        model = torch.nn.Linear(3, 2)
        MGDA(model.parameters(), num_tasks=2); line = _line()  # noqa: E702
        MGDA(model.parameters(), num_tasks=2)  # once per process
    (warning,) = _caught(record)
    assert warning.filename == __file__ and warning.lineno == line, (warning.filename, warning.lineno)
    assert "drmoo_kernels._C is not installed" in str(warning.message)


def test_without_asking_first_the_first_use_warns_at_the_users_line(kernels_not_installed: None) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        MGDA(torch.nn.Linear(3, 2).parameters(), num_tasks=2); line = _line()  # noqa: E702
    (warning,) = _caught(record)
    assert warning.filename == __file__ and warning.lineno == line, (warning.filename, warning.lineno)


def _line() -> int:
    """The line number of the caller's current line."""
    import sys

    return sys._getframe(1).f_lineno
