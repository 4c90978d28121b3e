"""CelebA under label imbalance (paper §5.2, Table 2, App. D): presets, weights, evaluation, comparison.

Eight binary attributes (``drmoo.data.celeba.ATTRIBUTES``) on the Multi-MNIST network (ResNet18 trunk,
one two-class MLP head per attribute).  The experiment ``celeba40`` (drmoo's, not in the paper) is the
same with all 40 attributes of the annotation file (``ALL_ATTRIBUTES``) as tasks: same presets, same
Table 5 settings, same weighting, per attribute.  Training minimises the importance-weighted DR dual: every
batch's samples are reweighted per task so that both labels weigh half (:func:`label_balancing_weights`).
Evaluation is clean (no attack): accuracy, balanced accuracy and ROC AUC per attribute and averaged.
"""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from drmoo.data.celeba import ALL_ATTRIBUTES, ATTRIBUTES, CelebA, find_celeba_root, load_celeba
from drmoo.metrics import task_metrics
from drmoo.models import MultiTaskModel, MultiTaskResNet, resolve_weights
from drmoo.optim import available
from drmoo.store import save_result

from .dr_tables import dr_comparison
from .evaluation import load_trained_run
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

__all__ = ["ATTRIBUTE_SETS", "CELEBA", "CELEBA40", "PAPER_METHOD_HPARAMS", "PRESETS", "attributes_of", "build_celeba",
           "check_celeba_data", "compare_celeba", "evaluate_celeba", "label_balancing_weights", "method_hparams",
           "metrics_table", "table_two"]

# paper: App. D (128 px, 100 epochs, B = 256, ImageNet ResNet18, the full official splits; a GPU).
# quick: a CPU look at the pipeline - 32 px, the first 2,000 training and 500 test images, one
# epoch of batch 64, no pretrained weights.  Its numbers say nothing about the paper's.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"epochs": 100, "batch_size": 256, "input_size": 128, "weights": "imagenet",
              "train_size": None, "test_size": None},
    "quick": {"epochs": 1, "batch_size": 64, "input_size": 32, "weights": "none",
              "train_size": 2000, "test_size": 500},
}

# Paper Table 5 (CelebA) with lambda = 0.8 and rho = 5e-5 for every method that has them (App. D).
COMMON = {"lam": 0.8, "rho": 5e-5}
PAPER_METHOD_HPARAMS: dict[str, dict[str, Any]] = {
    "double-loop": {"lr": 5e-4, "dual_lr": 3e-4, "pref_lr": 5e-5, "inner_steps": 5},
    "double-clip": {"lr": 5e-3, "pref_lr": 2e-2, "c1": 1.0, "c2": 0.5, "f1": 1.0, "f2": 0.5},
    "mgda": {"lr": 1e-4, "pref_lr": 5e-5},
    "modo": {"lr": 1e-4, "pref_lr": 5e-5},
    "moco": {"lr": 5e-4, "pref_lr": 5e-5, "ema": 0.95},
    "sdmgrad": {"lr": 1e-4, "pref_lr": 1e-6, "inner_steps": 5},
    "famo": {"lr": 1e-4, "pref_lr": 5e-6, "logit_decay": 1e-2},
    "nashmtl": {"lr": 1e-4, "solver_iters": 100},
}
# Each CelebA experiment's tasks, by --experiment name: the paper's 8 attributes, or all 40.
ATTRIBUTE_SETS: dict[str, tuple[str, ...]] = {"celeba": ATTRIBUTES, "celeba40": ALL_ATTRIBUTES}
METRICS = (("mean_accuracy", "Averaged Accuracy"), ("mean_balanced_accuracy", "Balanced Accuracy"),
           ("mean_auc", "AUC"))


def method_hparams(method: str, overrides: dict[str, Any] | None = None, preset: str | None = None
                   ) -> dict[str, Any]:
    """Paper Table 5 settings of ``method`` + lambda / rho where it takes them + ``overrides``."""
    if method not in available():
        raise ValueError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
    accepted = inspect.signature(available()[method].__init__).parameters
    common = {key: value for key, value in COMMON.items() if key in accepted}
    return {**common, **PAPER_METHOD_HPARAMS.get(method, {}), **(overrides or {})}


