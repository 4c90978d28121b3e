"""MNIST attributes: Table 2's protocol (paper §5.2, App. D) on real images that fit a 2-core CPU.

Two experiments share the data (:mod:`drmoo.data.attributes`: 8 imbalanced, co-occurring binary
attributes of 2-digit MNIST composites) and the network (the MultiLeNet, one two-class head per
attribute):

* ``mnist-attributes``: Table 2's training - the DR dual with the paper's batch importance weights
  1/(2 p) for positives and 1/(2 (1 - p)) for negatives, per task (``label_balancing_weights``, the
  ``celeba`` experiment's), so the nominal distribution has balanced labels;
* ``mnist-attributes-unweighted``: the same without the importance weights (the ablation that says
  whether the weights are what helps).

Evaluation is clean, on two sets of the held-out digits: the prevalence set (the training
prevalences) and the label-balanced sets (one per attribute, see the data module): per set the
average over tasks of accuracy, balanced accuracy and ROC AUC, and the worst task's balanced
accuracy.  ``compare`` tabulates them as mean ± std over seeds and the paired differences
(Student-t intervals) of a reference row against every other row; :func:`write_contrasts` pairs
rows of the two experiments' comparisons (weighted against unweighted).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from drmoo.data.attributes import MnistAttributes, load_mnist_attributes
from drmoo.data.mnist import digit_source_fingerprint
from drmoo.metrics import accuracy, balanced_accuracy, roc_auc, task_metrics
from drmoo.models import MultiLeNet, MultiTaskModel, MultiTaskResNet, resolve_weights
from drmoo.optim import available
from drmoo.store import read_json, save_result, write_csv, write_text

from . import celeba, multimnist
from .celeba import label_balancing_weights
from .dr_tables import dr_comparison
from .evaluation import load_trained_run
from .jobs import run_in_workers
from .paired_stats import paired_differences, paired_markdown
from .registry import Experiment, register
from .robust_eval import collect_logits, json_safe, robustness_report, robustness_tables
from .robustness import (
    ensure_trained,
    has_robustness,
    prepare_comparison,
    reusable_result,
    time_text,
    write_comparison,
)
from .run_config import RunConfig
from .summaries import mean_std, mean_std_text
from .training import read_diverged

__all__ = ["COLUMNS", "EXPERIMENTS", "PRESETS", "SMALL_LR", "build_mnist_attributes", "compare_attributes",
           "evaluate_attributes", "method_hparams", "metrics_table", "paired_table", "summary_table",
           "write_contrasts"]

# --experiment name -> whether training applies the paper's label-balancing importance weights.
EXPERIMENTS: dict[str, bool] = {"mnist-attributes": True, "mnist-attributes-unweighted": False}
SETS = ("prevalence", "balanced")  # the two evaluation sets
METRICS = (("mean_accuracy", "accuracy"), ("mean_balanced_accuracy", "balanced accuracy"), ("mean_auc", "AUC"),
           ("worst_balanced_accuracy", "worst task's balanced accuracy"))
COLUMNS = tuple(f"{split}:{key}" for split in SETS for key, _ in METRICS)  # table.csv / paired.csv columns

SMALL_EPOCHS = 10  # 10 x ceil(12000 / 256) = 470 iterations (sized in results/mnist-attributes-small/README.md)
# The small preset's trunk rates: the ones the two-stage validation sweep chose for the 2-digit Multi-MNIST small
# preset (multimnist.SMALL_LR), on the same MultiLeNet, composites' layout and batch; MoCo with that preset's
# tracking weight.  This experiment's own sweep (results/mnist-attributes-small/lr-sweep/) has run for Double-Clip
# (chose 1.0, the same), MGDA (0.3) and the plain reference (1.0) only; its winners run as rows with their rate
# (mgda[lr=0.3]), and the preset keeps the Multi-MNIST rates until every method is swept here.
SMALL_LR: dict[str, float] = dict(multimnist.SMALL_LR["multimnist2"])
SMALL_METHOD_HPARAMS: dict[str, dict[str, Any]] = {
    method: {"lr": lr, **({"ema": multimnist.SMALL_MOCO_EMA["multimnist2"]} if method == "moco" else {})}
    for method, lr in SMALL_LR.items()
}

# small: the CPU benchmark - the MultiLeNet on the 36 x 36 composites resized to 28 px, 12,000 training
#        composites (3 per training digit), 2,000 prevalence-test composites, batch 256 (App. D's), head rate
#        Multi-MNIST small's 0.1.
# quick: a look at the pipeline (tests, the demo): 2,000 training composites, 500 test, one epoch.
PRESETS: dict[str, dict[str, Any]] = {
    "small": {"epochs": SMALL_EPOCHS, "batch_size": 256, "input_size": 28, "weights": "none", "train_size": 12000,
              "test_size": 2000, "model": "lenet", "head_lr": multimnist.SMALL_HEAD_LR},
    "quick": {"epochs": 1, "batch_size": 64, "input_size": 28, "weights": "none", "train_size": 2000,
              "test_size": 500, "model": "lenet", "head_lr": multimnist.SMALL_HEAD_LR},
}


def method_hparams(method: str, overrides: dict[str, Any] | None = None, preset: str | None = None
                   ) -> dict[str, Any]:
    """Table 2's settings of ``method`` (the CelebA Table 5 values, lambda 0.8, rho 5e-5), then the small
    preset's rate, then ``overrides``."""
    if method not in available():
        raise ValueError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
    by_preset = SMALL_METHOD_HPARAMS.get(method, {}) if preset == "small" else {}
    return {**celeba.method_hparams(method), **by_preset, **(overrides or {})}


