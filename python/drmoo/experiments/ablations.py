"""The paper's ablation studies (App. F): one hyperparameter varied over the paper's grid at a time.

========  =================================  ==========================================================
what      experiments                        what is varied, what is measured
========  =================================  ==========================================================
lambda    linear, wine, multimnist2          lambda in {0.4, 0.8, 1.6} for Double-Clip (F.1); FGSM
                                             accuracy on multimnist2, balanced-gradient-norm curves
                                             on linear / wine
lr        linear, wine                       the step size of (theta, eta) and of w, both set to the
                                             grid value (F.2); mean balanced gradient norm of the last
                                             20 iterations per method (``--methods all``: every
                                             method with synthetic settings, each given only the
                                             fixed hyperparameters it has)
batch     linear, wine                       N1 = N2 in {32, ..., 1024} for Double-Clip (F.3); curves
inner     linear, wine                       D in {5, ..., 25} for Double-Loop (F.4); curves
========  =================================  ==========================================================

Every grid point is trained in its own sub-directory of ``out`` by :func:`run_synthetic` or
:func:`compare`, which keep finished runs; ``point.json`` there records the point's settings
once it is done, so a rerun with the same settings skips it; a point finished with other settings is
refused and kept (:func:`~drmoo.experiments.synthetic.check_output_directory`), before anything is
written.  ``out`` then holds
``ablation-<what>.csv`` (one row per grid point), ``.md``, ``.png`` and ``.json`` (the settings,
machine and backend, read by ``drmoo report``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from drmoo._echo import echo_items, first_repeat
from drmoo.experiments.summaries import style_norm_axes
from drmoo.optim._method_arguments import accepted_hyperparameters, check_hyperparameter_values
from drmoo.store import UsageError, make_directory, read_csv, read_json, write_csv, write_figure, write_json, write_text
from drmoo_kernels import resolve_backend

from .run_config import upgrade_config_dict
from .summaries import aggregate_curves
from .synthetic import (
    NUM_TASKS,
    PAPER_PRESETS,
    SyntheticConfig,
    check_output_directory,
    check_problem_data,
    run_synthetic,
)

__all__ = ["GRIDS", "SUPPORTED", "AblationConfig", "check_ablation", "grid_points", "run_ablation"]

WHATS = ("lambda", "lr", "batch", "inner")
EXPERIMENTS = ("linear", "wine", "multimnist2")
SYNTHETIC = ("linear", "wine")
SUPPORTED: dict[str, tuple[str, ...]] = {
    "lambda": EXPERIMENTS,
    # The paper runs these three on the synthetic problems only: their measure is the balanced
    # gradient norm curve, which a deep run's FGSM table does not show.
    "lr": SYNTHETIC,
    "batch": SYNTHETIC,
    "inner": SYNTHETIC,
}

GRIDS: dict[str, tuple[float, ...]] = {
    "lambda": (0.4, 0.8, 1.6),
    "lr-unclipped": (1e-5, 5e-5, 5e-4, 1e-3, 5e-3, 1e-2),
    "lr-double-clip": (1e-3, 5e-3, 1e-2, 5e-2, 1e-1),  # App. F.2 lists the same set for wine, unordered
    "batch": (32, 64, 128, 256, 512, 1024),
    "inner": (5, 10, 15, 20, 25),
}

# The methods of the paper's synthetic figures (NashMTL and FAMO have no synthetic settings there).
LR_METHODS = ("double-clip", "double-loop", "mgda", "modo", "moco", "sdmgrad")

# App. F.2: B = 256, rho = 1e-5 for every method; gamma = 1e-3 is Double-Loop's inner (eta) step.
# For Double-Clip gamma *is* the (theta, eta) step, the rate being varied, so only rho is fixed.
# Each method gets only those of these (and of pref_lr, the w step) that it has: NashMTL has no rho
# and no w step (its w solves a bargaining problem), FAMO no rho.
LR_FIXED: dict[str, Any] = {"rho": 1e-5}
LR_FIXED_DOUBLE_LOOP: dict[str, Any] = {"dual_lr": 1e-3}
# App. F.3: beta = gamma = 1e-2, c1 = f1 = 1.0, c2 = f2 = 0.5, rho = 1e-5 for every batch size.
BATCH_FIXED: dict[str, Any] = {"lr": 1e-2, "pref_lr": 1e-2, "c1": 1.0, "f1": 1.0, "c2": 0.5, "f2": 0.5, "rho": 1e-5}
# App. F.4: linear alpha = beta = 5e-5, gamma = 1e-3, rho = 1e-5; wine alpha = gamma = 1e-3,
# beta = 6e-4, rho = 1e-6.
INNER_FIXED: dict[str, dict[str, Any]] = {
    "linear": {"lr": 5e-5, "pref_lr": 5e-5, "dual_lr": 1e-3, "rho": 1e-5},
    "wine": {"lr": 1e-3, "pref_lr": 6e-4, "dual_lr": 1e-3, "rho": 1e-6},
}
DEFAULT_EPS = (0.0, 0.01, 0.03, 0.05, 0.08)
MAX_BATCH, MAX_INNER_STEPS = 1 << 20, 10_000  # upper bounds of --what batch / inner grid values


@dataclass
class AblationConfig:
    """One ablation: ``what`` on ``experiment``; None = the paper's value (or the preset's)."""

    what: str
    experiment: str
    seeds: Sequence[int] = (0,)
    steps: int | None = None  # linear / wine iterations (paper: 600 / 1000)
    batch_size: int | None = None  # linear / wine: B when B is not the ablated value; multimnist2: training B
    data_root: str | None = None
    grid: Sequence[float] | None = None  # a subset / other values instead of the paper's grid
    methods: Sequence[str] | None = None  # lr only (default: LR_METHODS)
    backend: str | None = None
    # multimnist2 only (see drmoo.experiments.multimnist.PRESETS)
    preset: str = "quick"
    max_steps: int | None = None
    run_overrides: dict[str, Any] = field(default_factory=dict)  # epochs, input_size, train/test_size, weights
    cache_dir: str | None = None
    device: str = "auto"
    eps: Sequence[float] = DEFAULT_EPS

    def validate(self) -> None:
        if self.what not in WHATS:
            raise ValueError(f"unknown ablation --what {self.what!r}; valid choices: {', '.join(WHATS)}")
        if self.experiment not in EXPERIMENTS:
            raise ValueError(f"unknown --experiment {self.experiment!r}; valid choices: {', '.join(EXPERIMENTS)}")
        if self.experiment not in SUPPORTED[self.what]:
            raise ValueError(
                f"--what {self.what} is not supported on {self.experiment} (the paper measures it by the balanced "
                f"gradient norm of the synthetic problems); supported: {', '.join(SUPPORTED[self.what])}"
            )
        deep = self.experiment == "multimnist2"
        if deep and self.steps is not None:
            raise ValueError("--steps applies to linear/wine; on multimnist2 use --max-steps or --epochs")
        if not deep and (self.max_steps is not None or self.run_overrides):
            raise ValueError("--max-steps/--epochs/--input-size/--train-size/--test-size/--weights apply to "
                             "multimnist2; on linear/wine use --steps")
        if self.what == "batch" and self.batch_size is not None:
            raise ValueError("--batch-size cannot be fixed when the batch size is the ablated value (--what batch)")
        if self.methods is not None and self.what != "lr":
            raise ValueError("--methods applies to --what lr only (the other ablations use one method each)")
        for name, value in (("--steps", self.steps), ("--batch-size", self.batch_size),
                            ("--max-steps", self.max_steps),
                            *((f"--{key.replace('_', '-')}", v) for key, v in self.run_overrides.items()
                              if key != "weights")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"--seeds must be integers >= 0, got {echo_items(self.seeds)}")
        repeated = first_repeat(self.seeds)
        if repeated is not None:
            raise ValueError(f"--seeds repeats a seed: {repeated} ({echo_items(self.seeds)}); a seed given twice is "
                             "one run counted twice")
        if self.methods is not None and len(set(self.methods)) != len(self.methods):
            raise ValueError(f"--methods repeats a method ({', '.join(self.methods)})")
        if any(not math.isfinite(e) or e < 0 for e in self.eps):
            raise ValueError(f"--eps values must be finite numbers >= 0, got {list(self.eps)!r}")
        if self.grid is not None:
            self._validate_grid([float(v) for v in self.grid])

    def _validate_grid(self, grid: list[float]) -> None:
        """Grid values must make sense for what they set: counts >= 1, rates and lambda finite and > 0."""
        if not grid:
            raise ValueError("--grid is empty")
        repeated = sorted({v for v in grid if grid.count(v) > 1})
        if repeated:  # a repeated value would be run once and counted as two independent points
            raise ValueError(f"--grid repeats {', '.join(f'{v:g}' for v in repeated)}: give each value once")
        if self.what in ("batch", "inner"):
            bound = MAX_BATCH if self.what == "batch" else MAX_INNER_STEPS
            bad = [v for v in grid if not (math.isfinite(v) and 1 <= v <= bound and v == int(v))]
            kind = "batch sizes" if self.what == "batch" else "inner step counts"
            if bad:
                raise ValueError(f"--grid for --what {self.what} holds {kind}: integers from 1 to {bound}, got "
                                 f"{', '.join(f'{v:g}' for v in bad)}")
        else:
            bad = [v for v in grid if not (math.isfinite(v) and v > 0)]
            if bad:
                raise ValueError(f"--grid for --what {self.what} must be finite numbers > 0, got "
                                 f"{', '.join(f'{v:g}' for v in bad)}")


@dataclass(frozen=True)
class GridPoint:
    """One training setting of an ablation: its sub-directory, label, method and overrides."""

    name: str
    label: str
    value: float
    method: str
    overrides: dict[str, Any]
    batch_size: int | None = None


def _fmt(value: float) -> str:
    return f"{value:g}"


def grid_points(config: AblationConfig) -> list[GridPoint]:
    """The grid of ``config`` as points, in the order they are run and tabulated."""
    config.validate()
    what = config.what

    def values(default: Sequence[float]) -> list[float]:
        return [float(v) for v in (config.grid if config.grid is not None else default)]

    if what == "lambda":
        return [GridPoint(f"lam{_fmt(v)}", f"λ={_fmt(v)}", v, "double-clip", {"lam": v}) for v in values(GRIDS[what])]
    if what == "batch":
        return [GridPoint(f"batch{int(v)}", f"B={int(v)}", v, "double-clip", dict(BATCH_FIXED), batch_size=int(v))
                for v in values(GRIDS[what])]
    if what == "inner":
        fixed = INNER_FIXED[config.experiment]
        return [GridPoint(f"inner{int(v)}", f"D={int(v)}", v, "double-loop", {**fixed, "inner_steps": int(v)})
                for v in values(GRIDS[what])]
    return _lr_points(config, values)


def _lr_methods(config: AblationConfig) -> list[str]:
    """The methods of an lr ablation: ``--methods`` (``all``: every method with synthetic settings on the
    experiment, in registry order), by default the paper's (:data:`LR_METHODS`)."""
    from drmoo.optim import available

    known = PAPER_PRESETS[config.experiment]["methods"]
    if config.methods is not None and list(config.methods) == ["all"]:
        return [m for m in available() if m in known]
    methods = list(config.methods or LR_METHODS)
    if "all" in methods:
        raise ValueError(f"--methods {','.join(methods)}: 'all' stands for every method; give it alone")
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"no synthetic preset for method(s) {unknown}; valid choices: {', '.join(known)}, or all")
    return methods


