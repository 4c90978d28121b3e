"""Method comparison under FGSM (paper Table 1): train and evaluate every method x seed, tabulate."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import Tensor
from tqdm.auto import tqdm

from drmoo.optim import NonFiniteStepError
from drmoo.store import (
    UsageError,
    iter_csv,
    make_directory,
    read_json,
    remove_file,
    write_csv,
    write_figure,
    write_json,
    write_text,
)

from . import multimnist
from .checkpoints import CHECKPOINT, result_matches_checkpoint
from .dr_tables import dr_comparison
from .evaluation import evaluate_robustness
from .jobs import run_in_workers
from .multimnist import build_multimnist
from .paired_stats import paired_differences, paired_markdown
from .registry import Experiment, register
from .robust_eval import robustness_tables
from .run_config import HOW_IT_RUNS, RunConfig, config_differences, read_run_config
from .summaries import fgsm_comparison, mean_std, mean_std_text
from .training import DIVERGED, Build, check_fresh_directory, check_run_names, read_diverged, train
from .variants import run_dir_name

__all__ = ["MAX_JOBS", "balancing_table", "check_distinct", "compare", "ensure_trained", "eval_table",
           "has_robustness", "preference_trace", "prepare_comparison", "robustness_figure", "robustness_table",
           "train_and_evaluate", "write_comparison"]


MAX_JOBS = 256  # worker processes of one comparison (drmoo.cli.MAX_JOBS checks the option against it)


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
    return "\n".join(lines) + "\n" + ("\n" + robustness_tables(report) if "robustness" in report else "")


def robustness_table(reports: list[dict[str, Any]], eps_values: list[float], header: str
                     ) -> tuple[str, list[dict[str, Any]]]:
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
            cells.append(mean_std_text(mean, std, len(values)))
            rows.append({"method": method, "eps": eps, "mean_acc": mean, "std_acc": std, "seeds": len(values)})
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def robustness_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """robustness.png's figure: per row, the mean accuracy over seeds against eps, in a ±1 std band over seeds.

    ``rows`` are :func:`compare`'s table.csv rows (``method``, ``eps``, ``mean_acc``, ``std_acc``,
    ``seeds``).  A row trained with one seed has no band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["method"] for r in rows))
    # Up to 10 rows: tab10; more: tab20, so that no two rows share a colour.  Variants (NAME[...]) dashed.
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    fig, axis = plt.subplots(figsize=(6.5 if len(labels) <= 8 else 9.0, 4.2), constrained_layout=True)
    seeds = max((int(r["seeds"]) for r in rows), default=1)
    for index, label in enumerate(labels):
        mine = sorted((r for r in rows if r["method"] == label), key=lambda r: r["eps"])
        xs, ys = [r["eps"] for r in mine], [r["mean_acc"] for r in mine]
        color = palette(index % palette.N)
        axis.plot(xs, ys, marker="o", ms=3, label=label, linewidth=1.2, color=color,
                  linestyle="--" if "[" in label else "-")
        if any(r["seeds"] > 1 for r in mine):
            spread = [r["std_acc"] if r["seeds"] > 1 else 0.0 for r in mine]
            axis.fill_between(xs, [y - s for y, s in zip(ys, spread)], [y + s for y, s in zip(ys, spread)],
                              color=color, alpha=0.15, linewidth=0)
    axis.set_xlabel("FGSM eps")
    axis.set_ylabel("mean task accuracy (%)")
    band = f"; mean over {seeds} seeds, band ±1 std" if seeds > 1 else ""
    axis.set_title(title + band, fontsize=10)
    axis.grid(alpha=0.3)
    if len(labels) <= 8:
        axis.legend(fontsize=8)
    else:  # beside the axes: inside, a dozen entries would hide the curves
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = robustness_figure(rows, title)
    write_figure(fig, path, dpi=120)
    plt.close(fig)


def _ended(run_dir: Path) -> bool:
    """The run in ``run_dir`` ended: trained to its length (``done``), or stopped at a non-finite step."""
    return (run_dir / "done").is_file() or (run_dir / DIVERGED).is_file()


def _finished(run_dir: Path, config: RunConfig) -> bool:
    """``run_dir`` holds ``config``'s run, ended: trained to its length, or stopped at a non-finite step (where
    and how its steps ran aside: device, CUDA graphs, the data cache's folder)."""
    if not _ended(run_dir) or not (run_dir / "config.json").is_file():
        return False
    try:
        saved, wanted = asdict(read_run_config(run_dir)), asdict(config)
        return all(saved[key] == wanted[key] for key in saved.keys() | wanted.keys() if key not in HOW_IT_RUNS)
    except (UsageError, FileNotFoundError):
        return False  # a damaged config.json: ensure_trained's checks below decide


