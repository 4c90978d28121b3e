"""A resumed state's counters and optimizer internals are cross-checked before anything is loaded.

Each of these was accepted (from a re-signed checkpoint, or a ``state_dict`` handed to
``load_state_dict``): the optimizer's step counter 1000 beside a checkpoint at step 1, a
``skipped_steps`` of 10**6 or -1, ``capturable: True`` saved by a CPU run, FAMO's Adam second moment
below 0, its Adam step count -1 or 1e300, its pending distance below 0.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from drmoo import store
from drmoo.optim import create

from .conftest import assert_one_line_refusal, resign_checkpoint, run_cli


def _famo_state() -> tuple[Callable[[], Any], dict[str, Any]]:
    def build() -> Any:
        return create("famo", [torch.nn.Parameter(torch.zeros(3))], 2)

    return build, build().state_dict()


@pytest.mark.parametrize(("entry", "value", "named"), [
    ("adam_exp_avg_sq", torch.tensor([0.5, -1e-3], dtype=torch.float64), "adam_exp_avg_sq must be >= 0"),
    ("adam_steps", torch.tensor(-1.0, dtype=torch.float64), "adam_steps must be a whole number from 0"),
    ("adam_steps", torch.tensor(1e300, dtype=torch.float64), "adam_steps must be a whole number from 0"),
    ("adam_steps", torch.tensor(0.5, dtype=torch.float64), "adam_steps must be a whole number from 0"),
    ("pending_distance", torch.tensor([1.0, -2.0], dtype=torch.float64), "pending_distance must be > 0"),
    ("pending", torch.tensor(0.5, dtype=torch.float64), "pending must be 0 or 1"),
    ("skipped_steps", torch.tensor(10**6), "skipped_steps is 1000000, but it counts steps among the 0 taken"),
    ("skipped_steps", torch.tensor(-1), "skipped_steps is -1"),
    ("skipped_steps", torch.tensor(1.0), "skipped_steps must be a 0-d integer tensor"),
], ids=["exp_avg_sq<0", "adam_steps=-1", "adam_steps=1e300", "adam_steps=0.5", "pending_distance<0",
        "pending=0.5", "skipped=1e6", "skipped=-1", "skipped float"])
def test_famo_refuses_internals_no_step_could_have_written(entry: str, value: torch.Tensor, named: str) -> None:
    build, state = _famo_state()
    forged = copy.deepcopy(state)
    forged["state"]["drmoo"][entry] = value
    with pytest.raises(ValueError, match=named):
        build().load_state_dict(forged)
    build().load_state_dict(state)  # the state as saved loads


def test_adam_steps_up_to_the_step_count_load() -> None:
    build, state = _famo_state()
    state["state"]["drmoo"].update(step=5, adam_steps=torch.tensor(5.0, dtype=torch.float64),
                                   skipped_steps=torch.tensor(5))
    build().load_state_dict(state)


def test_a_capturable_flag_that_is_no_flag_is_refused() -> None:
    build, state = _famo_state()
    state["param_groups"][0]["capturable"] = "yes"
    with pytest.raises(ValueError, match="capturable must be True or False, got 'yes'"):
        build().load_state_dict(state)


@pytest.mark.parametrize(("edit", "fragments"), [
    (lambda s: s["optimizer"]["state"]["drmoo"].update(step=1000),
     ("state.drmoo.step) is 1000, but the checkpoint is at step 1",)),
    (lambda s: s["optimizer"]["state"]["drmoo"].update(skipped_steps=torch.tensor(10**6)),
     ("skipped_steps is 1000000",)),
    (lambda s: s["optimizer"]["param_groups"][0].update(capturable=True),
     ("capturable=True", "a run on cpu with amp none saves capturable=False")),
], ids=["step 1000", "skipped 1e6", "capturable on a CPU run"])
def test_a_resigned_checkpoint_with_forged_counters_is_refused(
        edit: Callable[[dict[str, Any]], None], fragments: tuple[str, ...], trained_run: Path,
        capsys: pytest.CaptureFixture) -> None:
    resign_checkpoint(trained_run, edit)
    assert_one_line_refusal(*run_cli(["train", "--resume", str(trained_run), "--max-steps", "3", "--quiet"], capsys),
                            "refused", *fragments)
    assert store.read_checkpoint_file(trained_run / "checkpoint.pt").state["step"] == 1  # nothing trained on it