def label_balancing_weights(labels: Tensor) -> Tensor:
    """Importance weights ``[B, m]`` that make each task's batch look label-balanced (paper App. D).

    Per task, p = the batch's fraction of positive labels; positives get 1 / (2p), negatives
    1 / (2(1 - p)), so each class carries half of the weight and the weights average to 1.
    One-class rule: when a batch holds only positives or only negatives for a task (p = 0 or 1) the
    ratio is undefined and there is nothing to rebalance, so that task's whole column gets weight 1
    (the unweighted batch, which also averages to 1).
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B, m], got shape {tuple(labels.shape)}")
    positive = labels == 1
    p = positive.double().mean(dim=0, keepdim=True)
    one_class = (p == 0) | (p == 1)
    # the clamp only keeps the discarded one-class branch finite; it never changes a used weight
    weights = torch.where(positive, 0.5 / p.clamp(min=1e-12), 0.5 / (1 - p).clamp(min=1e-12))
    weights = torch.where(one_class, torch.ones_like(weights), weights)
    return weights.float()


def attributes_of(experiment: str) -> tuple[str, ...]:
    """The attributes (tasks, in order) of the CelebA experiment ``experiment``."""
    if experiment not in ATTRIBUTE_SETS:
        raise ValueError(f"unknown CelebA experiment {experiment!r}; valid choices: {', '.join(ATTRIBUTE_SETS)}")
    return ATTRIBUTE_SETS[experiment]


def check_celeba_model(config: RunConfig) -> None:
    """The model setting :func:`build_celeba` would refuse, refused without building it: a missing weights file."""
    resolve_weights(config.weights)


def build_celeba(config: RunConfig) -> tuple[MultiTaskModel, CelebA]:
    """The ResNet18 multi-task model (a two-class head per attribute) and the lazily decoded CelebA splits."""
    data = load_celeba(config.data_root, config.input_size, config.train_size, config.test_size,
                       cache_dir=config.cache_dir, attributes=attributes_of(config.experiment))
    model = MultiTaskResNet([2] * data.num_tasks, weights=resolve_weights(config.weights))
    return model, data


def predictions_and_scores(logits: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Hard predictions (argmax) and positive-class scores ``[N, m]`` of every two-class task's logits: the
    margin z_1 - z_0 (float64), which ranks the samples as the positive-class probability sigmoid(z_1 - z_0)
    does, also where that probability is NaN (a +inf logit) or rounds to 0 or 1 (NaN only where both logits
    are the same infinity or one is NaN; :func:`drmoo.metrics.roc_auc` then gives NaN)."""
    predictions = torch.stack([z.argmax(1) for z in logits], dim=1)
    scores = torch.stack([z.double()[:, 1] - z.double()[:, 0] for z in logits], dim=1)
    return predictions, scores


_json_safe = json_safe  # NaN (an undefined AUC) -> null, so eval.json is strict JSON


def evaluate_celeba(run_dir: Path, *, eps: list[float] | None = None, progress: bool = True,
                    device: str | None = None, noise_sigmas: list[float] | None = None) -> dict[str, Any]:
    """Test-split accuracy, balanced accuracy and AUC of a trained run, and its robustness block
    (:func:`~drmoo.experiments.robust_eval.robustness_report`, with the label-balancing weights' nominal);
    writes and returns eval.json's content.

    ``eps`` is accepted for the common ``Experiment.evaluate`` signature and ignored (Table 2 is clean).
    """
    config, model, data, target, provenance = load_trained_run(run_dir, build_celeba, device)
    batch = 2 * config.batch_size
    logits = collect_logits(model, data.test_images, data.test_labels, data.images, batch, target)
    predictions, scores = predictions_and_scores(logits)
    metrics = task_metrics(data.test_labels, predictions, scores, names=list(data.attributes))
    report = {"run": str(run_dir), "method": config.method, "seed": config.seed, "experiment": config.experiment,
              "split": "test", "train_samples": int(data.train_labels.shape[0]),
              "test_samples": int(data.test_labels.shape[0]), **provenance, **metrics,
              "robustness": robustness_report(model, data.test_images, data.test_labels, data.images, batch, target,
                                              config, logits, label_balancing_weights, noise_sigmas)}
    save_result(run_dir / "eval.json", json_safe(report))  # strict JSON (NaN as null), written atomically
    return report