def _lr_overrides(method: str, value: float) -> dict[str, Any]:
    """The lr ablation's settings of ``method`` at ``value``: its step sizes (lr, and pref_lr where it has a w
    step) set to the value, and the fixed ones of App. F.2 that it has (a method without rho gets none)."""
    wanted = {**LR_FIXED, **(LR_FIXED_DOUBLE_LOOP if method == "double-loop" else {}), "lr": value, "pref_lr": value}
    accepted = accepted_hyperparameters(method)
    return {key: v for key, v in wanted.items() if accepted is None or key in accepted}


def _lr_points(config: AblationConfig, values: Any) -> list[GridPoint]:
    points = []
    for method in _lr_methods(config):
        grid = values(GRIDS["lr-double-clip" if method == "double-clip" else "lr-unclipped"])
        for value in grid:
            points.append(GridPoint(f"{method}-lr{_fmt(value)}", f"{method} lr={_fmt(value)}", value, method,
                                    _lr_overrides(method, value)))
    return points


# ---------------------------------------------------------------------------- grid points, resumable


def _point_done(directory: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The saved outcome of a finished point with exactly these settings, else None."""
    marker = directory / "point.json"
    if not marker.exists():
        return None
    try:
        saved = read_json(marker, what="grid point marker")
    except UsageError:
        return None  # damaged: the point is run again
    if not isinstance(saved, dict):
        return None
    recorded = saved.get("settings")
    if isinstance(recorded, dict) and isinstance(recorded.get("runs"), list):  # Multi-MNIST: each run's config
        try:  # a config key renamed since (RENAMED_KEYS) still matches under its former name
            recorded = {**recorded, "runs": [upgrade_config_dict(run) if isinstance(run, dict) else run
                                             for run in recorded["runs"]]}
        except UsageError:
            return None
    return saved if recorded == settings else None


def _mark_done(directory: Path, settings: dict[str, Any], outcome: dict[str, Any]) -> None:
    write_json(directory / "point.json", {"settings": settings, **outcome})  # last: its presence means "finished"


def _synthetic_config(config: AblationConfig, point: GridPoint) -> tuple[SyntheticConfig, dict[str, Any]]:
    """The synthetic run of one grid point, and its settings as ``point.json`` records them."""
    overrides = dict(point.overrides)
    if config.backend is not None:
        overrides["backend"] = config.backend
    synthetic = SyntheticConfig(
        problem=config.experiment, methods=[point.method], seeds=list(config.seeds), steps=config.steps,
        batch_size=point.batch_size if point.batch_size is not None else config.batch_size, overrides=overrides,
        data_root=config.data_root,
    )
    resolved = synthetic.resolved()
    return synthetic, {key: resolved[key] for key in ("problem", "steps", "batch_size", "seeds", "methods")}


def check_ablation(config: AblationConfig, out: str | Path) -> list[GridPoint]:
    """Check the whole ablation before anything is written; returns its grid points.

    On linear / wine: every point's settings and hyperparameter values (an optimizer built on a
    stand-in parameter), the problem's data once, and every point directory that the run would write
    into (a point not finished with these settings): someone's files there, or a run finished with
    other settings, are refused and kept.  A point finished with these settings is reused as it is.
    """
    points = grid_points(config)
    if config.experiment not in SYNTHETIC:
        return points
    check_problem_data(config.experiment, config.data_root)
    for point in points:
        _, settings = _synthetic_config(config, point)
        check_hyperparameter_values(point.method, settings["methods"][point.method], NUM_TASKS)
        directory = Path(out) / point.name
        if _point_done(directory, settings) is None:
            check_output_directory(directory, settings)
    return points


def _synthetic_point(config: AblationConfig, point: GridPoint, out: Path, progress: bool) -> dict[str, Any]:
    """Train one grid point on linear / wine; returns its row of the ablation table."""
    synthetic, settings = _synthetic_config(config, point)
    directory = out / point.name
    outcome = _point_done(directory, settings)
    if outcome is None:
        make_directory(directory)
        try:
            summary = run_synthetic(synthetic, directory, progress=progress)
            outcome = {"status": "ok", "result": summary["methods"][point.method]}
        except (FloatingPointError, ValueError) as error:
            # A divergent learning rate is a result of the lr ablation, not a failure of the command:
            # run_synthetic stops on a non-finite gradient norm (FloatingPointError), the optimizers on
            # non-finite losses (a ValueError naming them).  Any other ValueError is a real mistake.
            if isinstance(error, ValueError) and "non-finite" not in str(error):
                raise
            outcome = {"status": "diverged", "error": str(error)}
        _mark_done(directory, settings, outcome)
    return _synthetic_row(config, point, settings, outcome)


def _synthetic_row(config: AblationConfig, point: GridPoint, resolved: dict[str, Any],
                   outcome: dict[str, Any]) -> dict[str, Any]:
    result = outcome.get("result", {})

    def stat(key: str, part: str) -> float:
        return float(result[key][part]) if key in result else math.nan

    return {
        "what": config.what, "experiment": config.experiment, "value": point.value, "method": point.method,
        "label": point.label, "status": outcome["status"], "steps": resolved["steps"],
        "batch_size": resolved["batch_size"], "seeds": len(resolved["seeds"]),
        "first_bgn": stat("first_balanced_grad_norm", "mean"),
        "final_bgn_mean": stat("final_balanced_grad_norm", "mean"),
        "final_bgn_std": stat("final_balanced_grad_norm", "std"),
        "last20_bgn_mean": stat("mean_last20_balanced_grad_norm", "mean"),
        "last20_bgn_std": stat("mean_last20_balanced_grad_norm", "std"),
        "samples_per_iteration": result.get("samples_per_iteration", 0),
        "wall_time_s": stat("wall_time_s", "mean"),
        "dir": point.name,
    }


def _multimnist_configs(config: AblationConfig, point: GridPoint) -> list[Any]:
    from .multimnist import PRESETS, method_hparams
    from .run_config import RunConfig

    if config.preset not in PRESETS:
        raise ValueError(f"unknown --preset {config.preset!r}; valid choices: {', '.join(PRESETS)}")
    preset = {**PRESETS[config.preset]["multimnist2"],
              **{k: v for k, v in config.run_overrides.items() if v is not None}}
    if config.batch_size is not None:
        preset["batch_size"] = config.batch_size
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return [
        RunConfig(experiment="multimnist2", method=point.method, preset=config.preset, seed=int(seed),
                  data_root=config.data_root, cache_dir=config.cache_dir, max_steps=config.max_steps, device=device,
                  backend=config.backend, hparams=method_hparams(point.method, point.overrides), **preset)
        for seed in config.seeds
    ]


def _multimnist_point(config: AblationConfig, point: GridPoint, out: Path, progress: bool) -> list[dict[str, Any]]:
    """Train + FGSM-evaluate one lambda with ``compare`` (every seed); returns the runs' eval reports."""
    from .robustness import compare

    configs = _multimnist_configs(config, point)
    eps = [float(e) for e in config.eps]
    settings = {"runs": [asdict(c) for c in configs], "eps": eps}
    directory = out / point.name
    if _point_done(directory, settings) is None:
        compare(configs, directory, eps, progress=progress)
        _mark_done(directory, settings, {"status": "ok"})
    reports = []
    for run in configs:
        report = read_json(directory / f"{run.method}-seed{run.seed}" / "eval.json", what="evaluation")
        reports.append({**report, "method": point.label})  # the table's row label is the lambda
    return reports


