"""The synthetic experiments of App. E: every method on the DR dual of a small multi-task problem.

``run_synthetic`` trains each (method, seed) with the paper's settings (``PAPER_PRESETS``), logs the
balanced gradient norm, the per-task dual objectives, w and eta at every iteration, and writes

* ``runs/<method>-seed<k>.csv`` - one file per finished run (a rerun skips finished runs; a finished run made
  with other settings is refused and kept, never replaced);
* ``metrics.csv`` - all iterations of all runs;
* ``convergence.csv`` / ``convergence.png`` - mean and spread over seeds vs iterations and vs samples
  consumed (paper Fig. 3);
* ``summary.json`` / ``summary.md`` - settings and the final balanced gradient norm per method, and the final
  parameters' loss metrics on the whole data set (mean, CVaR, worst cases; ``runs/<method>-seed<k>-tail.json``
  per run).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from drmoo._echo import echo_items, first_repeat
from drmoo.optim import available, create
from drmoo.optim._method_arguments import accepted_hyperparameters, check_hyperparameter_values
from drmoo.store import (
    LOCK_FILE,
    TEMP_SUFFIX,
    UsageError,
    iter_csv,
    json_bytes,
    make_directory,
    parse_json,
    read_json,
    write_csv,
    write_json,
    write_text,
)

from .problems import BatchStream, Problem, make_linear_problem, make_wine_problem
from .robust_eval import LOSS_METRICS
from .summaries import aggregate_curves, mean_std, plot_convergence, summary_table

__all__ = ["PAPER_PRESETS", "PROBLEMS", "SyntheticConfig", "check_output_directory", "run_synthetic"]

PROBLEMS: dict[str, Callable[..., Problem]] = {"linear": make_linear_problem, "wine": make_wine_problem}
MAX_STEPS, MAX_BATCH, MAX_SEED = 10_000_000, 1 << 20, 2**63 - 1  # upper bounds (typos, int64 overflow)

def _class_presets(problem: str, methods: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The named presets the baseline classes carry (one source for those numbers)."""
    return {method: available()[method].preset(problem) for method in methods}


# Paper App. E hyperparameters, by problem and method.  lam is not stated for the synthetic runs;
# 0.6 (the Multi-MNIST value, DESIGN §5) is used for all of them.
PAPER_PRESETS: dict[str, dict[str, Any]] = {
    "linear": {
        "steps": 600,
        "batch_size": 256,
        "methods": {
            # App. E.1: gamma = 1e-2, c1 = f1 = 0.5, c2 = f2 = 0.1, rho = 1e-5.  beta is not stated;
            # 1e-2 is the value App. F.3 uses for both beta and gamma on the same problem.
            "double-clip": {"lr": 1e-2, "pref_lr": 1e-2, "c1": 0.5, "f1": 0.5, "c2": 0.1, "f2": 0.1, "rho": 1e-5},
            # App. E.1: D = 20, gamma = 5e-3, alpha = beta = 5e-5, rho = 1e-5.
            "double-loop": {"inner_steps": 20, "dual_lr": 5e-3, "lr": 5e-5, "pref_lr": 5e-5, "rho": 1e-5},
            # App. E.1 settings of MGDA, MoDo, MoCo and SDMGrad: the classes' own "linear" presets.
            **_class_presets("linear", ("mgda", "modo", "moco", "sdmgrad")),
            # Not in App. E.1 (the paper's synthetic figure has no NashMTL/FAMO line): the MGDA-family lr.
            "nashmtl": {"lr": 1e-5},
            "famo": {"lr": 1e-5, "pref_lr": 2.5e-3},
        },
        "common": {"lam": 0.6},
    },
    "wine": {
        "steps": 1000,
        "batch_size": 256,
        "methods": {
            # App. E.2: gamma = 1e-2, c1 = f1 = 0.5, c2 = f2 = 0.1, rho = 1e-5 (beta as for linear).
            "double-clip": {"lr": 1e-2, "pref_lr": 1e-2, "c1": 0.5, "f1": 0.5, "c2": 0.1, "f2": 0.1, "rho": 1e-5},
            # App. E.2: D = 15, gamma = 5e-3, alpha = 1e-3, beta = 6e-4, rho = 1e-6.
            "double-loop": {"inner_steps": 15, "dual_lr": 5e-3, "lr": 1e-3, "pref_lr": 6e-4, "rho": 1e-6},
            # App. E.2 settings of MGDA, MoDo, MoCo and SDMGrad: the classes' own "wine" presets.
            **_class_presets("wine", ("mgda", "modo", "moco", "sdmgrad")),
            # Not in App. E.2: the baselines' lr 1e-3, FAMO's Multi-MNIST logit lr.
            "nashmtl": {"lr": 1e-3},
            "famo": {"lr": 1e-3, "pref_lr": 2.5e-3},
        },
        "common": {"lam": 0.6},
    },
}


