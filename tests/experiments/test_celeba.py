"""CelebA experiment: label-balancing weights, Table 5 settings, drmoo train / eval / compare on a generated tree.

``drmoo train`` + ``drmoo eval`` run the real ResNet18.  The ``compare`` tests swap in a small conv
trunk: with 8 tasks every method needs 8 to 40 ResNet18 backward passes per step (about 6 minutes
for all eight methods on a 2-core CPU), while everything else - the command, the loader, the weights
reaching every optimizer, evaluation and Table 2 - runs unchanged.
"""

from __future__ import annotations

import csv
import importlib.util
import inspect
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn

from drmoo.cli import main
from drmoo.data.celeba import ALL_ATTRIBUTES, ATTRIBUTES, load_celeba
from drmoo.experiments import celeba
from drmoo.experiments.celeba import PAPER_METHOD_HPARAMS, PRESETS, label_balancing_weights, method_hparams
from drmoo.experiments.registry import get_experiment
from drmoo.optim import available
from drmoo.optim._base import MultiObjectiveOptimizer

TINY = ["--experiment", "celeba", "--input-size", "16", "--batch-size", "8", "--quiet"]


def _data_tests() -> ModuleType:
    # the tree builder lives with the loader's tests (pytest runs in importlib mode: no package import)
    path = Path(__file__).parents[1] / "data" / "test_celeba.py"
    spec = importlib.util.spec_from_file_location("celeba_data_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SmallTrunkModel(nn.Module):
    """MultiTaskResNet's interface on a few hundred parameters (for the compare tests' speed)."""

    def __init__(self, num_classes: list[int], weights: Path | None = None) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.heads = nn.ModuleList(nn.Linear(8, classes) for classes in num_classes)

    def shared_parameters(self) -> list[Tensor]:
        return list(self.trunk.parameters())

    def task_parameters(self) -> list[Tensor]:
        return list(self.heads.parameters())

    def forward(self, images: Tensor) -> list[Tensor]:
        features = self.trunk(images)
        return [head(features) for head in self.heads]


@pytest.fixture
def small_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(celeba, "MultiTaskResNet", SmallTrunkModel)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _data_tests().make_celeba_tree(tmp_path_factory.mktemp("data"))


def test_weights_by_hand() -> None:
    labels = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 1, 1, 0]])
    weights = label_balancing_weights(labels)
    # column 1: p = 1/4 -> positives 1/(2 * 1/4) = 2, negatives 1/(2 * 3/4) = 2/3; column 2 mirrored
    want = torch.tensor([[2, 2 / 3, 1, 1], [2 / 3, 2 / 3, 1, 1], [2 / 3, 2 / 3, 1, 1], [2 / 3, 2, 1, 1]])
    assert torch.allclose(weights, want)
    assert weights.dtype == torch.float32 and weights.shape == labels.shape


def test_weights_balance_both_classes_and_average_one() -> None:
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(256, 8, generator=generator) < torch.linspace(0.02, 0.6, 8)).long()
    weights = label_balancing_weights(labels).double()
    for task in range(8):
        positive = labels[:, task] == 1
        assert 0 < int(positive.sum()) < 256
        # each class carries half of the total weight, and the weights average to 1
        assert float(weights[positive, task].sum()) == pytest.approx(128.0)
        assert float(weights[~positive, task].sum()) == pytest.approx(128.0)
    assert float(weights.mean()) == pytest.approx(1.0)


def test_one_class_batches_get_weight_one() -> None:
    labels = torch.tensor([[1, 0, 1], [1, 0, 0], [1, 0, 1]])  # task 1 all positive, task 2 all negative
    weights = label_balancing_weights(labels)
    assert torch.equal(weights[:, :2], torch.ones(3, 2))
    assert torch.allclose(weights[:, 2], torch.tensor([0.75, 1.5, 0.75]))
    assert bool(torch.isfinite(weights).all())
    with pytest.raises(ValueError, match=r"\[B, m\]"):
        label_balancing_weights(torch.ones(4, dtype=torch.long))


