"""The runnable examples (``examples/``) train their two-task model: executed here so that they cannot rot."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["balancer_adam.py", "step_closure.py"])
def test_example_trains_both_tasks(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = runpy.run_path(str(EXAMPLES / script), run_name="drmoo_example")  # not "__main__": no argv parsing
    result = namespace["main"](steps=60)
    assert all(after < before for before, after in zip(result["before"], result["after"])), result
    assert abs(sum(result["w"]) - 1.0) < 1e-5
    assert "per-task mean loss" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["mgda", "famo", "double-loop"])
def test_the_examples_run_other_methods(method: str) -> None:
    for script in ("balancer_adam.py", "step_closure.py"):
        namespace = runpy.run_path(str(EXAMPLES / script), run_name="drmoo_example")
        result = namespace["main"](steps=5, method=method)
        assert len(result["after"]) == 2