def _percent(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def metrics_table(report: dict[str, Any]) -> str:
    """One run's metrics (%) as markdown: a row per attribute and the average."""
    lines = [
        f"CelebA test metrics on {report['test_samples']} images ({report['method']}, seed {report['seed']})",
        "",
        "| attribute | positives | accuracy | balanced accuracy | AUC |",
        "|---|---:|---:|---:|---:|",
    ]
    for i, name in enumerate(report["tasks"]):
        lines.append(f"| {name} | {_percent(report['positive_rate'][i])} | {_percent(report['accuracy'][i])} | "
                     f"{_percent(report['balanced_accuracy'][i])} | {_percent(report['auc'][i])} |")
    lines.append(f"| **average** | | {_percent(report['mean_accuracy'])} | "
                 f"{_percent(report['mean_balanced_accuracy'])} | {_percent(report['mean_auc'])} |")
    if report["auc_undefined_tasks"]:
        lines += ["", f"AUC undefined (one class in the test labels), left out of the average: "
                      f"{', '.join(report['auc_undefined_tasks'])}"]
    return "\n".join(lines) + "\n" + ("\n" + robustness_tables(report) if "robustness" in report else "")


def table_two(reports: list[dict[str, Any]], header: str) -> tuple[str, list[dict[str, Any]]]:
    """Table 2 layout: methods x {averaged accuracy, balanced accuracy, AUC} in %, mean ± std over seeds."""
    methods = list(dict.fromkeys(r["method"] for r in reports))
    lines = [header, "", "| method | " + " | ".join(title for _, title in METRICS) + " |", "|---|" + "---:|" * 3]
    rows = []
    for method in methods:
        mine = [r for r in reports if r["method"] == method]
        row: dict[str, Any] = {"method": method, "seeds": len(mine)}
        cells = []
        for key, _ in METRICS:
            values = [100 * r[key] for r in mine if r[key] is not None and not math.isnan(r[key])]
            mean, std = mean_std(values) if values else (math.nan, math.nan)
            row[key], row[key.replace("mean_", "std_")] = mean, std
            cells.append("n/a" if not values else mean_std_text(mean, std, len(values)))
        rows.append(row)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def _celeba_report_fits(report: dict[str, Any]) -> bool:
    return (isinstance(report["train_samples"], int) and isinstance(report["test_samples"], int)
            and has_robustness(report)
            and all(report[key] is None or isinstance(report[key], float) for key, _ in METRICS)
            and all(isinstance(report[key], list) for key in ("tasks", "accuracy", "balanced_accuracy", "auc")))


def check_celeba_data(config: RunConfig) -> None:
    """Refuse (one line) a --data-root without CelebA's files, before anything is written or launched."""
    find_celeba_root(config.data_root)


def compare_celeba(configs: list[RunConfig], out: Path, *, eps: list[float] | None = None,
                   progress: bool = True) -> str:
    """Train (reusing finished runs, resuming interrupted ones) and evaluate every config; write table.md/csv."""
    names = prepare_comparison(configs, out)  # a variant's label names its own directory
    reports, started = [], time.perf_counter()
    for config, name in tqdm(list(zip(configs, names)), desc="compare", disable=not progress):
        run_dir = out / name
        ensure_trained(config, run_dir, build_celeba, progress, sample_weight=label_balancing_weights)
        report = reusable_result(run_dir, _celeba_report_fits)
        if report is None:  # absent, of other weights, or not a CelebA metrics report
            report = evaluate_celeba(run_dir, progress=False)
        stopped = read_diverged(run_dir)
        reports.append({**report, "diverged_at": stopped["step"]} if stopped else report)
    first = configs[0]
    seeds = sorted({c.seed for c in configs})
    seed_text = f"mean ± std over seeds {','.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    header = (
        f"### CelebA, {len(attributes_of(first.experiment))} attributes: test metrics (%), averaged over "
        f"attributes ({seed_text})\n\n"
        f"preset `{first.preset}`: {first.input_size}px inputs, {first.epochs} epoch(s), batch {first.batch_size}, "
        f"train images {reports[0]['train_samples']}, test images {reports[0]['test_samples']}, weights "
        f"`{first.weights}`, device {first.device}; label-balancing importance weights; "
        f"{time_text(out, names, started)}"
    )
    table, rows = table_two(reports, header)
    robust = dr_comparison(reports, "double-clip", out)
    return write_comparison(out, table + ("\n" + robust if robust else ""), rows, reports)


CELEBA, CELEBA40 = (
    register(Experiment(name=name, build=build_celeba, presets=PRESETS, method_hparams=method_hparams,
                        evaluate=evaluate_celeba, eval_table=metrics_table, compare=compare_celeba,
                        sample_weight=label_balancing_weights, check_data=check_celeba_data,
                        check_model=check_celeba_model))
    for name in ATTRIBUTE_SETS
)
