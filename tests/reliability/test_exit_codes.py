"""The command line's exit statuses: a refused option or setting (2) is told apart from a diverged run (3).

The diverged run's status through real training is checked in tests/experiments/test_diverged_runs.py;
here the mapping itself, and that docs/cli.md lists every status the CLI defines.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from drmoo import cli
from drmoo.optim import NonFiniteStepError

from .conftest import run_cli

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_a_typo_and_a_refused_setting_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["train", "--max-stepz", "3"], capsys)[0] == cli.EXIT_USAGE == 2
    assert run_cli(["train", "--method", "mgda", "--hp", "nonsense=1", "--out", "unused"], capsys)[0] == 2


def test_a_run_that_diverged_exits_with_its_own_status(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    def diverge(args: argparse.Namespace) -> int:
        raise NonFiniteStepError("step 2 met a non-finite loss")

    monkeypatch.setattr(cli, "_run_train", diverge)  # the parser binds the handler when main builds it
    code, err = run_cli(["train", "--method", "mgda", "--out", "unused"], capsys)
    assert code == cli.EXIT_DIVERGED == 3
    assert err.strip() == "drmoo train: error: step 2 met a non-finite loss"


def test_the_docs_list_every_exit_status() -> None:
    table = DOCS.read_text().split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| ([^|]*)\|", table, flags=re.MULTILINE)
    documented = {int(code) for cell in first_cells for code in re.findall(r"`(\d+)`", cell)}
    assert {0, cli.EXIT_USAGE, cli.EXIT_DIVERGED, 130, 143} <= documented