def build_mnist_attributes(config: RunConfig) -> tuple[MultiTaskModel, MnistAttributes]:
    """The multi-task network (a two-class head per attribute) and the run's fixed data."""
    if config.experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {config.experiment!r}; valid choices: {', '.join(EXPERIMENTS)}")
    data = load_mnist_attributes(config.data_root, input_size=config.input_size,
                                 train_size=config.train_size or PRESETS["small"]["train_size"],
                                 test_size=config.test_size or PRESETS["small"]["test_size"],
                                 holdout=config.eval_split)
    multimnist.check_model_settings(config)
    if config.model == "lenet":
        return MultiLeNet([2] * data.num_tasks, input_size=config.input_size), data
    return MultiTaskResNet([2] * data.num_tasks, weights=resolve_weights(config.weights)), data


@torch.no_grad()
def predict(model: nn.Module, images: Tensor, to_input: Any, batch_size: int, device: torch.device
            ) -> tuple[Tensor, Tensor]:
    """Hard predictions (argmax) and positive-class scores (the margin z_1 - z_0,
    :func:`drmoo.experiments.celeba.predictions_and_scores`) ``[N, m]``."""
    model.eval()
    predictions, scores = [], []
    for start in range(0, images.shape[0], batch_size):
        logits = model(to_input(images[start : start + batch_size]).to(device))
        batch_predictions, batch_scores = celeba.predictions_and_scores([z.cpu() for z in logits])
        predictions.append(batch_predictions)
        scores.append(batch_scores)
    return torch.cat(predictions), torch.cat(scores)


def balanced_set_metrics(data: MnistAttributes, predictions: Tensor, scores: Tensor) -> dict[str, Any]:
    """Per attribute, accuracy / balanced accuracy / AUC on its own label-balanced set; their means and worst."""
    acc, bal, auc = [], [], []
    for task, rows in enumerate(data.balanced_rows):
        labels = data.balanced_labels[rows, task]
        acc.append(accuracy(labels, predictions[rows, task]))
        bal.append(balanced_accuracy(labels, predictions[rows, task]))
        auc.append(roc_auc(labels, scores[rows, task]))
    m = len(acc)
    return {"tasks": list(data.attributes), "accuracy": acc, "balanced_accuracy": bal, "auc": auc,
            "mean_accuracy": sum(acc) / m, "mean_balanced_accuracy": sum(bal) / m, "mean_auc": sum(auc) / m,
            "worst_balanced_accuracy": min(bal), "samples": [len(rows) for rows in data.balanced_rows]}