# ---------------------------------------------------------------------------- outputs


def _point_records(out: Path, point: GridPoint) -> list[dict[str, Any]]:
    """Per-iteration records of a finished synthetic point, labelled by the grid value."""
    path = out / point.name / "metrics.csv"
    if not path.exists():  # a diverged point has no metrics.csv
        return []
    return [{**row, "method": point.label} for row in read_csv(path, what="metrics CSV")]


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - window] if index >= window else 0.0)
        out.append(total / min(index + 1, window))
    return out


def _plot_curves(curves: list[dict[str, Any]], labels: list[str], path: Path, title: str,
                 window: int = 20) -> None:
    """Balanced gradient norm vs iterations and vs samples, one colour per grid value in grid order.

    The per-iteration norm is measured on stochastic batches and fluctuates by an order of magnitude,
    so each value's raw curve is drawn faint and its running mean over ``window`` iterations solid.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "balanced_grad_norm_mean"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for index, label in enumerate(labels):
        rows = [c for c in curves if c["method"] == label]
        if not rows:  # diverged: nothing to draw
            continue
        values = [float(c[key]) for c in rows]
        for axis, x_key in zip(axes, ("iteration", "samples")):
            xs = [float(c[x_key]) for c in rows]
            axis.plot(xs, values, color=f"C{index}", linewidth=0.6, alpha=0.25)
            axis.plot(xs, _running_mean(values, window), color=f"C{index}", linewidth=1.6, label=label)
    style_norm_axes(axes)
    seeds = max((int(c["seeds"]) for c in curves), default=1)
    fig.suptitle(f"{title} (mean over {seeds} seed{'s' if seeds > 1 else ''}; "
                 f"faint: per iteration, solid: running mean of {window})", fontsize=10)
    write_figure(fig, path, dpi=120)
    plt.close(fig)


def _plot_lr(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Mean balanced gradient norm of the last 20 iterations vs the learning rate, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method and r["status"] == "ok"]
        if not mine:
            continue
        axis.errorbar([r["value"] for r in mine], [r["last20_bgn_mean"] for r in mine],
                      yerr=[r["last20_bgn_std"] for r in mine] if mine[0]["seeds"] > 1 else None,
                      marker="o", ms=3, capsize=2, linewidth=1.2, label=method)
    diverged = [f"{r['method']} {r['value']:g}" for r in rows if r["status"] != "ok"]
    if diverged:
        axis.text(0.01, 0.01, "diverged: " + ", ".join(diverged), transform=axis.transAxes, fontsize=6, va="bottom")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("learning rate of (θ, η) and w")
    axis.set_ylabel("balanced gradient norm, mean of last 20 iterations")
    axis.set_title(title, fontsize=9)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    write_figure(fig, path, dpi=120)
    plt.close(fig)


def _synthetic_table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| value | method | status | first | final | mean of last 20 | "
             "samples / iteration |", "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] == "ok":
            spread = f" ± {r['final_bgn_std']:.2g}" if r["seeds"] > 1 else ""
            cells = (f"{r['first_bgn']:.4g} | {r['final_bgn_mean']:.4g}{spread} | "
                     f"{r['last20_bgn_mean']:.4g} | {r['samples_per_iteration']}")
        else:
            cells = "– | – | – | –"
        lines.append(f"| {r['value']:g} | {r['method']} | {r['status']} | {cells} |")
    return "\n".join(lines) + "\n"


VARIED = {"lambda": "λ (Double-Clip)", "lr": "learning rate", "batch": "batch size N1 = N2 (Double-Clip)",
          "inner": "inner steps D (Double-Loop)"}


def _header(config: AblationConfig, rows: list[dict[str, Any]], environment: dict[str, Any]) -> str:
    what = VARIED[config.what]
    fixed = {"lambda": "the problem's paper preset", "batch": _kv(BATCH_FIXED),
             "inner": _kv(INNER_FIXED.get(config.experiment, {})),
             "lr": f"B = 256, {_kv(LR_FIXED)} (methods that have it), Double-Loop {_kv(LR_FIXED_DOUBLE_LOOP)}; "
                   "lr = pref_lr (methods with a w step) = grid value"}
    first = rows[0]
    return (f"### Ablation on {what}: {config.experiment} (paper App. F)\n\n"
            f"{first['steps']} iterations, seeds {','.join(map(str, config.seeds))}; fixed: {fixed[config.what]}; "
            f"machine {environment['machine']}, backend {environment['backend']}, torch {environment['torch']}")


def _kv(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}" for k, v in values.items())


def _environment(config: AblationConfig) -> dict[str, Any]:
    from .wallclock import machine_name

    if config.experiment == "multimnist2":
        device = torch.device(_multimnist_device(config))
    else:
        device = torch.device("cpu")  # the synthetic problems live on the CPU
    return {"machine": machine_name(device), "device": str(device), "torch": torch.__version__,
            "backend": resolve_backend(config.backend, device)}


def _multimnist_device(config: AblationConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def _finish_synthetic(config: AblationConfig, points: list[GridPoint], rows: list[dict[str, Any]], out: Path,
                      environment: dict[str, Any]) -> str:
    stem = out / f"ablation-{config.what}"
    write_csv(stem.with_suffix(".csv"), rows)
    header = _header(config, rows, environment)
    if config.what == "lr":
        _plot_lr(rows, stem.with_suffix(".png"), f"{config.experiment}: balanced gradient norm vs learning rate")
    else:
        records = [r for point in points for r in _point_records(out, point)]
        curves = aggregate_curves(records)
        write_csv(out / f"ablation-{config.what}-curves.csv", curves)
        _plot_curves(curves, [p.label for p in points], stem.with_suffix(".png"),
                     f"{config.experiment}: ablation on {VARIED[config.what]}")
    return _synthetic_table(rows, header)


def _finish_multimnist(config: AblationConfig, reports: list[dict[str, Any]], out: Path,
                       environment: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    from .robustness import _plot as plot_accuracy  # accuracy vs eps, one line per row label
    from .robustness import robustness_table

    eps = [float(e) for e in config.eps]
    first = _multimnist_configs(config, grid_points(config)[0])[0]
    header = (f"### Ablation on λ (Double-Clip): multimnist2, accuracy (%) under FGSM, mean over tasks "
              f"(paper App. F.1)\n\npreset `{config.preset}`: {first.input_size}px, {first.epochs} epoch(s)"
              f"{f' (max {first.max_steps} steps)' if first.max_steps else ''}, batch {first.batch_size}, "
              f"test composites {reports[0]['test_samples']}, seeds {','.join(map(str, config.seeds))}; "
              f"machine {environment['machine']}, device {environment['device']}, backend {environment['backend']}")
    table, long_rows = robustness_table(reports, eps, header)
    stem = out / f"ablation-{config.what}"
    plot_accuracy(long_rows, stem.with_suffix(".png"), "multimnist2: Double-Clip accuracy vs FGSM eps per λ")
    rows = []
    for point in grid_points(config):
        mine = {r["eps"]: r for r in long_rows if r["method"] == point.label}
        row: dict[str, Any] = {"what": "lambda", "experiment": "multimnist2", "value": point.value,
                               "seeds": len(config.seeds)}
        for value in eps:
            column = "clean" if value == 0 else f"eps{value:g}"
            row[f"acc_{column}"] = mine[value]["mean_acc"]
            row[f"std_{column}"] = mine[value]["std_acc"]
        rows.append({**row, "dir": point.name})
    write_csv(stem.with_suffix(".csv"), rows)
    return table, rows


def _settings(config: AblationConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings that apply to this experiment (the other experiment's options are left out)."""
    deep_only = ("preset", "max_steps", "run_overrides", "cache_dir", "device", "eps")
    skip = ("what", "experiment", "grid") + (("steps", "methods") if config.experiment == "multimnist2"
                                            else deep_only)
    settings = {k: v for k, v in asdict(config).items() if k not in skip and v not in (None, {}, [])}
    if config.experiment != "multimnist2":
        settings["steps"] = rows[0]["steps"]  # resolved: the paper's when --steps is not given
        settings["batch_size"] = rows[0]["batch_size"] if config.what != "batch" else "ablated"
    return settings


