"""The robustness block of ``drmoo eval``: tail, worst case, calibration, worst class, per task and averaged.

:func:`collect_logits` runs a trained model over an evaluation set (clean, under FGSM or with
Gaussian pixel noise) and keeps every task's logits; :func:`metrics_block` turns logits and labels
into the metrics of :mod:`drmoo.experiments.dr_metrics`, per task and averaged over tasks:

========================  ==================================================================
key                       meaning (per-sample loss: the task's cross-entropy, in nats)
========================  ==================================================================
accuracy                  fraction of top labels right
balanced_accuracy         mean recall over the classes present
worst_class_accuracy      lowest recall over the classes present
mean_loss                 mean per-sample loss
cvar_0.1, cvar_0.05       CVaR of the loss at alpha 0.1 / 0.05 (Rockafellar-Uryasev)
robust_run                sup_q E_q[loss] - lam D_f(q || p) at the run's own f and lam
worst_case_max_ratio      that worst case's largest density ratio dq/dp (1: q = p)
worst_case_zero_mass      the fraction of the samples that worst case gives no weight
robust_chi2_0.1, _0.8     the same at chi2 with lam 0.1 / 0.8 (one yardstick for every run)
ece                       top-label expected calibration error, 15 equal-mass bins
misclassified_loss        mean loss over the misclassified samples (NaN: none)
weighted_*                mean_loss and the robust objectives with the importance weights'
                          nominal (the weights normalised to a distribution p): on the
                          binary-attribute experiments, their label-balancing weights (also
                          for a run trained without them: one yardstick)
========================  ==================================================================

Also here: the fitted temperature (:mod:`drmoo.experiments.temperature`) and the graded shifts
(:mod:`drmoo.experiments.shifts`) that ``drmoo eval`` reports with it (:func:`robustness_report`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drmoo_kernels import get_divergence

from . import dr_metrics
from .run_config import RunConfig

__all__ = ["CVAR_LEVELS", "LOSS_METRICS", "METRICS", "REFERENCE_BALLS", "WEIGHTED_METRICS", "FittedTemperatures",
           "Scored", "block_means", "collect_logits", "fit_temperatures", "json_safe", "label_shift_block",
           "loss_metrics", "method_ball", "metrics_block", "noise_block", "robustness_report", "robustness_tables",
           "run_ball", "scored_metrics", "single_thread", "task_metrics", "temperature_block"]

_T = TypeVar("_T")
CVAR_LEVELS = (0.1, 0.05)
REFERENCE_BALLS: tuple[tuple[str, float], ...] = (("chi2", 0.1), ("chi2", 0.8))
LOSS_METRICS: tuple[str, ...] = ("mean_loss", *(f"cvar_{alpha:g}" for alpha in CVAR_LEVELS), "robust_run",
                                 "worst_case_max_ratio", "worst_case_zero_mass",
                                 *(f"robust_{name}_{lam:g}" for name, lam in REFERENCE_BALLS))
METRICS: tuple[str, ...] = ("accuracy", "balanced_accuracy", "worst_class_accuracy", *LOSS_METRICS, "ece",
                            "misclassified_loss")
WEIGHTED_METRICS: tuple[str, ...] = ("weighted_mean_loss", "weighted_robust_run",
                                     *(f"weighted_robust_{name}_{lam:g}" for name, lam in REFERENCE_BALLS))


def json_safe(value: _T) -> _T:
    """NaN (an undefined metric: an AUC with one class, the loss of no misclassified sample) -> null, so that
    eval.json is strict JSON; lists and dicts converted throughout (the same structure, NaN read as None)."""
    if isinstance(value, float) and math.isnan(value):
        return cast(_T, None)
    if isinstance(value, list):
        return cast(_T, [json_safe(v) for v in value])
    if isinstance(value, dict):
        return cast(_T, {k: json_safe(v) for k, v in value.items()})
    return value


def run_ball(config: RunConfig) -> tuple[str, float]:
    """The run's own divergence and lambda: its hyperparameters, else its optimizer's defaults (chi2, 0.8)."""
    return method_ball(config.method, config.hparams)


def method_ball(method: str, hparams: dict[str, Any]) -> tuple[str, float]:
    """``method``'s divergence and lambda with ``hparams``: given there, else the optimizer's defaults."""
    from drmoo.optim import available

    defaults: dict[str, Any] = {"divergence": "chi2", "lam": 0.8}
    optimizer = available().get(method)
    if optimizer is not None:
        for name, parameter in inspect.signature(optimizer.__init__).parameters.items():
            if name in defaults and parameter.default is not inspect.Parameter.empty:
                defaults[name] = parameter.default
    divergence = str(get_divergence(hparams.get("divergence", defaults["divergence"])))
    return divergence, float(hparams.get("lam", defaults["lam"]))


def collect_logits(model: nn.Module, items: Tensor, labels: Tensor, to_input: Callable[[Tensor], Tensor],
                   batch_size: int, device: torch.device, *, eps: float = 0.0, step_scale: Tensor | None = None,
                   noise_sigma: float = 0.0, noise_seed: int = 0) -> list[Tensor]:
    """Every task's logits ``[N, C_i]`` (float32, on the CPU) over ``items``, in order.

    ``eps > 0``: under FGSM (:func:`drmoo.attacks.fgsm`, the attack direction from ``labels``).
    ``noise_sigma > 0``: Gaussian noise of that standard deviation added to each input pixel and
    channel of the [0, 1] image, clamped to [0, 1]; sample j's noise comes from a generator seeded
    with ``noise_seed`` and j only, so every model, batch size and device sees the same images,
    and each strength scales the same draw.
    """
    from drmoo.attacks import fgsm

    model.eval()
    outputs: list[list[Tensor]] = []
    for start in range(0, labels.shape[0], batch_size):
        x = to_input(items[start : start + batch_size])
        if noise_sigma > 0:
            x = (x + noise_sigma * _noise(x.shape, start, noise_seed)).clamp(0.0, 1.0)
        x = x.to(device)
        if eps > 0:
            x = fgsm(model, x, labels[start : start + batch_size].to(device), eps, step_scale=step_scale)
        with torch.no_grad():
            logits = model(x)
        if not outputs:
            outputs = [[] for _ in logits]
        for task, z in enumerate(logits):
            outputs[task].append(z.detach().float().cpu())
    return [torch.cat(chunks) for chunks in outputs]


def _noise(shape: torch.Size, first: int, seed: int) -> Tensor:
    generator = torch.Generator()
    draws = []
    for index in range(first, first + shape[0]):
        generator.manual_seed(seed * 1_000_003 + index)
        draws.append(torch.randn(tuple(shape[1:]), generator=generator))
    return torch.stack(draws)


@dataclass(frozen=True)
class Scored:
    """One task's per-sample values on an evaluation set (float64): what every metric is computed from."""

    labels: Tensor
    losses: Tensor  # cross-entropy, nats
    confidence: Tensor  # the top label's probability
    predictions: Tensor  # the top label: argmax of the logits (-1 for every sample of a task whose logits are all NaN)

    @classmethod
    def of(cls, logits: Tensor, labels: Tensor) -> Scored:
        z = logits.detach().to("cpu", torch.float64)
        y = labels.detach().to("cpu", torch.long)
        # The top label is read from the logits, as eval.json's task_acc is: the softmax of a row holding +inf
        # is NaN (inf - inf), and its max would name the first NaN, not the infinite logit's class.
        predictions = z.argmax(1)
        if z.numel() and bool(torch.isnan(z).all()):  # no logit at all (e.g. an unfitted temperature): no top label
            predictions = torch.full_like(predictions, -1)
        confidence = torch.softmax(z, 1).gather(1, predictions.clamp(min=0)[:, None]).squeeze(1)
        return cls(y, F.cross_entropy(z, y, reduction="none"), confidence, predictions)

    def take(self, rows: Tensor) -> Scored:
        """The samples ``rows`` (repeats allowed: a resample)."""
        return Scored(self.labels[rows], self.losses[rows], self.confidence[rows], self.predictions[rows])