def evaluate_attributes(run_dir: Path, *, eps: list[float] | None = None, progress: bool = True,
                        device: str | None = None, noise_sigmas: list[float] | None = None) -> dict[str, Any]:
    """Both evaluation sets' metrics of a trained run, and the prevalence set's robustness block
    (:func:`~drmoo.experiments.robust_eval.robustness_report`, with the label-balancing weights' nominal
    for both experiments: it is the same yardstick whether or not training used the weights); writes and
    returns eval.json's content.

    ``eps`` is accepted for the common ``Experiment.evaluate`` signature and ignored (Table 2 is clean).
    """
    config, model, data, target, provenance = load_trained_run(run_dir, build_mnist_attributes, device)
    batch = 2 * config.batch_size
    logits = collect_logits(model, data.test_images, data.test_labels, data.images, batch, target)
    predictions, scores = celeba.predictions_and_scores(logits)
    prevalence = task_metrics(data.test_labels, predictions, scores, names=list(data.attributes))
    prevalence["worst_balanced_accuracy"] = min(prevalence["balanced_accuracy"])
    pool_predictions, pool_scores = predict(model, data.balanced_images, data.images, batch, target)
    report = {"run": str(run_dir), "method": config.method, "label": config.name, "seed": config.seed,
              "experiment": config.experiment, "split": config.eval_split,
              "train_samples": int(data.train_labels.shape[0]), "test_samples": int(data.test_labels.shape[0]),
              "train_positive_rate": data.train_labels.double().mean(0).tolist(), **provenance,
              "prevalence": prevalence, "balanced": balanced_set_metrics(data, pool_predictions, pool_scores),
              # on the prevalence set; both experiments are also measured under the label-balancing nominal
              "robustness": robustness_report(model, data.test_images, data.test_labels, data.images, batch, target,
                                              config, logits, label_balancing_weights, noise_sigmas)}
    save_result(run_dir / "eval.json", json_safe(report))  # strict JSON: NaN as null
    return report