def run_ablation(config: AblationConfig, out: str | Path, progress: bool = True) -> str:
    """Run (or finish) every grid point of ``config`` under ``out``; write the outputs; return the table.

    Everything is checked first (:func:`check_ablation`): a refused ablation creates and changes nothing.
    """
    points = check_ablation(config, out)
    out = make_directory(out)
    environment = _environment(config)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []
    for point in tqdm(points, desc=f"ablate {config.what}", disable=not progress):
        if config.experiment == "multimnist2":
            reports.extend(_multimnist_point(config, point, out, progress))
        else:
            rows.append(_synthetic_point(config, point, out, progress))
    if config.experiment == "multimnist2":
        table, rows = _finish_multimnist(config, reports, out, environment)
    else:
        table = _finish_synthetic(config, points, rows, out, environment)
    stem = out / f"ablation-{config.what}"
    write_text(stem.with_suffix(".md"), table)
    grid: dict[str, list[float]] = {}
    for point in points:
        grid.setdefault(point.method, []).append(point.value)
    manifest = {
        "kind": "ablation", "what": config.what, "experiment": config.experiment,
        "grid": grid, "points": [p.name for p in points], "settings": _settings(config, rows),
        **environment, "wall_time_s": time.perf_counter() - started,
        "outputs": [f"{stem.name}.{ext}" for ext in ("csv", "md", "png")],
    }
    write_json(stem.with_suffix(".json"), manifest)
    return table