# The key a reused report carries when its run came without its checkpoint (see reusable_result).
WEIGHTS_ABSENT = "weights_absent"


def has_robustness(report: dict[str, Any]) -> bool:
    """A report with the robustness block, or one that cannot be recomputed (its weights are absent): an
    eval.json of an older drmoo, without the block, is recomputed where its checkpoint is there."""
    return isinstance(report.get("robustness"), dict) or bool(report.get(WEIGHTS_ABSENT))


def reusable_result(run_dir: Path, valid: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """``run_dir``'s eval.json when it is readable, ``valid`` and computed from the checkpoint there now; else None.

    A result of other weights (the run was extended since), of a damaged or forged file, or of an
    older drmoo that did not record its checkpoint is recomputed, never shown beside the new run.

    One exception: a finished run shared without its weights (committed results keep no
    ``checkpoint.pt``) cannot be re-evaluated, and retraining it would overwrite the run it came as.
    Its eval.json is reused when it records the checkpoint it was computed from, marked
    ``weights_absent`` so that the table says which results were not checked against weights
    (:func:`run_notes`).  Move such a run aside to retrain and re-evaluate it.
    """
    try:
        report = read_json(run_dir / "eval.json", what="evaluation")
    except (UsageError, FileNotFoundError):
        return None
    if not isinstance(report, dict):
        return None
    if not result_matches_checkpoint(run_dir, report):
        if not _shared_without_weights(run_dir, report):
            return None
        report = {**report, WEIGHTS_ABSENT: True}
    try:
        return report if valid(report) else None
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def _shared_without_weights(run_dir: Path, report: dict[str, Any]) -> bool:
    """An ended run (trained to its length, or stopped at a non-finite step: ``done`` or the diverged
    marker) with no checkpoint file at all, whose report says which checkpoint it evaluated."""
    recorded = report.get("checkpoint")
    return (not os.path.lexists(run_dir / CHECKPOINT) and _ended(run_dir)
            and isinstance(recorded, dict) and isinstance(recorded.get("payload_sha256"), str))


def _fgsm_report_fits(report: dict[str, Any], eps_values: list[float], eps_space: str) -> bool:
    results = report["results"]
    return (isinstance(results, list) and [r["eps"] for r in results] == list(eps_values)
            and has_robustness(report)
            and all(isinstance(r["mean_acc"], float) and isinstance(r["task_acc"], list) for r in results)
            and report.get("eps_space", "pixel") == eps_space
            and all(isinstance(report[key], int) for key in ("test_samples", "iterations", "samples_seen")))


def ensure_trained(config: RunConfig, run_dir: Path, build: Build,
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
    try:
        train(config, run_dir, build, resume=resume, progress=progress, sample_weight=sample_weight)
    except NonFiniteStepError:
        # A diverged run is a result of the comparison (train saved its last finite state and marked
        # it ``diverged``): it is evaluated and reported as stopped, and the other runs go on.
        if read_diverged(run_dir) is None:
            raise
    remove_file(run_dir / "eval.json")


def preference_trace(run_dir: Path) -> dict[str, list[float]] | None:
    """The preference w of a run from its steps.csv: ``{"final": w_T, "low": min_t w_t, "high": max_t w_t}``.

    None when the run has no readable per-step log (an older run, or a damaged file): the balancing
    table then says n/a for it instead of guessing.
    """
    keys: list[str] = []
    final: list[float] = []
    low: list[float] = []
    high: list[float] = []
    try:  # streamed by the store (256 MiB, one row at a time): only w's last value and range are kept
        for row in iter_csv(run_dir / "steps.csv", what="per-step log"):
            if not keys:
                keys = sorted((k for k in row if k.startswith("w_")), key=lambda k: int(k[2:]))
                if not keys:
                    return None
            final = [float(row[k]) for k in keys]
            if any(not math.isfinite(v) for v in final):
                return None
            low = [min(a, b) for a, b in zip(low, final)] if low else list(final)
            high = [max(a, b) for a, b in zip(high, final)] if high else list(final)
    except (OSError, ValueError, KeyError, TypeError):  # missing, refused (a UsageError) or not numbers
        return None
    if not final:
        return None
    return {"final": final, "low": low, "high": high}


def balancing_table(traces: dict[str, list[dict[str, list[float]] | None]]) -> str:
    """What each row's balancing did: its final w (mean over seeds) and the range w took during training."""
    lines = ["What the balancing did: the preference w at the end of training (mean over seeds) and the range "
             "each w_i took over all steps and seeds. Uniform is 1/m for every task.", "",
             "| row | final w | range of w_i over training |", "|---|---|---|"]
    for label, runs in traces.items():
        known = [trace for trace in runs if trace is not None]
        if not known:
            lines.append(f"| {label} | n/a | n/a |")
            continue
        tasks = len(known[0]["final"])
        final = [sum(t["final"][i] for t in known) / len(known) for i in range(tasks)]
        spans = [f"[{min(t['low'][i] for t in known):.4f}, {max(t['high'][i] for t in known):.4f}]"
                 for i in range(tasks)]
        lines.append(f"| {label} | {', '.join(f'{v:.4f}' for v in final)} | {' / '.join(spans)} |")
    return "\n".join(lines) + "\n"


def train_and_evaluate(config: RunConfig, run_dir: Path, eps_values: list[float], eps_space: str,
                       progress: bool) -> tuple[dict[str, Any], dict[str, list[float]] | None]:
    """One run of a comparison: trained (or reused / resumed) and FGSM-evaluated; its report and w trace."""
    ensure_trained(config, run_dir, build_multimnist, progress)
    report = reusable_result(run_dir, lambda r: _fgsm_report_fits(r, list(eps_values), eps_space))
    if report is None:  # absent, damaged, for other eps, or of other weights than the checkpoint's now
        report = evaluate_robustness(run_dir, build_multimnist, list(eps_values), progress=False,
                                     eps_space=eps_space)
    # its iterations / samples are those of the weights it evaluated (recorded from the checkpoint)
    stopped = read_diverged(run_dir)
    return {**report, "label": config.name, **({"diverged_at": stopped["step"]} if stopped else {})}, \
        preference_trace(run_dir)


def run_notes(reports: list[dict[str, Any]]) -> str:
    """What the table must say about some of its runs (empty when nothing): those that stopped at a
    non-finite step, and those reused from an eval.json whose weights were not there to check it."""
    return "\n".join(note for note in (_diverged_note(reports), _weights_absent_note(reports)) if note)


def _weights_absent_note(reports: list[dict[str, Any]]) -> str:
    shared = [r for r in reports if r.get(WEIGHTS_ABSENT)]
    if not shared:
        return ""
    runs = ", ".join(f"{r.get('label', r['method'])} seed {r['seed']}" for r in shared)
    return (f"Reused from their eval.json without their weights (the run directories hold no checkpoint.pt, "
            f"as committed results do not), so not re-evaluated here: {runs}. Move a run aside to retrain and "
            "re-evaluate it.\n")


def _diverged_note(reports: list[dict[str, Any]]) -> str:
    """The runs that stopped at a non-finite step, by row: which seed, where (empty when none did)."""
    stopped = [r for r in reports if "diverged_at" in r]
    if not stopped:
        return ""
    lines = ["Runs that stopped at a non-finite step: each is evaluated as the method left it, after the last "
             "iteration it completed, and counted in its row's mean like any other seed.", "",
             "| row | seed | failed at iteration |", "|---|---:|---:|"]
    lines += [f"| {r.get('label', r['method'])} | {r['seed']} | {r['diverged_at']} |" for r in stopped]
    return "\n".join(lines) + "\n"


def _run_all(configs: list[RunConfig], run_dirs: list[Path], eps_values: list[float], eps_space: str, jobs: int,
             progress: bool) -> list[tuple[dict[str, Any], dict[str, list[float]] | None]]:
    """:func:`train_and_evaluate` of every config, in this process or in ``jobs`` worker processes.

    Small models gain little from torch's intra-op threads: on a 2-core CPU two one-thread runs side
    by side finish a comparison of MultiLeNets about twice as fast as one two-thread run at a time.
    Each worker gets ``cores // jobs`` threads, shows its training progress through the parent (one
    bar per running job) and dies with the parent (see :mod:`drmoo.experiments.jobs`).  The first
    failure stops the comparison (the runs already finished are kept and reused by the next call).
    """
    if jobs == 1 or len(configs) == 1:
        return [train_and_evaluate(config, run_dir, eps_values, eps_space, progress)
                for config, run_dir in tqdm(list(zip(configs, run_dirs)), desc="compare", disable=not progress)]
    calls = [(config, run_dir, eps_values, eps_space, progress) for config, run_dir in zip(configs, run_dirs)]
    names = [f"{config.name} seed {config.seed}" for config in configs]
    return run_in_workers(train_and_evaluate, calls, jobs, names, progress=progress)


def _effective_settings(config: RunConfig) -> str:
    """What a run trains with, whatever its label says, as one comparable key: every field but the label,
    and the method's hyperparameters as its optimizer takes them -- its own defaults filled in
    (``lam=0.8`` given or left out alike) and each value normalised by the optimizer's check (``lam='0.5'``
    trains as ``lam=0.5``)."""
    import inspect

    from drmoo.optim import available

    settings = asdict(config)
    settings.pop("label")
    hparams = dict(settings["hparams"])
    optimizer = available().get(config.method)
    if optimizer is not None:
        for name, parameter in inspect.signature(optimizer.__init__).parameters.items():
            if parameter.default is not inspect.Parameter.empty and name not in ("self", "backend"):
                hparams.setdefault(name, parameter.default)
        for name, value in hparams.items():
            try:
                hparams[name] = optimizer.check_hyperparameter(name, value)
            except (TypeError, ValueError):
                pass  # refused where the run is built; here it is only compared
    settings["hparams"] = hparams
    return json.dumps(settings, sort_keys=True, default=repr)


def check_distinct(configs: list[RunConfig]) -> None:
    """Refuse a comparison that lists one run twice: a row and seed given twice, or two rows whose
    settings are the same under different labels (``double-clip`` and ``double-clip[lam=0.8]`` when
    0.8 is the default; ``mgda[solver='min_norm']`` and ``mgda[solver=min_norm]``; ``mgda[lam=0.5]``
    and ``mgda[lam='0.5']``): either would be one run trained and counted as two.  One pass (names
    counted, settings keyed): 20,000 seeds are checked in a second, not compared pairwise for minutes."""
    if not configs:
        raise UsageError("nothing to compare: no method x seed given")
    names = Counter(run_dir_name(c.name, c.seed) for c in configs)
    repeated = sorted(name for name, count in names.items() if count > 1)
    if repeated:
        raise UsageError(f"the comparison lists {', '.join(repeated)} twice (or two variants share its directory): "
                         "give each method, variant and seed once")
    seen: dict[str, RunConfig] = {}
    for config in configs:
        twin = seen.setdefault(_effective_settings(config), config)
        if twin is not config:
            raise UsageError(f"--methods: {twin.name} and {config.name} are the same settings (every hyperparameter "
                             "and run length alike, defaults included) and would train the same run twice under "
                             "two labels: give only one of them")


def prepare_comparison(configs: list[RunConfig], out: Path) -> list[str]:
    """Check a comparison before it trains (no run twice, run names that fit ``out``, ``out`` drmoo's own
    or new), create ``out``, and return the run directories' names, in ``configs``' order."""
    check_distinct(configs)
    names = [run_dir_name(config.name, config.seed) for config in configs]
    check_run_names(out, names)
    check_fresh_directory(out, "comparison directory", runs_below=True)
    make_directory(out)
    return names


def time_text(out: Path, names: list[str], started: float) -> str:
    """The header's timing: this call's wall time, and the training time its runs (``out/<name>``, the names
    :func:`prepare_comparison` returned) recorded themselves.

    A comparison reuses finished runs, so the call's own time says nothing about what the rows cost; each
    run's ``steps.csv`` keeps every optimizer step's ``step_s`` (a resumed run appends to it), and their sum
    is the training the table rests on, whenever and in whatever process it ran (evaluation not included).
    """
    call = f"wall time of this call {time.perf_counter() - started:.0f}s"
    totals = [total for name in names if (total := _step_seconds(out / name / "steps.csv")) is not None]
    if not totals or len(totals) != len(names):
        return call  # a run without its step log (an older run directory): no sum to state
    return f"{call}; the {len(totals)} runs' optimizer steps {sum(totals):,.0f}s in all"


def _step_seconds(path: Path) -> float | None:
    try:
        return sum(float(row["step_s"]) for row in iter_csv(path, what="step log"))
    except (OSError, KeyError, TypeError, ValueError):
        return None


def write_comparison(out: Path, table: str, rows: list[dict[str, Any]], reports: list[dict[str, Any]]) -> str:
    """``table`` with :func:`run_notes` of ``reports`` appended, written as ``out/table.md``, and ``rows`` as
    ``out/table.csv``; returns the written table."""
    note = run_notes(reports)
    if note:
        table += "\n" + note
    write_text(out / "table.md", table)
    write_csv(out / "table.csv", rows)
    return table


def compare(configs: list[RunConfig], out: Path, eps_values: list[float], progress: bool = True,
            eps_space: str = "pixel", reference: str = "double-clip", jobs: int = 1) -> str:
    """Train (skipping finished runs, resuming interrupted ones) and evaluate each config; write the tables.

    table.md / table.csv: ours (mean ± std over seeds, rank per eps, iterations and samples drawn)
    beside the paper's Table 1, the paired differences ``reference`` minus every other row per eps
    (when the comparison has that row and more than one row), and what each row's balancing did to w;
    paired.csv: the paired differences; agreement.json: Kendall's tau-b of the two orderings per eps.
    Rows are labelled by :attr:`RunConfig.name` (a variant's label, else the method).  ``jobs`` > 1
    trains that many runs at once in worker processes (see :func:`_run_all`).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise UsageError(f"--jobs must be an integer in [1, {MAX_JOBS}], got {jobs!r}")
    names = prepare_comparison(configs, out)
    started = time.perf_counter()
    jobs_done = _run_all(configs, [out / name for name in names], list(eps_values), eps_space, jobs, progress)
    reports = [report for report, _ in jobs_done]
    traces: dict[str, list[dict[str, list[float]] | None]] = {}
    for config, (_, trace) in zip(configs, jobs_done):
        traces.setdefault(config.name, []).append(trace)
    first = configs[0]
    seeds = sorted({c.seed for c in configs})
    seed_text = f"mean ± std over seeds {','.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    header = (
        f"### {first.experiment}: accuracy (%) under FGSM, mean over tasks ({seed_text})\n\n"
        f"preset `{first.preset}`: model `{first.model}`, {first.input_size}px inputs, {first.epochs} epoch(s), "
        f"batch {first.batch_size}, "
        f"train composites {first.train_size or 'all'}"
        f"{' (random shifts)' if multimnist.PRESET_SHIFT.get(first.preset) else ''}, "
        f"{'validation' if first.eval_split == 'validation' else 'test'} composites "
        f"{reports[0]['test_samples']}, weights `{first.weights}`, device {first.device}; FGSM eps in {eps_space} "
        f"units; {time_text(out, names, started)}.  Every method runs ceil(N/B) iterations per "
        "epoch but draws a different number of batches per iteration: compare the samples seen."
    )
    table, rows, agreement = fgsm_comparison(reports, list(eps_values), header, first.experiment)
    per_seed: dict[str, dict[float, dict[int, float]]] = {}
    for report in reports:
        mine = per_seed.setdefault(report["label"], {})
        for result in report["results"]:
            mine.setdefault(result["eps"], {})[report["seed"]] = 100 * result["mean_acc"]
    paired = []
    if reference in per_seed and len(per_seed) > 1:
        paired = paired_differences(per_seed, reference, list(eps_values))
        labels = {eps: "Clean" if eps == 0 else f"{eps:g}" for eps in eps_values}
        table += "\n" + paired_markdown(paired, labels, unit="accuracy points")
    if paired:
        write_csv(out / "paired.csv", paired)
    else:  # no paired differences in this comparison: one left by an earlier one would be read as its own
        remove_file(out / "paired.csv")
    robust = dr_comparison(reports, reference, out)
    if robust:
        table += "\n" + robust
    note = run_notes(reports)
    if note:
        table += "\n" + note
    table += "\n" + balancing_table(traces)
    write_text(out / "table.md", table)
    write_json(out / "agreement.json", {**agreement, "eps_space": eps_space})
    write_csv(out / "table.csv", rows)
    _plot(rows, out / "robustness.png", f"{first.experiment} ({first.preset} preset): accuracy vs FGSM eps")
    return table


def _multimnist_experiment(name: str) -> Experiment:
    """Multi-MNIST with ``name``'s digit count: built by multimnist.py, FGSM-evaluated and compared here."""

    def evaluate(run_dir: Path, *, eps: list[float], progress: bool = True, device: str | None = None,
                 eps_space: str = "pixel", noise_sigmas: list[float] | None = None) -> dict[str, Any]:
        return evaluate_robustness(run_dir, build_multimnist, eps, progress=progress, device=device,
                                   eps_space=eps_space, noise_sigmas=noise_sigmas)

    def compare_runs(configs: list[RunConfig], out: Path, *, eps: list[float], progress: bool = True,
                     eps_space: str = "pixel", reference: str = "double-clip", jobs: int = 1) -> str:
        return compare(configs, out, eps, progress=progress, eps_space=eps_space, reference=reference, jobs=jobs)

    presets = {preset: values[name] for preset, values in multimnist.PRESETS.items() if name in values}
    hparams = functools.partial(multimnist.method_hparams, experiment=name)
    return Experiment(name, build_multimnist, presets, hparams, evaluate, eval_table, compare_runs,
                      check_data=multimnist.check_digit_source, check_model=multimnist.check_model_settings)


for _name in multimnist.DIGIT_COUNTS:  # registered on import (drmoo.experiments.registry looks them up)
    register(_multimnist_experiment(_name))
