"""Refuse nonsense with one line, exit status 2, no traceback (issue 12)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from drmoo.experiments.ablations import AblationConfig
from drmoo.experiments.checkpoints import read_checkpoint
from drmoo.experiments.run_config import RunConfig
from drmoo.experiments.synthetic import SyntheticConfig
from drmoo.experiments.training import train
from drmoo.store import UsageError

from .conftest import assert_one_line_refusal, run_cli

# ----------------------------------------------------------------------------------- counts >= 1


@pytest.mark.parametrize(("argv", "flag"), [
    (["synthetic", "--steps", "0"], "--steps"),
    (["synthetic", "--batch-size", "0"], "--batch-size"),
    (["synthetic", "--steps", "-5"], "--steps"),
])
def test_synthetic_counts_below_one_are_refused(argv: list[str], flag: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli([*argv, "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert_one_line_refusal(code, err, flag, "expected an integer >= 1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["steps", "batch_size"])
@pytest.mark.parametrize("value", [0, -5])
def test_synthetic_config_refuses_counts_below_one_instead_of_using_the_default(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be an integer >= 1"):
        SyntheticConfig(**{field: value}).resolved()
    assert SyntheticConfig().resolved()["steps"] == 600  # None still means the paper's value


def test_ablate_batch_grid_of_zero_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["ablate", "--what", "batch", "--experiment", "linear", "--grid=0",
                         "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert_one_line_refusal(code, err, "--grid", "batch sizes", "got 0")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("what", "grid"), [("inner", "2.5"), ("lambda", "-0.4"), ("lr", "0")])
def test_ablation_grid_values_that_make_no_sense_are_refused(what: str, grid: str) -> None:
    config = AblationConfig(what=what, experiment="linear", grid=[float(grid)])
    with pytest.raises(ValueError, match="--grid"):
        config.validate()


@pytest.mark.parametrize(("flag", "value"), [
    ("--batch-size", "0"), ("--batch-size", "-4"), ("--max-steps", "-3"), ("--epochs", "0"),
    ("--test-size", "0"), ("--train-size", "0"), ("--input-size", "0"),
])
def test_train_counts_below_one_are_refused(flag: str, value: str, tmp_path: Path,
                                            tiny_args: Callable[..., list[str]],
                                            capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--out", str(tmp_path / "run"), *tiny_args(flag, value)], capsys)
    assert_one_line_refusal(code, err, flag, "expected an integer >= 1")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("field", "value"), [("batch_size", 0), ("epochs", 0), ("max_steps", -3),
                                              ("test_size", 0), ("seed", -1), ("head_lr", float("nan"))])
def test_library_train_refuses_bad_settings_before_writing(field: str, value: float, tmp_path: Path) -> None:
    config = RunConfig(experiment="multimnist2", method="mgda", preset="quick", **{field: value})
    with pytest.raises(UsageError, match=f"--{field.replace('_', '-')} must be"):
        train(config, tmp_path / "run", lambda _: pytest.fail("nothing may be built"), progress=False)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------- eval --eps


@pytest.mark.parametrize("eps", ["-0.1", "nan", "0,inf"])
def test_eval_eps_negative_or_not_finite_is_refused(eps: str, trained_run: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["eval", "--run", str(trained_run), f"--eps={eps}", "--quiet"], capsys)
    assert_one_line_refusal(code, err, "--eps")
    assert not (trained_run / "eval.json").exists()


# ----------------------------------------------------------------------------------- one clear line each


def test_unknown_hyperparameter_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                            capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--hp", "bogus=1", "--out", str(tmp_path / "run"), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "unknown hyperparameter(s) bogus for double-clip", "valid: ", "lam")


def test_synthetic_unknown_hyperparameter_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["synthetic", "--hp", "bogus=1", "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert_one_line_refusal(code, err, "unknown hyperparameter(s) bogus")


def test_device_cuda_without_a_gpu_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, or any without a GPU
    code, err = run_cli(["train", "--device", "cuda", "--out", str(tmp_path / "run"), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "--device cuda", "no CUDA GPU")


def test_unknown_device_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                    capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["train", "--device", "foo", "--out", str(tmp_path / "run"), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "unknown --device 'foo'")


def test_out_that_cannot_be_created_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, err = run_cli(["train", "--max-steps", "1", "--out", str(blocker / "run"), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "cannot create the run directory")


def test_out_pointing_at_a_file_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                            capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    code, err = run_cli(["train", "--max-steps", "1", "--out", str(target), *tiny_args()], capsys)
    assert_one_line_refusal(code, err, "is a file, not a directory")
    assert target.read_text() == "keep me"


def test_compare_out_pointing_at_a_file_is_one_line(tmp_path: Path, tiny_args: Callable[..., list[str]],
                                                    capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    code, err = run_cli(["compare", "--methods", "mgda", "--max-steps", "1", "--out", str(target), *tiny_args()],
                        capsys)
    assert_one_line_refusal(code, err, "is a file, not a directory")


# ----------------------------------------------------------------------------------- --resume


@pytest.mark.parametrize(("flags", "named"), [
    (["--method", "mgda"], "--method mgda (the run's: double-clip)"),
    (["--lr", "0.5"], "--lr 0.5"),
    (["--hp", "lam=2.5"], "--hp lam=2.5"),
    (["--batch-size", "8"], "--batch-size 8 (the run's: 16)"),
])
def test_resume_refuses_flags_that_contradict_the_run(flags: list[str], named: str, trained_run: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    before = (trained_run / "checkpoint.pt").read_bytes()
    code, err = run_cli(["train", "--resume", str(trained_run), *flags, "--quiet"], capsys)
    assert_one_line_refusal(code, err, named, "only --epochs/--max-steps may change")
    assert (trained_run / "checkpoint.pt").read_bytes() == before


def test_resume_accepts_flags_that_agree_with_the_run_and_extensions(trained_run: Path) -> None:
    from drmoo.cli import main

    assert main(["train", "--resume", str(trained_run), "--method", "double-clip", "--batch-size", "16",
                 "--max-steps", "2", "--quiet"]) == 0
    assert read_checkpoint(trained_run)["step"] == 2