def scored_metrics(scored: Scored, ball: tuple[str, float], weights: Tensor | None = None) -> dict[str, float]:
    """:data:`METRICS` of one task's :class:`Scored` samples (and :data:`WEIGHTED_METRICS` when importance
    ``weights`` ``[N]`` are given)."""
    y, losses, predictions = scored.labels, scored.losses, scored.predictions
    correct = predictions == y
    tail = loss_metrics(losses, ball, weights)
    finite = _finite(losses) and _finite(scored.confidence)
    labelled = not bool((predictions < 0).all())  # False: logits all NaN, no top label (Scored.of)
    values = {
        "accuracy": float(correct.double().mean()) if labelled else math.nan,
        "balanced_accuracy": dr_metrics.balanced_accuracy(y, predictions) if labelled else math.nan,
        "worst_class_accuracy": dr_metrics.worst_class_accuracy(y, predictions) if labelled else math.nan,
        **{key: tail.pop(key) for key in LOSS_METRICS},
        "ece": dr_metrics.expected_calibration_error(scored.confidence, correct) if finite else math.nan,
        "misclassified_loss": dr_metrics.misclassified_loss(losses, correct) if finite else math.nan,
    }
    return {**values, **tail}  # then the weighted ones


def _finite(values: Tensor) -> bool:
    return bool(torch.isfinite(values).all())