@dataclass
class SyntheticConfig:
    problem: str = "linear"
    methods: Sequence[str] = ("double-clip", "double-loop")
    seeds: Sequence[int] = (0,)
    steps: int | None = None
    batch_size: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    data_root: str | None = None

    def resolved(self) -> dict[str, Any]:
        if self.problem not in PAPER_PRESETS:
            raise ValueError(f"unknown problem {self.problem!r}; valid choices: {', '.join(PAPER_PRESETS)}")
        preset = PAPER_PRESETS[self.problem]
        unknown = [m for m in self.methods if m not in available()]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; valid choices: {', '.join(available())}")
        missing = [m for m in self.methods if m not in preset["methods"]]
        if missing:
            raise ValueError(f"no paper preset for method(s) {missing} on problem {self.problem!r}")
        if not self.methods:
            raise ValueError("no methods to run")
        # None means "the paper's value"; 0 or a negative count is refused, never read as "default".
        for name, value, bound in (("--steps", self.steps, MAX_STEPS), ("--batch-size", self.batch_size, MAX_BATCH)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound):
                raise ValueError(f"{name} must be an integer >= 1 and <= {bound}, got {value!r}")
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED
                                 for s in self.seeds):
            raise ValueError(f"seeds must be integers from 0 to {MAX_SEED}, got {echo_items(self.seeds)}")
        # a repeated seed or method would be run once and counted as two independent runs
        repeated = first_repeat(self.seeds)
        if repeated is not None:
            raise ValueError(f"--seeds repeats a seed: {repeated} ({echo_items(self.seeds)}); a seed given twice is "
                             "one run counted twice")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods repeat: {', '.join(self.methods)}; give each method once")
        for method in self.methods:
            _check_overrides(method, self.overrides)
        return {
            "problem": self.problem,
            "steps": int(preset["steps"] if self.steps is None else self.steps),
            "batch_size": int(preset["batch_size"] if self.batch_size is None else self.batch_size),
            "seeds": [int(s) for s in self.seeds],
            "methods": {
                m: {**preset["common"], **preset["methods"][m], **self.overrides} for m in self.methods
            },
        }

    def check(self) -> dict[str, Any]:
        """:meth:`resolved`, then every method's hyperparameter values (its optimizer built on a stand-in
        parameter) and the problem's data (the wine CSV read): everything a run would refuse, checked
        before anything is written.  Returns the resolved settings."""
        settings = self.resolved()
        for method, hparams in settings["methods"].items():
            check_hyperparameter_values(method, hparams, NUM_TASKS)
        check_problem_data(self.problem, self.data_root)
        return settings


def _check_overrides(method: str, overrides: dict[str, Any]) -> None:
    """Refuse hyperparameters ``method``'s optimizer does not take (a typo would crash mid-run)."""
    accepted = accepted_hyperparameters(method)
    if accepted is None:
        return
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {', '.join(unknown)} for {method}; valid: "
                         f"{', '.join(sorted(accepted))}")


NUM_TASKS = 3  # both problems have three tasks


def check_problem_data(problem: str, data_root: str | None) -> None:
    """Refuse a problem whose data is missing or unreadable (wine without --data-root, a wrong path, a
    malformed CSV) before anything is written; linear is generated and needs nothing."""
    if problem != "linear":
        PROBLEMS[problem](seed=0, data_root=data_root)


# ---------------------------------------------------------------------------- the output directory

RUNS = "runs"
# A run's files in runs/: <method>-seed<k>.csv, .json (its settings, written last) and -tail.json, and the
# temporaries of their writes (the store's, and the ".tmp" names of older versions).
_RUN_FILE = re.compile(r"[A-Za-z0-9_.-]+-seed[0-9]+(?:-tail)?(?:\.csv|\.json|\.tmp|\.csv\.tmp|\.json\.tmp)")


