"""A run that meets a non-finite step ends there as a result: saved, marked, evaluated, reported, not retrained."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from drmoo.cli import EXIT_DIVERGED, main
from drmoo.experiments.checkpoints import read_checkpoint
from drmoo.experiments.training import DIVERGED, read_diverged
from drmoo.store import UsageError

TINY = ["--input-size", "16", "--train-size", "48", "--test-size", "16", "--batch-size", "16", "--quiet"]
DIVERGING_LR = "1e30"  # the first step writes Inf weights; the second step's losses are not finite


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def test_train_saves_the_state_it_reached_and_marks_the_run(tmp_path: Path, cache_dir: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["train", "--method", "mgda", "--lr", DIVERGING_LR, "--max-steps", "5", "--cache-dir", cache_dir,
                 "--out", str(run), *TINY]) == EXIT_DIVERGED  # 3: not the 2 of a refused option
    err = capsys.readouterr().err
    assert "non-finite" in err and "in iteration 2" in err
    assert f"its state after step 1 is saved in {run / 'checkpoint.pt'}" in err and str(run / DIVERGED) in err
    marker = read_diverged(run)
    assert marker is not None and (marker["step"], marker["saved_step"]) == (2, 1) and "non-finite" in marker["reason"]
    assert read_checkpoint(run)["step"] == 1  # the progress up to the failure, not only to an epoch's end
    assert [row["step"] for row in csv.DictReader((run / "steps.csv").open())] == ["1"]
    assert not (run / "done").exists()


def test_report_names_a_run_that_diverged_before_its_first_epoch(tmp_path: Path) -> None:
    """No metrics.csv yet (the first epoch never ended): ``drmoo report`` listed it as "no recognised results".

    The run directory is what ``train`` leaves there (the test above trains one): its config and marker."""
    from drmoo.experiments import results_report
    from drmoo.experiments.run_config import RunConfig

    assert results_report.DIVERGED == DIVERGED
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(RunConfig(experiment="multimnist2", method="mgda", preset="quick").to_json())
    (run / DIVERGED).write_text(json.dumps({"step": 2, "saved_step": 1, "reason": "step 2 met a non-finite loss"}))
    assert main(["report", "--runs", str(run), "--out", str(tmp_path / "report.md")]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "no recognised results" not in report
    assert "Training run: multimnist2, mgda, seed 0, diverged at step 2" in report
    assert "at step 2 (its state after step 1 is saved): " in report and "non-finite" in report


def test_compare_reports_a_diverged_run_and_goes_on(tmp_path: Path, cache_dir: str) -> None:
    out = tmp_path / "compare"
    args = ["compare", "--experiment", "multimnist2", "--methods", f"mgda,mgda[lr={DIVERGING_LR}]", "--seeds", "0",
            "--eps", "0,0.1", "--max-steps", "3", "--cache-dir", cache_dir, "--out", str(out), "--device", "cpu",
            *TINY]
    assert main(args) == 0
    table = (out / "table.md").read_text()
    assert "Runs that stopped at a non-finite step" in table
    assert f"| mgda[lr={DIVERGING_LR}] | 0 | 2 |" in table
    diverged = out / "mgda_lr-1e30-seed0"
    report = json.loads((diverged / "eval.json").read_text())
    assert report["iterations"] == 1 and [r["eps"] for r in report["results"]] == [0.0, 0.1]
    assert json.loads((out / "mgda-seed0" / "eval.json").read_text())["iterations"] == 3
    # A second call reuses the diverged run as it is (it ended there) instead of training it again.
    checkpoint = (diverged / "checkpoint.pt").read_bytes()
    assert main(args) == 0
    assert (diverged / "checkpoint.pt").read_bytes() == checkpoint
    assert f"| mgda[lr={DIVERGING_LR}] | 0 | 2 |" in (out / "table.md").read_text()
    # Shared without its weights, as committed results are (no checkpoint.pt), the diverged run is reused
    # too: `compare` stopped at it with "checkpoint.pt does not exist: train the run first", so that
    # `reproduce_small.sh k4` failed from a fresh clone at the committed Nash-MTL run that diverged.
    (diverged / "checkpoint.pt").unlink()
    before = {path.name: path.read_bytes() for path in diverged.iterdir()}
    assert main(args) == 0
    assert {path.name: path.read_bytes() for path in diverged.iterdir()} == before
    table = (out / "table.md").read_text()
    assert f"| mgda[lr={DIVERGING_LR}] | 0 | 2 |" in table and "without their weights" in table


def test_a_comparison_without_a_diverged_run_has_no_such_note(tmp_path: Path, cache_dir: str) -> None:
    out = tmp_path / "compare"
    assert main(["compare", "--experiment", "multimnist2", "--methods", "mgda", "--seeds", "0", "--eps", "0",
                 "--max-steps", "1", "--cache-dir", cache_dir, "--out", str(out), "--device", "cpu", *TINY]) == 0
    assert "non-finite" not in (out / "table.md").read_text()


@pytest.mark.parametrize("text", ['{"step": "2", "saved_step": 1, "reason": "x"}', '{"step": 2, "reason": "x"}',
                                  '[2, 1]', '{"step": -1, "saved_step": 0, "reason": "x"}', "not json"])
def test_a_forged_or_damaged_marker_is_refused_by_name(tmp_path: Path, text: str) -> None:
    (tmp_path / DIVERGED).write_text(text)
    with pytest.raises(UsageError, match=r"divergence marker|JSON|diverged"):
        read_diverged(tmp_path)
    assert read_diverged(tmp_path / "elsewhere") is None