def test_table_five_settings_and_presets() -> None:
    for method in available():
        hp = method_hparams(method)
        accepted = inspect.signature(available()[method].__init__).parameters
        assert hp.get("lam") == 0.8
        assert hp.get("rho") == (5e-5 if "rho" in accepted else None)
        preset = getattr(available()[method], "PRESETS", {}).get("celeba")
        if preset:  # the optimizers' own CelebA presets must say the same
            assert {k: hp[k] for k in preset} == preset, method
    assert PAPER_METHOD_HPARAMS["double-clip"]["pref_lr"] == 2e-2
    assert PAPER_METHOD_HPARAMS["double-loop"]["dual_lr"] == 3e-4
    assert method_hparams("famo", {"lr": 1.0})["lr"] == 1.0
    with pytest.raises(ValueError, match="unknown method 'adamw'"):
        method_hparams("adamw")
    assert PRESETS["paper"] == {"epochs": 100, "batch_size": 256, "input_size": 128, "weights": "imagenet",
                                "train_size": None, "test_size": None}
    experiment = get_experiment("celeba")
    assert experiment.sample_weight is label_balancing_weights and set(experiment.presets) == {"paper", "quick"}
    with pytest.raises(ValueError, match="valid choices: multimnist2, multimnist3, multimnist4, multimnist9, celeba, "
                                         "celeba40"):
        get_experiment("imagenet")


def _record_batch_weights(monkeypatch: pytest.MonkeyPatch, num_tasks: int) -> list[torch.Tensor | None]:
    """The importance weights of every batch the optimizer draws, in order (its losses must have
    ``num_tasks`` columns)."""
    seen: list[torch.Tensor | None] = []
    original = MultiObjectiveOptimizer.draw_losses

    def record(self: MultiObjectiveOptimizer, *args: object, **kwargs: object) -> torch.Tensor:
        losses = original(self, *args, **kwargs)
        seen.append(self.batch_weight)
        assert losses.shape[-1] == num_tasks
        return losses

    monkeypatch.setattr(MultiObjectiveOptimizer, "draw_losses", record)
    return seen


