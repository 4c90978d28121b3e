"""Method comparison under FGSM (paper Table 1): train and evaluate every method x seed, tabulate."""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from tqdm.auto import tqdm

from . import multimnist
from .multimnist import build_multimnist
from .registry import Experiment, register
from .reporting import fgsm_comparison, training_progress
from .training import (
    CHECKPOINT,
    RunConfig,
    UsageError,
    config_differences,
    evaluate_robustness,
    read_run_config,
    train,
)

__all__ = ["compare", "ensure_trained", "eval_table", "robustness_table"]


def eval_table(report: dict[str, Any]) -> str:
    """One run's FGSM accuracies as a markdown table (rows eps, columns tasks + mean)."""
    tasks = len(report["results"][0]["task_acc"])
    lines = [
        f"FGSM on {report['test_samples']} test images, eps in {report.get('eps_space', 'pixel')} units "
        f"({report['experiment']}, {report['method']}, seed {report['seed']})",
        "",
        "| eps | " + " | ".join(f"task {i + 1}" for i in range(tasks)) + " | mean |",
        "|---|" + "---:|" * (tasks + 1),
    ]
    for row in report["results"]:
        cells = " | ".join(f"{100 * a:.2f}" for a in row["task_acc"])
        lines.append(f"| {row['eps']:g} | {cells} | {100 * row['mean_acc']:.2f} |")
    return "\n".join(lines) + "\n"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))


def robustness_table(reports: list[dict[str, Any]], eps_values: list[float], header: str) -> tuple[str, list[dict]]:
    """Table 1 layout: methods x eps, mean ± std over seeds of the task-averaged accuracy (%)."""
    methods = list(dict.fromkeys(r["method"] for r in reports))
    columns = ["Clean" if eps == 0 else f"{eps:g}" for eps in eps_values]
    lines = [header, "", "| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    rows = []
    for method in methods:
        cells = []
        for eps in eps_values:
            values = [100 * res["mean_acc"] for r in reports if r["method"] == method
                      for res in r["results"] if abs(res["eps"] - eps) < 1e-12]
            mean, std = mean_std(values)
            cells.append(f"{mean:.2f} ± {std:.2f}" if len(values) > 1 else f"{mean:.2f}")
            rows.append({"method": method, "eps": eps, "mean_acc": mean, "std_acc": std, "seeds": len(values)})
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        xs, ys, err = [r["eps"] for r in mine], [r["mean_acc"] for r in mine], [r["std_acc"] for r in mine]
        axis.errorbar(xs, ys, yerr=err if any(r["seeds"] > 1 for r in mine) else None, marker="o", ms=3,
                      capsize=2, label=method, linewidth=1.2)
    axis.set_xlabel("FGSM eps")
    axis.set_ylabel("mean task accuracy (%)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finished(run_dir: Path, config: RunConfig) -> bool:
    saved = run_dir / "config.json"
    return (run_dir / "done").is_file() and saved.is_file() and json.loads(saved.read_text()) == asdict(config)


def ensure_trained(config: RunConfig, run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]],
                   progress: bool = True, sample_weight: Callable[[Tensor], Tensor] | None = None) -> None:
    """Train ``config`` in ``run_dir`` unless it finished there with the same settings.

    Never deletes a run: an interrupted run with the same settings resumes, and so does a run that
    differs only in how far it goes (``epochs`` / ``max_steps``: it is extended; shortening it is
    refused).  A run with any other settings is refused with one line and kept as it is.  A
    (re)trained run loses its eval.json (it describes the old weights), so the caller re-evaluates it.
    """
    if _finished(run_dir, config):
        return
    resume = (run_dir / CHECKPOINT).is_file()
    if resume:
        if not (run_dir / "config.json").is_file():
            raise UsageError(f"{run_dir} holds a checkpoint without config.json; it is kept: move it aside or pick "
                             "another --out")
        differences = config_differences(read_run_config(run_dir), config)
        if differences:
            raise UsageError(f"{run_dir} holds a run with other settings ({'; '.join(differences)}); it is kept: "
                             "move it aside or pick another --out")
    train(config, run_dir, build, resume=resume, progress=progress, sample_weight=sample_weight)
    (run_dir / "eval.json").unlink(missing_ok=True)


def compare(configs: list[RunConfig], out: Path, eps_values: list[float], progress: bool = True,
            eps_space: str = "pixel") -> str:
    """Train (skipping finished runs, resuming interrupted ones) and evaluate each config; write the tables.

    table.md / table.csv: ours (mean ± std over seeds, rank per eps, iterations and samples drawn)
    beside the paper's Table 1; agreement.json: Kendall's tau-b of the two orderings per eps.
    """
    out.mkdir(parents=True, exist_ok=True)
    reports, started = [], time.perf_counter()
    for config in tqdm(configs, desc="compare", disable=not progress):
        run_dir = out / f"{config.method}-seed{config.seed}"
        ensure_trained(config, run_dir, build_multimnist, progress)
        eval_path = run_dir / "eval.json"
        report = json.loads(eval_path.read_text()) if eval_path.is_file() else None
        if (report is None or [r["eps"] for r in report["results"]] != list(eps_values)
                or report.get("eps_space", "pixel") != eps_space):
            report = evaluate_robustness(run_dir, build_multimnist, list(eps_values), progress=False,
                                         eps_space=eps_space)
        reports.append({**report, **training_progress(run_dir)})
    first = configs[0]
    seeds = sorted({c.seed for c in configs})
    seed_text = f"mean ± std over seeds {','.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    header = (
        f"### {first.experiment}: accuracy (%) under FGSM, mean over tasks ({seed_text})\n\n"
        f"preset `{first.preset}`: {first.input_size}px inputs, {first.epochs} epoch(s), batch {first.batch_size}, "
        f"train composites {first.train_size or 'all'}"
        f"{' (random shifts)' if multimnist.PRESET_SHIFT.get(first.preset) else ''}, test composites "
        f"{reports[0]['test_samples']}, weights `{first.weights}`, device {first.device}; FGSM eps in {eps_space} "
        f"units; wall time {time.perf_counter() - started:.0f}s.  Every method runs ceil(N/B) iterations per "
        "epoch but draws a different number of batches per iteration: compare the samples seen."
    )
    table, rows, agreement = fgsm_comparison(reports, list(eps_values), header, first.experiment)
    (out / "table.md").write_text(table)
    (out / "agreement.json").write_text(json.dumps({**agreement, "eps_space": eps_space}, indent=2))
    with (out / "table.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, out / "robustness.png", f"{first.experiment} ({first.preset} preset): accuracy vs FGSM eps")
    return table


def _multimnist_experiment(name: str) -> Experiment:
    """Multi-MNIST with ``name``'s digit count: built by multimnist.py, FGSM-evaluated and compared here."""

    def evaluate(run_dir: Path, *, eps: list[float], progress: bool = True, device: str | None = None,
                 eps_space: str = "pixel") -> dict[str, Any]:
        return evaluate_robustness(run_dir, build_multimnist, eps, progress=progress, device=device,
                                   eps_space=eps_space)

    def compare_runs(configs: list[RunConfig], out: Path, *, eps: list[float], progress: bool = True,
                     eps_space: str = "pixel") -> str:
        return compare(configs, out, eps, progress=progress, eps_space=eps_space)

    presets = {preset: values[name] for preset, values in multimnist.PRESETS.items()}
    return Experiment(name, build_multimnist, presets, multimnist.method_hparams, evaluate, eval_table, compare_runs)


for _name in multimnist.EXPERIMENTS:  # registered on import (drmoo.experiments.registry looks them up)
    register(_multimnist_experiment(_name))
