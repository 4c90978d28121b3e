"""Hostile input, round six (the command line): one test per defect, named after it.

A finished run resumed as it is (it removed eval.json and rewrote the checkpoint, training nothing); a
learning rate float32 cannot hold (a traceback after the run directory was written); compare's model
settings refused only after --out existed; a run's config.json replayed with another --method (the error
named hyperparameters the user never typed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import assert_one_line_refusal, run_cli


def _files(run: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(run.iterdir()) if path.is_file()}


def test_a_finished_run_resumed_as_it_is_is_refused_and_left_as_it_was(
        trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    (trained_run / "eval.json").write_text("{}")  # stands for the evaluation of these weights
    before = _files(trained_run)
    code, err = run_cli(["train", "--resume", str(trained_run), "--quiet"], capsys)
    assert_one_line_refusal(code, err, "is finished (1 steps)", "nothing to train", "raise --epochs or --max-steps")
    assert _files(trained_run) == before


def test_a_finished_run_still_extends(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--quiet"], capsys)
    assert code == 0, err
    assert (trained_run / "done").read_text().strip() == "2"


def test_an_unfinished_run_at_its_limit_without_done_is_completed(
        trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    (trained_run / "done").unlink()  # saved at its last step, stopped before the marker was written
    code, err = run_cli(["train", "--resume", str(trained_run), "--quiet"], capsys)
    assert code == 0, err
    assert (trained_run / "done").exists()


@pytest.mark.parametrize("flag", ["--head-lr", "--lr"])
def test_a_rate_float32_cannot_hold_is_refused_before_anything_is_written(
        flag: str, tmp_path: Path, tiny_args: Callable[..., list[str]], capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    code, err = run_cli(["train", "--max-steps", "1", flag, "1e39", "--out", str(out), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, flag, "at most 3.403e+38", "1e39")
    assert not out.exists()


def test_a_config_files_head_lr_float32_cannot_hold_is_refused(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = json.loads((trained_run / "config.json").read_text())
    config["head_lr"] = 1e39
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "replay"  # (tmp_path / "run" is trained_run)
    code, err = run_cli(["train", "--config", str(tmp_path / "config.json"), "--out", str(out), "--quiet"], capsys)
    assert_one_line_refusal(code, err, "--head-lr", "at most 3.403e+38")
    assert not out.exists()


def test_compare_refuses_a_model_setting_before_creating_its_out(
        tmp_path: Path, reliability_cache: str, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    code, err = run_cli(["compare", "--model", "lenet", "--input-size", "16", "--train-size", "32", "--test-size", "8",
                         "--batch-size", "16", "--max-steps", "1", "--methods", "mgda", "--cache-dir",
                         reliability_cache, "--quiet", "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, "the MultiLeNet takes 28 x 28 inputs", "--input-size 28")
    assert not out.exists()


def test_compare_refuses_a_missing_weights_file_before_creating_its_out(
        tmp_path: Path, reliability_cache: str, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    code, err = run_cli(["compare", "--weights", str(tmp_path / "absent.pth"), "--input-size", "16", "--train-size",
                         "32", "--test-size", "8", "--batch-size", "16", "--max-steps", "1", "--methods", "mgda",
                         "--cache-dir", reliability_cache, "--quiet", "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, "absent.pth", "no such file")
    assert not out.exists()


def test_a_config_replayed_with_another_method_names_the_file_for_its_hyperparameters(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = json.loads((trained_run / "config.json").read_text())
    assert config["method"] == "double-clip" and "c1" in config["hparams"]  # Double-Clip's own, not FAMO's
    out = tmp_path / "famo"
    code, err = run_cli(["train", "--config", str(trained_run / "config.json"), "--method", "famo",
                         "--out", str(out), "--quiet"], capsys)
    assert_one_line_refusal(code, err, f"--config {trained_run / 'config.json'} holds the hyperparameters of a "
                                       "double-clip run", "not famo's (--method famo)")
    assert not out.exists()


def test_a_config_replayed_with_another_method_that_takes_its_hyperparameters_runs(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = json.loads((trained_run / "config.json").read_text())
    config["hparams"] = {"lr": config["hparams"].get("lr", 0.1)}  # every method has lr
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "mgda"
    code, err = run_cli(["train", "--config", str(tmp_path / "config.json"), "--method", "mgda", "--out", str(out),
                         "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["method"] == "mgda"


def test_a_finished_comparison_is_reused_when_only_the_cache_folder_moved(
        tmp_path: Path, reliability_cache: str, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    common = ["compare", "--model", "lenet", "--input-size", "28", "--train-size", "32", "--test-size", "8",
              "--batch-size", "16", "--max-steps", "1", "--methods", "mgda", "--eps", "0", "--quiet",
              "--out", str(out)]
    code, err = run_cli([*common, "--cache-dir", reliability_cache], capsys)
    assert code == 0, err
    run = next(path for path in out.iterdir() if path.is_dir() and (path / "done").exists())
    before = _files(run)
    code, err = run_cli([*common, "--cache-dir", str(tmp_path / "elsewhere")], capsys)
    assert code == 0, err  # the data cache is keyed by content: where it lives does not define the run
    assert _files(run) == before


def test_a_resume_may_move_the_cache_folder(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--resume", str(trained_run), "--max-steps", "2", "--cache-dir",
                         str(tmp_path / "elsewhere"), "--quiet"], capsys)
    assert code == 0, err
    assert (trained_run / "done").read_text().strip() == "2"