def _entries(directory: Path) -> list[str] | None:
    """The names in ``directory`` less the store's lock and temporaries; None when it is not there."""
    try:
        return [name for name in os.listdir(directory) if name != LOCK_FILE and not name.endswith(TEMP_SUFFIX)]
    except (FileNotFoundError, NotADirectoryError):  # absent (or a file in the way: make_directory says so)
        return None
    except OSError as error:
        raise UsageError(f"cannot list the output directory {directory}: {error.strerror or error}") from None


def _holds_synthetic_output(out: Path) -> bool:
    """Whether ``out`` holds what ``run_synthetic`` writes: a real ``runs/`` directory holding only run files
    (empty when the first run was interrupted)."""
    runs = out / RUNS
    if runs.is_symlink() or not runs.is_dir():
        return False
    names = _entries(runs)
    return names is not None and all(_RUN_FILE.fullmatch(name) for name in names)


_UNSET = object()
_META_KEYS = frozenset({"problem", "hparams", "steps", "batch_size", "seed"})


def _run_differences(saved: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """What differs between a finished run's saved settings and these ones, one ``KEY SAVED there, NEW now``
    each (the hyperparameters by their own names)."""
    def show(value: Any) -> str:
        return "unset" if value is _UNSET else json.dumps(value, default=str)

    differences = []
    for key in ("problem", "steps", "batch_size", "seed"):
        if saved.get(key, _UNSET) != meta[key]:
            differences.append(f"{key} {show(saved.get(key, _UNSET))} there, {show(meta[key])} now")
    before, now = saved.get("hparams"), meta["hparams"]
    before = before if isinstance(before, dict) else {}
    for key in sorted(set(before) | set(now)):
        if before.get(key, _UNSET) != now.get(key, _UNSET):
            differences.append(f"{key} {show(before.get(key, _UNSET))} there, {show(now.get(key, _UNSET))} now")
    return differences


def _run_meta(settings: dict[str, Any], method: str, seed: int) -> dict[str, Any]:
    """The settings file of (method, seed)'s run, as it reads back from JSON (tuples become lists)."""
    meta = {"problem": settings["problem"], "hparams": settings["methods"][method], "steps": settings["steps"],
            "batch_size": settings["batch_size"], "seed": seed}
    read_back: dict[str, Any] = parse_json(json_bytes(meta), "run settings")
    return read_back


def check_output_directory(out_dir: str | Path, settings: dict[str, Any]) -> None:
    """Refuse, before anything is written, an output directory that a run of ``settings`` would damage.

    * A directory that is not empty and holds no ``run_synthetic`` output (no ``runs/`` of run files) is
      someone's data: refused, never written into.
    * A finished run (its settings file written last) of one of ``settings``' (method, seed) pairs made
      with other settings is refused and kept, naming what differs: a rerun reuses finished work and
      never replaces it.  An unreadable settings file is a damaged result and is redone.
    """
    out = Path(out_dir)
    names = _entries(out)
    if not names:
        return  # new or empty: nothing to keep
    if not _holds_synthetic_output(out):
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise UsageError(f"the output directory {out} is not empty and holds no drmoo synthetic output ({shown}): "
                         "refusing to write into it; pick a new or empty --out")
    for method in settings["methods"]:
        for seed in settings["seeds"]:
            meta_path = out / RUNS / f"{method}-seed{seed}.json"
            saved = _saved_meta(meta_path)
            if not isinstance(saved, dict) or not _META_KEYS <= set(saved):
                continue  # not finished (or a damaged settings file): the run is (re)done
            meta = _run_meta(settings, method, seed)
            if saved != meta:
                raise UsageError(
                    f"{meta_path.with_suffix('.csv')} is a finished run with other settings "
                    f"({'; '.join(_run_differences(saved, meta))}); it is kept: use another --out (or the same "
                    "settings to reuse it)")


def _run_one(
    problem: Problem, method: str, hparams: dict[str, Any], steps: int, batch_size: int, seed: int, progress: bool
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    torch.manual_seed(seed)  # optimizers that draw internal randomness seed it from here
    params = problem.fresh_params()
    optimizer = create(method, params, problem.num_tasks, **hparams)
    stream = BatchStream(problem.num_samples, batch_size, seed=10_000 + seed)

    last_rows: list[torch.Tensor] = []

    def closure(same_batch: bool = False) -> torch.Tensor:
        # same_batch: recompute the previous call's batch (FAMO re-evaluates the losses after its step)
        rows = last_rows[-1] if same_batch else stream()
        last_rows[:] = [rows]
        return problem.loss_fn(params, problem.inputs[rows], problem.targets[rows])

    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc=f"{method} seed {seed}", leave=False, mininterval=0.5, disable=not progress)
    for iteration in bar:
        optimizer.step(closure)
        stats = optimizer.stats
        record: dict[str, Any] = {
            "method": method,
            "seed": seed,
            "iteration": iteration,
            "samples": stream.samples_drawn,
            "balanced_grad_norm": float(stats["balanced_grad_norm"]),
            "theta_grad_norm": float(stats["theta_grad_norm"]),
            "wall_time_s": time.perf_counter() - start,
        }
        for name, key in (("dual_obj", "dual_objective"), ("w", "w"), ("eta", "eta")):
            for task, value in enumerate(stats[key].tolist()):
                record[f"{name}_{task + 1}"] = value
        if not math.isfinite(record["balanced_grad_norm"]):
            raise FloatingPointError(f"{method} diverged at iteration {iteration} (seed {seed})")
        records.append(record)
        if iteration % 25 == 0 or iteration == steps:
            bar.set_postfix(bgn=f"{record['balanced_grad_norm']:.3g}")
    return records, final_tail(problem, params, method, hparams)


def final_tail(problem: Problem, params: list[torch.Tensor], method: str, hparams: dict[str, Any]
               ) -> dict[str, list[float]]:
    """The loss metrics (:data:`~drmoo.experiments.robust_eval.LOSS_METRICS`: mean, CVaR, the worst case at the
    run's (f, lambda) and the reference balls) of the final parameters' per-sample losses on the whole data set
    (the synthetic problems have no held-out split), one value per task."""
    from .robust_eval import loss_metrics, method_ball, single_thread

    ball = method_ball(method, hparams)
    with torch.no_grad(), single_thread():
        losses = problem.loss_fn(params, problem.inputs, problem.targets).double()
        rows = [loss_metrics(losses[:, task], ball) for task in range(losses.shape[1])]
    return {key: [row[key] for row in rows] for key in rows[0]}


def _read_records(path: Path, method: str, seed: int, steps: int) -> list[dict[str, Any]] | None:
    """The records of a finished run's CSV, or None when it is not exactly that run's (damaged, edited, NaN)."""
    try:
        parsed: list[dict[str, Any]] = []
        for row in iter_csv(path, what="run CSV"):  # streamed: more rows than the run's steps is not its file
            if len(parsed) == steps:
                return None
            record: dict[str, Any] = {k: (v if k == "method" else float(v)) for k, v in row.items()}
            if any(isinstance(v, float) and not math.isfinite(v) for v in record.values()):
                return None  # a finished run never logs a non-finite value: the file was altered
            for key in ("seed", "iteration", "samples"):
                record[key] = int(record[key])
            parsed.append(record)
    except (UsageError, ValueError, KeyError, FileNotFoundError, OverflowError):
        return None
    if ([r["iteration"] for r in parsed] != list(range(1, steps + 1))
            or any(r["method"] != method or r["seed"] != seed for r in parsed)):
        return None
    return parsed


def run_synthetic(config: SyntheticConfig, out_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Run every (method, seed) of ``config``, write the outputs listed above, return the summary.

    Everything is checked before anything is written (:meth:`SyntheticConfig.check`,
    :func:`check_output_directory`): a refusal leaves the directory as it was, finished runs included.
    """
    settings = config.check()
    check_output_directory(out_dir, settings)
    out = make_directory(out_dir)
    make_directory(out / RUNS)
    all_records: list[dict[str, Any]] = []
    tails: dict[str, list[dict[str, list[float]]]] = {}  # method -> the final loss metrics of each seed's run
    problems: dict[int, Problem] = {}
    jobs = [(m, s) for m in settings["methods"] for s in settings["seeds"]]
    for method, seed in tqdm(jobs, desc="runs", disable=not progress):
        hparams = settings["methods"][method]
        run_path = out / RUNS / f"{method}-seed{seed}.csv"
        meta_path = run_path.with_suffix(".json")
        meta = _run_meta(settings, method, seed)
        tail_path = out / RUNS / f"{method}-seed{seed}-tail.json"
        if _saved_meta(meta_path) == meta:
            records = _read_records(run_path, method, seed, settings["steps"])
            if records is not None:
                all_records.extend(records)  # finished earlier with the same settings
                tail = _saved_tail(tail_path)  # None: finished by a drmoo that did not measure it
                if tail is not None:
                    tails.setdefault(method, []).append(tail)
                continue
        if seed not in problems:
            problems[seed] = PROBLEMS[settings["problem"]](seed=seed, data_root=config.data_root)
        records, tail = _run_one(problems[seed], method, hparams, settings["steps"], settings["batch_size"], seed,
                                 progress)
        write_csv(run_path, records)
        write_json(tail_path, tail)
        write_json(meta_path, meta)  # after the records: its presence with these settings means "finished"
        all_records.extend(records)
        tails.setdefault(method, []).append(tail)

    write_csv(out / "metrics.csv", all_records)
    curves = aggregate_curves(all_records)
    write_csv(out / "convergence.csv", curves)
    plot_convergence(curves, out / "convergence.png", title=f"{settings['problem']}: balanced gradient norm")
    any_problem = problems.get(settings["seeds"][0]) or PROBLEMS[settings["problem"]](
        seed=settings["seeds"][0], data_root=config.data_root
    )
    summary = {
        "problem": settings["problem"],
        "description": any_problem.description,
        "steps": settings["steps"],
        "batch_size": settings["batch_size"],
        "seeds": settings["seeds"],
        "methods": {},
    }
    for method, hparams in settings["methods"].items():
        runs = [r for r in all_records if r["method"] == method]
        finals = [r["balanced_grad_norm"] for r in runs if r["iteration"] == settings["steps"]]
        firsts = [r["balanced_grad_norm"] for r in runs if r["iteration"] == 1]
        last20 = [r["balanced_grad_norm"] for r in runs if r["iteration"] > settings["steps"] - 20]
        summary["methods"][method] = {
            "hparams": hparams,
            # measured, not declared: the batch stream counts every closure call
            "samples_per_iteration": runs[0]["samples"] if runs else 0,
            "first_balanced_grad_norm": _mean_std(firsts),
            "final_balanced_grad_norm": _mean_std(finals),
            "mean_last20_balanced_grad_norm": _mean_std(last20),
            "wall_time_s": _mean_std([r["wall_time_s"] for r in runs if r["iteration"] == settings["steps"]]),
            # the final parameters' loss metrics, averaged over tasks, over the seeds that measured them
            "final_loss_metrics": {key: _mean_std([sum(t[key]) / len(t[key]) for t in tails.get(method, [])])
                                   for key in LOSS_METRICS},
            "final_loss_metrics_seeds": len(tails.get(method, [])),
        }
    write_json(out / "summary.json", summary)  # strict JSON: a NaN becomes null
    write_text(out / "summary.md", summary_table(summary) + "\n" + loss_metrics_table(summary))
    return summary


def loss_metrics_table(summary: dict[str, Any]) -> str:
    """Markdown: each method's final loss metrics on the whole data set (task means; mean ± std over seeds)."""
    lines = ["Per-sample loss of the final parameters on the whole data set, averaged over tasks (mean ± std over "
             "seeds): mean, CVaR at alpha 0.1 / 0.05, the worst case in the run's divergence ball (robust_run) and "
             "at chi2 lambda 0.1 / 0.8 (docs/robustness-metrics.md).", "",
             "| method | " + " | ".join(LOSS_METRICS) + " |", "|---|" + "---:|" * len(LOSS_METRICS)]
    for method, info in summary["methods"].items():
        metrics = info["final_loss_metrics"]
        cells = ["n/a" if math.isnan(metrics[key]["mean"]) else
                 f"{metrics[key]['mean']:.4g} ± {metrics[key]['std']:.2g}" for key in LOSS_METRICS]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _saved_tail(path: Path) -> dict[str, list[float]] | None:
    """A finished run's final loss metrics, or None when missing, unreadable or not one list per metric."""
    try:
        tail = read_json(path, what="run loss metrics file")
    except (UsageError, FileNotFoundError):
        return None
    if not isinstance(tail, dict) or any(
            not isinstance(tail.get(key), list) or not tail[key]
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in tail[key])
            for key in LOSS_METRICS):
        return None
    return {key: [float(v) for v in tail[key]] for key in LOSS_METRICS}


def _saved_meta(path: Path) -> Any:
    """A finished run's settings file, or None when it is missing or unreadable (the run is redone)."""
    try:
        return read_json(path, what="run settings file")
    except (UsageError, FileNotFoundError):
        return None


def _mean_std(values: list[float]) -> dict[str, float]:
    mean, std = mean_std(values)
    return {"mean": mean, "std": std}