def _percent(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def metrics_table(report: dict[str, Any]) -> str:
    """One run's metrics (%) as markdown: a row per attribute, both sets, and the averages."""
    prevalence, balanced = report["prevalence"], report["balanced"]
    lines = [
        f"MNIST-attributes metrics ({report['label']}, seed {report['seed']}, {report['split']} digits): prevalence "
        f"set of {report['test_samples']} composites; balanced sets, one per attribute",
        "",
        "| attribute | train positives | accuracy | balanced accuracy | AUC | balanced set: accuracy | AUC |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, name in enumerate(prevalence["tasks"]):
        lines.append(f"| {name} | {_percent(report['train_positive_rate'][i])} | {_percent(prevalence['accuracy'][i])} "
                     f"| {_percent(prevalence['balanced_accuracy'][i])} | {_percent(prevalence['auc'][i])} | "
                     f"{_percent(balanced['accuracy'][i])} | {_percent(balanced['auc'][i])} |")
    lines.append(f"| **average** | | {_percent(prevalence['mean_accuracy'])} | "
                 f"{_percent(prevalence['mean_balanced_accuracy'])} | {_percent(prevalence['mean_auc'])} | "
                 f"{_percent(balanced['mean_accuracy'])} | {_percent(balanced['mean_auc'])} |")
    lines.append(f"| **worst task** | | | {_percent(prevalence['worst_balanced_accuracy'])} | | "
                 f"{_percent(balanced['worst_balanced_accuracy'])} | |")
    return "\n".join(lines) + "\n" + ("\n" + robustness_tables(report) if "robustness" in report else "")


def _value(report: dict[str, Any], column: str) -> float:
    """A report's value of a ``SET:METRIC`` column, in %."""
    split, key = column.split(":")
    value = report[split][key]
    return math.nan if value is None else 100 * float(value)


def summary_table(reports: Sequence[dict[str, Any]], header: str) -> tuple[str, list[dict[str, Any]]]:
    """Rows x both sets' four metrics, mean ± std over seeds (%); table.csv's long rows."""
    labels = list(dict.fromkeys(r["label"] for r in reports))
    titles = [f"{split}: {title}" for split in SETS for _, title in METRICS]
    lines = [header, "", "| row | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(COLUMNS)]
    rows = []
    for label in labels:
        cells = []
        for column in COLUMNS:
            values = [_value(r, column) for r in reports if r["label"] == label]
            values = [v for v in values if not math.isnan(v)]
            mean, std = mean_std(values) if values else (math.nan, math.nan)
            split, metric = column.split(":")
            rows.append({"method": label, "set": split, "metric": metric, "mean": mean, "std": std,
                         "seeds": len(values)})
            cells.append("n/a" if not values else mean_std_text(mean, std, len(values)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def _per_seed(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[int, float]]]:
    table: dict[str, dict[str, dict[int, float]]] = {}
    for report in reports:
        for column in COLUMNS:
            table.setdefault(report["label"], {}).setdefault(column, {})[report["seed"]] = _value(report, column)
    return table


def paired_table(reports: Sequence[dict[str, Any]], reference: str) -> tuple[str, list[dict[str, Any]]]:
    """``reference`` minus every other row, per column, over the seeds both ran (Student-t intervals)."""
    per_seed = _per_seed(reports)
    if reference not in per_seed or len(per_seed) < 2:
        return "", []
    paired = paired_differences(per_seed, reference, list(COLUMNS))
    labels = {column: f"{column.split(':')[0]}: {dict(METRICS)[column.split(':')[1]]}" for column in COLUMNS}
    return paired_markdown(paired, labels, unit="percentage points"), paired


def _report_fits(report: dict[str, Any]) -> bool:
    return (isinstance(report["label"], str) and isinstance(report["seed"], int) and has_robustness(report)
            and all(isinstance(report[split][key], float) for split in SETS for key, _ in METRICS))


def train_and_evaluate(config: RunConfig, run_dir: Path, progress: bool) -> dict[str, Any]:
    """One run of a comparison: trained (or reused / resumed) with its experiment's weighting, then evaluated."""
    weights = label_balancing_weights if EXPERIMENTS[config.experiment] else None
    ensure_trained(config, run_dir, build_mnist_attributes, progress, sample_weight=weights)
    report = reusable_result(run_dir, _report_fits)
    if report is None:
        report = evaluate_attributes(run_dir, progress=False)
    stopped = read_diverged(run_dir)
    return {**report, "diverged_at": stopped["step"]} if stopped else report


def compare_attributes(configs: list[RunConfig], out: Path, *, eps: list[float] | None = None, progress: bool = True,
                       reference: str = "double-clip", jobs: int = 1) -> str:
    """Train (reusing finished runs, resuming interrupted ones) and evaluate every config; write the tables.

    table.md / table.csv: mean ± std over seeds of both sets' metrics; paired.csv: ``reference`` minus
    every other row (when the comparison has that row and another).  ``jobs`` runs train at once.
    """
    names = prepare_comparison(configs, out)
    started = time.perf_counter()
    calls = [(config, out / name, progress) for config, name in zip(configs, names)]
    if jobs == 1 or len(calls) == 1:
        reports = [train_and_evaluate(*call) for call in tqdm(calls, desc="compare", disable=not progress)]
    else:
        reports = run_in_workers(train_and_evaluate, calls, jobs,
                                 [f"{config.name} seed {config.seed}" for config in configs], progress=progress)
    first = configs[0]
    seeds = sorted({c.seed for c in configs})
    seed_text = f"mean ± std over seeds {','.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    weighting = "label-balancing importance weights" if EXPERIMENTS[first.experiment] else "no importance weights"
    balanced = reports[0]["balanced"]["samples"]
    header = (
        f"### {first.experiment}: clean metrics (%) averaged over the 8 attributes ({seed_text})\n\n"
        f"preset `{first.preset}`: model `{first.model}`, {first.input_size}px, {first.epochs} epoch(s), batch "
        f"{first.batch_size}, train composites {reports[0]['train_samples']}, {first.eval_split} digits: prevalence "
        f"set {reports[0]['test_samples']} composites, balanced sets {min(balanced)}-{max(balanced)} per attribute; "
        f"{weighting}; device {first.device}; {time_text(out, names, started)}"
    )
    table, rows = summary_table(reports, header)
    paired_text, paired = paired_table(reports, reference)
    if paired_text:
        table += "\n" + paired_text
        write_csv(out / "paired.csv", paired)
    robust = dr_comparison(reports, reference, out)
    return write_comparison(out, table + ("\n" + robust if robust else ""), rows, reports)


def read_reports(folder: Path, prefix: str = "") -> list[dict[str, Any]]:
    """The eval.json of every run directly under ``folder``, labels prefixed with ``prefix``."""
    reports = []
    for path in sorted(folder.glob("*/eval.json")):
        report = read_json(path, what="evaluation")
        reports.append({**report, "label": prefix + report["label"]})
    return reports


def write_contrasts(out: Path, folders: dict[str, Path], contrasts: Sequence[tuple[str, str]]) -> str:
    """Paired differences ``reference - other`` of rows that may live in different comparisons.

    ``folders`` maps a label prefix to a comparison folder (its runs' labels get the prefix, e.g.
    ``"unweighted:"``); ``contrasts`` are (reference, other) labels.  Writes ``contrasts.csv`` / ``.md``
    under ``out``; a contrast whose rows are not both there yet is left out and named.
    """
    reports = [r for prefix, folder in folders.items() for r in read_reports(folder, prefix)]
    per_seed = _per_seed(reports)
    rows, missing = [], []
    for reference, other in contrasts:
        if reference not in per_seed or other not in per_seed:
            missing.append(f"{reference} - {other}")
            continue
        rows += paired_differences({reference: per_seed[reference], other: per_seed[other]}, reference,
                                   list(COLUMNS))
    labels = {column: f"{column.split(':')[0]}: {dict(METRICS)[column.split(':')[1]]}" for column in COLUMNS}
    lines = ["Paired contrasts (percentage points, reference minus other; positive: the reference is higher): mean "
             "over the seeds both ran [95 % interval, Student's t] and the seeds on which the reference is higher.",
             ""]
    for reference in dict.fromkeys(row["reference"] for row in rows):
        lines.append(paired_markdown([row for row in rows if row["reference"] == reference], labels,
                                     unit="percentage points"))
    if missing:
        lines.append("Not run yet: " + "; ".join(missing) + "\n")
    text = "\n".join(lines)
    write_csv(out / "contrasts.csv", rows)
    write_text(out / "contrasts.md", text)
    return text


def _check_data(config: RunConfig) -> None:
    digit_source_fingerprint(config.data_root)


for _name, _weighted in EXPERIMENTS.items():  # registered on import (drmoo.experiments.registry looks them up)
    register(Experiment(name=_name, build=build_mnist_attributes, presets=PRESETS, method_hparams=method_hparams,
                        evaluate=evaluate_attributes, eval_table=metrics_table, compare=compare_attributes,
                        sample_weight=label_balancing_weights if _weighted else None, check_data=_check_data,
                        check_model=multimnist.check_model_settings))