def loss_metrics(losses: Tensor, ball: tuple[str, float], weights: Tensor | None = None) -> dict[str, float]:
    """:data:`LOSS_METRICS` of one task's per-sample ``losses`` ``[N]`` (what needs no prediction), and
    :data:`WEIGHTED_METRICS` when importance ``weights`` ``[N]`` are given.

    A model whose logits overflowed (a run that stopped at a non-finite step keeps its last finite
    weights, which can still produce an infinite logit) has an infinite or undefined loss: every number
    here is then undefined (NaN), while the accuracies of :func:`scored_metrics` stay what the top labels give.
    """
    if not _finite(losses):
        return {key: math.nan for key in (*LOSS_METRICS, *(WEIGHTED_METRICS if weights is not None else ()))}
    run = dr_metrics.worst_case(losses, ball[1], ball[0])
    values = {
        "mean_loss": float(losses.double().mean()),
        **{f"cvar_{alpha:g}": dr_metrics.cvar(losses, alpha) for alpha in CVAR_LEVELS},
        "robust_run": run.value,
        # how far the run's worst case moves from the nominal: its largest density ratio, and the share of the
        # samples it drops entirely (chi2's clipping; 0 for the divergences whose weights stay positive)
        "worst_case_max_ratio": float(run.ratios.max()),
        "worst_case_zero_mass": float((run.ratios == 0).double().mean()),
        **{f"robust_{name}_{lam:g}": dr_metrics.robust_objective(losses, lam, name) for name, lam in REFERENCE_BALLS},
    }
    if weights is not None:
        p = dr_metrics.nominal_weights(losses.numel(), weights)
        values["weighted_mean_loss"] = float((p * losses.double()).sum())
        values["weighted_robust_run"] = dr_metrics.robust_objective(losses, ball[1], ball[0], p)
        for name, lam in REFERENCE_BALLS:
            values[f"weighted_robust_{name}_{lam:g}"] = dr_metrics.robust_objective(losses, lam, name, p)
    return values


def task_metrics(logits: Tensor, labels: Tensor, ball: tuple[str, float], weights: Tensor | None = None
                 ) -> dict[str, float]:
    """:data:`METRICS` of one task from its logits ``[N, C]`` and labels ``[N]`` (and :data:`WEIGHTED_METRICS`
    when importance ``weights`` ``[N]`` are given), in float64."""
    with single_thread():
        return scored_metrics(Scored.of(logits, labels), ball, weights)


