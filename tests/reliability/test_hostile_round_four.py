"""Issue 37 ("Hostile input, round four"): one test (or a family) per defect ID, the ID in its name.

Each reproduction is the audit's, shrunk to the tiny run of :mod:`tests.reliability.conftest`.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from drmoo import store
from drmoo.experiments.checkpoints import max_recorded_steps

from .conftest import assert_one_line_refusal, run_cli
from .test_store_hostile import assert_payload_over_budget_refused

# ------------------------------------------------------------------------------- SEC-8


def test_sec8_config_json_cannot_raise_the_checkpoint_payload_budget(trained_run: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """The budget used to grow with config.json's epochs x rows / batch, a file as writable as the
    checkpoint: epochs 100000 and batch 1 (here 2, for BatchNorm) let a 2 GiB payload of zeros with its
    true hash be read whole.
    The budget now comes from the model and data the run loads into and fixed caps only: the same
    forged config leaves it where it was, and a payload one MiB over it is refused unread."""
    forged = json.loads((trained_run / "config.json").read_text())
    forged.update(epochs=100_000, batch_size=2)
    # a resume asked to go far (a resumable setting, on the command line) cannot raise it either
    assert_payload_over_budget_refused(trained_run, forged, ["--epochs", "20000"], capsys)


def test_sec8_a_run_too_long_for_its_checkpoint_to_be_read_back_is_refused_before_it_starts(
        tiny_args, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The fixed budget for per-step rows bounds a run's length: one longer is refused up front (not after
    days of training, at a checkpoint its own resume would refuse)."""
    out = tmp_path / "long"
    code, err = run_cli(["train", "--out", str(out), *tiny_args("--epochs", "100000", "--batch-size", "2")], capsys)
    assert_one_line_refusal(code, err, "1600000 steps", "lower --epochs or --max-steps")
    assert not out.exists()
    assert max_recorded_steps(40) > 100 * 636  # CelebA-40's paper run fits: 100 epochs of 636 steps


# ------------------------------------------------------------------------------- DL-5


def test_dl5_a_read_only_report_is_refused_not_replaced(trained_run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """rename(2) ignores the target's mode: a report someone made read-only (chmod 444) to keep it was
    replaced by the next ``report --out`` with a new 644 file.  Now it is refused with one line, kept."""
    out = tmp_path / "r.md"
    assert run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys)[0] == 0
    kept = out.read_bytes()
    out.chmod(0o444)
    assert_one_line_refusal(*run_cli(["report", "--runs", str(trained_run), "--out", str(out)], capsys),
                            str(out), "read-only")
    assert out.read_bytes() == kept and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_dl5_the_store_keeps_the_mode_of_a_file_it_replaces(tmp_path: Path) -> None:
    """A writable file replaced atomically keeps its permission bits (rename used to give it the new file's 644)."""
    path = tmp_path / "notes.md"
    path.write_text("old")
    path.chmod(0o600)
    store.write_text(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o400)
    with pytest.raises(store.UsageError, match="read-only"):
        store.write_text(path, "newer")
    assert path.read_text() == "new"