def test_train_passes_the_weights_then_eval_reports_every_metric(
        tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    seen = _record_batch_weights(monkeypatch, num_tasks=8)
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "1", "--data-root", str(tree.parent), "--out", str(run), *TINY]) == 0
    assert seen and all(w is not None and w.shape == (8, 8) for w in seen)
    for weights in seen:  # every column is balanced (or all ones for a one-class batch)
        assert all(float(weights[:, t].sum()) == pytest.approx(8.0) for t in range(8))
    config = json.loads((run / "config.json").read_text())
    assert config["experiment"] == "celeba" and config["hparams"]["lam"] == 0.8
    capsys.readouterr()

    assert main(["eval", "--run", str(run), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| Bald |" in printed and "| **average** |" in printed
    assert "AUC undefined (one class in the test labels), left out of the average: Bald" in printed
    report = json.loads((run / "eval.json").read_text())  # strict JSON: the undefined AUC is null
    assert report["tasks"][0] == "Bald" and report["auc"][0] is None and report["test_samples"] == 10
    assert report["train_samples"] == 24
    for key in ("accuracy", "balanced_accuracy"):
        assert len(report[key]) == 8 and all(0 <= v <= 1 for v in report[key])
        assert report[f"mean_{key}"] == pytest.approx(sum(report[key]) / 8)
    defined = [v for v in report["auc"] if v is not None]
    assert report["mean_auc"] == pytest.approx(sum(defined) / len(defined))


@pytest.mark.usefixtures("small_model")
def test_compare_all_methods_writes_table_two(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--data-root", str(tree.parent), "--methods", "all", "--max-steps", "2", "--out", str(out),
            *TINY]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| method | Averaged Accuracy | Balanced Accuracy | AUC |" in printed
    assert "train images 24, test images 10" in printed
    assert all(f"| {method} |" in printed for method in available())
    assert (out / "table.md").read_text() == printed.rstrip("\n") + "\n"
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [r["method"] for r in rows] == list(available())
    for row in rows:
        assert int(row["seeds"]) == 1
        for key in ("mean_accuracy", "mean_balanced_accuracy", "mean_auc"):
            assert 0.0 <= float(row[key]) <= 100.0
    stamp = (out / "mgda-seed0" / "checkpoint.pt").stat().st_mtime_ns
    assert main(args) == 0  # finished runs are reused, not retrained
    assert (out / "mgda-seed0" / "checkpoint.pt").stat().st_mtime_ns == stamp


@pytest.mark.usefixtures("small_model")
def test_compare_over_seeds_reports_mean_and_std(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "seeds"
    assert main(["compare", "--data-root", str(tree), "--methods", "double-clip", "--seeds", "0,1",
                 "--max-steps", "1", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "mean ± std over seeds 0,1" in printed and printed.count(" ± ") >= 4
    row = next(csv.DictReader((out / "table.csv").open()))
    assert int(row["seeds"]) == 2 and float(row["std_accuracy"]) >= 0.0


def test_commands_report_data_problems(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--max-steps", "1", "--out", str(tmp_path / "a"), *TINY]) == 2
    assert "CelebA needs --data-root" in capsys.readouterr().err
    broken = _data_tests().make_celeba_tree(tmp_path / "broken")
    lines = (broken / "list_attr_celeba.txt").read_text().splitlines()
    lines[9] = lines[9] + " 1"
    (broken / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    assert main(["train", "--max-steps", "1", "--data-root", str(broken), "--out", str(tmp_path / "b"), *TINY]) == 2
    assert "list_attr_celeba.txt, line 10: expected a file name and 40 values, got 42 fields" in capsys.readouterr().err
    (broken / "list_attr_celeba.txt").write_text((tree / "list_attr_celeba.txt").read_text())
    (broken / "img_align_celeba" / "000012.jpg").unlink()
    assert main(["compare", "--methods", "mgda", "--data-root", str(broken), "--out", str(tmp_path / "c"), *TINY]) == 2
    assert "missing from" in (err := capsys.readouterr().err) and "000012.jpg" in err
    # medium is a preset of Multi-MNIST only (argparse's choices hold every experiment's presets)
    assert main(["train", "--preset", "medium", "--data-root", str(tree), "--out", str(tmp_path / "d"), *TINY]) == 2
    assert "unknown preset 'medium'; valid choices: paper, quick" in capsys.readouterr().err


def test_celeba40_is_celeba_with_all_forty_attributes() -> None:
    forty = get_experiment("celeba40")
    assert celeba.ATTRIBUTE_SETS == {"celeba": ATTRIBUTES, "celeba40": ALL_ATTRIBUTES} and len(ALL_ATTRIBUTES) == 40
    assert forty.presets is PRESETS and forty.sample_weight is label_balancing_weights
    assert forty.method_hparams("double-clip") == method_hparams("double-clip")  # Table 5's settings
    with pytest.raises(ValueError, match="unknown CelebA experiment 'celeba41'; valid choices: celeba, celeba40"):
        celeba.attributes_of("celeba41")


def test_forty_attribute_weights_balance_each_attribute_and_guard_one_class_columns(tree: Path) -> None:
    """The importance weights per attribute on the fabricated tree's 40 label columns: a column with both labels
    is balanced (each class half the weight), a column with one label (p = 0, like Bald outside its two faces,
    or p = 1) is all ones, never inf or NaN."""
    labels = load_celeba(tree, input_size=16, attributes=ALL_ATTRIBUTES).train_labels[2:18].clone()  # no Bald
    labels[:, ALL_ATTRIBUTES.index("Young")] = 1  # p = 1
    weights = label_balancing_weights(labels).double()
    assert weights.shape == (16, 40) and bool(torch.isfinite(weights).all())
    one_class = [ALL_ATTRIBUTES.index("Bald"), ALL_ATTRIBUTES.index("Young")]
    for task in range(40):
        positive = labels[:, task] == 1
        if task in one_class:
            assert int(positive.sum()) in (0, 16) and torch.equal(weights[:, task], torch.ones(16, dtype=torch.double))
            continue
        assert 0 < int(positive.sum()) < 16, task
        assert float(weights[positive, task].sum()) == pytest.approx(8.0)
        assert float(weights[~positive, task].sum()) == pytest.approx(8.0)
    assert float(weights.mean()) == pytest.approx(1.0)


@pytest.mark.usefixtures("small_model")
def test_celeba40_trains_with_forty_weight_columns_evaluates_and_compares(
        tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    seen = _record_batch_weights(monkeypatch, num_tasks=40)
    forty = ["--experiment", "celeba40", *TINY[2:]]
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "2", "--data-root", str(tree), "--out", str(run), *forty]) == 0
    assert seen and all(w is not None and w.shape == (8, 40) for w in seen)
    for weights in seen:  # every attribute's column sums to the batch (balanced, or all ones for one class)
        assert all(float(weights[:, t].sum()) == pytest.approx(8.0) for t in range(40))
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| 5_o_Clock_Shadow |" in printed and "| Young |" in printed
    report = json.loads((run / "eval.json").read_text())
    assert report["experiment"] == "celeba40" and report["tasks"] == list(ALL_ATTRIBUTES)
    assert len(report["accuracy"]) == 40 and report["auc"][ALL_ATTRIBUTES.index("Bald")] is None
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "mgda,double-clip", "--max-steps", "1", "--data-root", str(tree),
                 "--out", str(out), *forty]) == 0
    assert "### CelebA, 40 attributes: test metrics (%)" in (out / "table.md").read_text()