@contextmanager
def single_thread() -> Iterator[None]:
    """torch on one intra-op thread for a while: the metrics' tensors are small (one value per sample), and
    on a busy CPU the threads' hand-offs cost a hundred times the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _nanmean(values: Sequence[float]) -> float:
    defined = [v for v in values if v is not None and not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


def metrics_block(logits: Sequence[Tensor], labels: Tensor, ball: tuple[str, float],
                  weights: Tensor | None = None) -> dict[str, Any]:
    """Per task (``labels[:, i]``, ``weights[:, i]``) and task-averaged :func:`task_metrics`:
    ``{"per_task": {key: [m values]}, "mean": {key: value}}`` (a NaN task value is left out of the mean)."""
    if labels.dim() != 2 or labels.shape[1] != len(logits):
        raise ValueError(f"labels must be [N, m] with m = {len(logits)} tasks, got {tuple(labels.shape)}")
    rows = [task_metrics(z, labels[:, i], ball, None if weights is None else weights[:, i])
            for i, z in enumerate(logits)]
    per_task = {key: [row[key] for row in rows] for key in rows[0]}
    return {"per_task": per_task, "mean": block_means(per_task)}


def block_means(per_task: dict[str, list[float]]) -> dict[str, float]:
    """The task average of every metric, NaN task values left out."""
    return {key: _nanmean(values) for key, values in per_task.items()}


@dataclass(frozen=True)
class FittedTemperatures:
    """Each task's cross-fitted temperatures (:func:`fit_temperatures`): per sample, the one fitted on the
    other half of the evaluated split (None for a task with no likelihood to fit: a +inf or NaN logit, or
    -inf on a sample's own label; see :func:`drmoo.experiments.temperature.fittable`), the two folds' fits
    and the whole split's fit."""

    per_sample: list[Tensor | None]
    fits: list[list[Any]]
    whole: list[float]

    def apply(self, logits: Sequence[Tensor]) -> list[Tensor]:
        """``logits`` (the evaluated split's samples, in order: clean, noisy or attacked) divided by each
        sample's temperature, in float64.  A task without a fit has no scaled logits: they are all NaN, so
        that every metric of them is NaN (null in eval.json; the accuracies too, see :class:`Scored`), never
        the unscaled numbers under a temperature-scaled label."""
        from .temperature import scaled

        return [torch.full(z.shape, math.nan, dtype=torch.float64) if temperatures is None
                else scaled(z, temperatures) for z, temperatures in zip(logits, self.per_sample, strict=True)]


def fit_temperatures(logits: Sequence[Tensor], labels: Tensor) -> FittedTemperatures:
    """Each task's temperature, cross-fitted on the evaluated split's clean logits (two folds: no sample is
    scaled by a temperature fitted on it; :func:`drmoo.experiments.temperature.cross_fitted_temperatures`).
    Needs at least 2 samples.  A -inf logit in a class other than the sample's label is fitted (that class
    has probability 0 at every temperature); a task with a +inf or NaN logit, or a -inf on a label, has an
    infinite or undefined likelihood at every temperature: it gets no fit (NaN) and every scaled number of it
    is NaN (:meth:`FittedTemperatures.apply`)."""
    from .temperature import Fit, cross_fitted_temperatures, fit_temperature, fittable

    per_sample: list[Tensor | None] = []
    fits: list[list[Any]] = []
    whole: list[float] = []
    with single_thread():
        for i, z in enumerate(logits):
            if not fittable(z, labels[:, i]):  # overflowed logits: no likelihood to fit, every scaled number undefined
                per_sample.append(None)
                fits.append([Fit(math.nan, False), Fit(math.nan, False)])
                whole.append(math.nan)
                continue
            temperatures, task_fits = cross_fitted_temperatures(z, labels[:, i])
            per_sample.append(temperatures)
            fits.append(task_fits)
            whole.append(fit_temperature(z, labels[:, i]).temperature)
    return FittedTemperatures(per_sample, fits, whole)


def temperature_block(logits: Sequence[Tensor], labels: Tensor, ball: tuple[str, float],
                      weights: Tensor | None = None, fitted: FittedTemperatures | None = None) -> dict[str, Any]:
    """:func:`metrics_block` of the temperature-scaled logits, each task's temperature cross-fitted on the
    evaluated split (:func:`fit_temperatures`, or ``fitted`` when given), with the fits."""
    if labels.shape[0] < 2:  # no other half to fit on: every number undefined
        undefined = {key: [math.nan] * len(logits) for key in metrics_block(logits, labels, ball, weights)["per_task"]}
        return {"protocol": "two-fold cross-fit on the evaluated split: not possible with one sample",
                "fold_temperatures": [], "at_bound": [], "whole_split_temperature": [],
                "per_task": undefined, "mean": block_means(undefined)}
    fitted = fit_temperatures(logits, labels) if fitted is None else fitted
    return {"protocol": "two-fold cross-fit on the evaluated split",
            "fold_temperatures": [[fit.temperature for fit in task] for task in fitted.fits],
            "at_bound": [any(fit.at_bound for fit in task) for task in fitted.fits],
            "whole_split_temperature": fitted.whole,
            **metrics_block(fitted.apply(logits), labels, ball, weights)}


def label_shift_block(logits: Sequence[Tensor], labels: Tensor, ball: tuple[str, float]) -> dict[str, Any]:
    """Every task's metrics on its label-shifted resamples (:mod:`drmoo.experiments.shifts`), per strength."""
    from .shifts import BINARY_STRENGTHS, DIGIT_FACTORS, binary_target, digit_target, resample_rows

    binary = all(z.shape[1] == 2 for z in logits)
    points = []
    grid = BINARY_STRENGTHS if binary else DIGIT_FACTORS
    for value in grid:
        rows_per_task = []
        for i, z in enumerate(logits):
            y = labels[:, i]
            if binary:  # a task whose evaluation labels hold one class cannot be shifted: NaN
                mixes = [binary_target(y, value)] if 0 < int(y.sum()) < y.numel() else []
            else:
                mixes = [digit_target(y, digit, value, z.shape[1]) for digit in range(z.shape[1])
                         if bool((y == digit).any())]
            with single_thread():
                scored = Scored.of(z, y)
                results = [scored_metrics(scored.take(resample_rows(y, mix)), ball) for mix in mixes]
            rows_per_task.append({key: _nanmean([r[key] for r in results]) for key in METRICS})
        per_task = {key: [row[key] for row in rows_per_task] for key in rows_per_task[0]}
        point: dict[str, Any] = {"positive_rate_strength": value} if binary else {
            "digit_factor": value, "strength": math.log2(value)}
        points.append({**point, "per_task": per_task, "mean": block_means(per_task)})
    family = ("positive rate pi_0 + s (1/2 - pi_0), s = positive_rate_strength" if binary
              else "one digit k = digit_factor times commoner, mean over the ten digits")
    return {"family": family, "points": points}


def noise_block(model: nn.Module, items: Tensor, labels: Tensor, to_input: Callable[[Tensor], Tensor],
                batch_size: int, device: torch.device, ball: tuple[str, float], sigmas: Sequence[float],
                fitted: FittedTemperatures | None = None) -> dict[str, Any]:
    """The metrics under Gaussian pixel noise of each ``sigmas`` (one model pass per sigma); with
    ``fitted``, also each point's ``temperature_scaled`` metrics: the noisy logits divided by the clean
    split's cross-fitted temperatures (what a model recalibrated on clean data meets under the noise)."""
    points = []
    for sigma in sigmas:
        logits = collect_logits(model, items, labels, to_input, batch_size, device, noise_sigma=sigma)
        point = {"sigma": sigma, **metrics_block(logits, labels, ball)}
        if fitted is not None:
            point["temperature_scaled"] = metrics_block(fitted.apply(logits), labels, ball)
        points.append(point)
    return {"family": "Gaussian noise of standard deviation sigma on the [0, 1] image, clamped", "points": points}


def robustness_report(model: nn.Module, items: Tensor, labels: Tensor, to_input: Callable[[Tensor], Tensor],
                      batch_size: int, device: torch.device, config: RunConfig, clean_logits: Sequence[Tensor],
                      sample_weight: Callable[[Tensor], Tensor] | None = None,
                      noise_sigmas: Sequence[float] | None = None,
                      fitted: FittedTemperatures | None = None) -> dict[str, Any]:
    """eval.json's ``robustness`` block of a run: the clean metrics (with the importance weights' nominal
    when the experiment has them), temperature-scaled, under label shift and under pixel noise, each shift
    also with the clean split's cross-fitted temperatures (``temperature_label_shift``, each noise point's
    ``temperature_scaled``).  ``fitted``: those temperatures when the caller has fitted them already."""
    from .shifts import NOISE_SIGMAS

    ball = run_ball(config)
    weights = sample_weight(labels).to(torch.float64) if sample_weight is not None else None
    sigmas = NOISE_SIGMAS if noise_sigmas is None else tuple(noise_sigmas)
    if fitted is None and labels.shape[0] >= 2:
        fitted = fit_temperatures(clean_logits, labels)
    report = {
        "run_ball": {"divergence": ball[0], "lam": ball[1]},
        "reference_balls": [{"divergence": name, "lam": lam} for name, lam in REFERENCE_BALLS],
        "weighted_nominal": weights is not None,
        "clean": metrics_block(clean_logits, labels, ball, weights),
        "temperature_scaled": temperature_block(clean_logits, labels, ball, weights, fitted),
        "label_shift": label_shift_block(clean_logits, labels, ball),
        "noise": noise_block(model, items, labels, to_input, batch_size, device, ball, sigmas, fitted),
    }
    if fitted is not None:  # the resamples draw the same samples: each keeps its other-half temperature
        report["temperature_label_shift"] = label_shift_block(fitted.apply(clean_logits), labels, ball)
    return report


# ---------------------------------------------------------------------------- printed tables

_PERCENT = ("accuracy", "balanced_accuracy", "worst_class_accuracy", "ece")
_SUMMARY = ("accuracy", "balanced_accuracy", "worst_class_accuracy", "mean_loss", "cvar_0.05", "robust_run",
            "robust_chi2_0.8", "ece", "misclassified_loss")


def _cell(key: str, value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{100 * value:.2f}" if key in _PERCENT else f"{value:.4f}"


def _rows_table(title: str, labels: Sequence[str], blocks: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    lines = [title, "", "| | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for label, block in zip(labels, blocks):
        lines.append(f"| {label} | " + " | ".join(_cell(k, block["mean"].get(k)) for k in keys) + " |")
    return lines + [""]


def robustness_tables(report: dict[str, Any]) -> str:
    """eval.json's robustness numbers as markdown: the clean metrics per task (plain and with the fitted
    temperature), the tail under each FGSM eps where there is one, and each graded shift (task means)."""
    block = report.get("robustness")
    if not isinstance(block, dict):
        return ""
    clean, scaled = block["clean"], block["temperature_scaled"]
    keys = [k for k in (*METRICS, *WEIGHTED_METRICS) if k in clean["mean"]]
    tasks = len(clean["per_task"]["accuracy"])
    ball = block["run_ball"]
    lines = [f"Robustness metrics (accuracies and ECE in %, losses in nats; robust_run: {ball['divergence']} at lam "
             f"{ball['lam']:g}; T: the temperature cross-fitted on the other half of the split)", "",
             "| metric | " + " | ".join(f"task {i + 1}" for i in range(tasks)) + " | mean | mean with T |",
             "|---|" + "---:|" * (tasks + 2)]
    for key in keys:
        cells = [_cell(key, v) for v in clean["per_task"][key]]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {_cell(key, clean['mean'][key])} | "
                     f"{_cell(key, scaled['mean'].get(key))} |")
    lines.append("")
    note = " (with T: the clean split's temperatures applied to the shifted logits)"
    fgsm = [r for r in report.get("results", []) if isinstance(r, dict) and "metrics" in r]
    if fgsm:
        names, blocks = _with_scaled([f"eps {r['eps']:g}" for r in fgsm], [r["metrics"] for r in fgsm],
                                     [r.get("metrics_temperature_scaled") for r in fgsm])
        lines += _rows_table(f"Under FGSM (means over tasks), per eps{note}", names, blocks, _SUMMARY)
    shift = block["label_shift"]["points"]
    scaled_shift = block.get("temperature_label_shift", {}).get("points", [None] * len(shift))
    names, blocks = _with_scaled(
        [f"s = {p['positive_rate_strength']:g}" if "positive_rate_strength" in p else f"k = {p['digit_factor']:g}"
         for p in shift], shift, scaled_shift)
    lines += _rows_table(f"Label shift ({block['label_shift']['family']}; means over tasks){note}",
                         ["nominal", *names], [clean, *blocks], _SUMMARY)
    noise = block["noise"]["points"]
    names, blocks = _with_scaled([f"sigma {p['sigma']:g}" for p in noise], noise,
                                 [p.get("temperature_scaled") for p in noise])
    lines += _rows_table(f"Gaussian pixel noise (means over tasks){note}", ["nominal", *names], [clean, *blocks],
                         _SUMMARY)
    return "\n".join(lines)


def _with_scaled(names: Sequence[str], blocks: Sequence[dict[str, Any]], scaled: Sequence[dict[str, Any] | None]
                 ) -> tuple[list[str], list[dict[str, Any]]]:
    """Each row followed by its temperature-scaled row (``<name> with T``) where the report has one."""
    out_names: list[str] = []
    out_blocks: list[dict[str, Any]] = []
    for name, block, with_t in zip(names, blocks, scaled, strict=True):
        out_names.append(name)
        out_blocks.append(block)
        if isinstance(with_t, dict) and isinstance(with_t.get("mean"), dict):
            out_names.append(f"{name} with T")
            out_blocks.append(with_t)
    return out_names, out_blocks
