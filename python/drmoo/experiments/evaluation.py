"""Evaluating trained runs: per-task accuracy, clean or under FGSM, and ``eval.json``.

:func:`accuracy` is the one measurement; the training loop calls it at every epoch's end (clean), and
``drmoo eval`` (:func:`evaluate_robustness`) under each FGSM budget.  A result records the checkpoint
it was computed from (step, payload SHA-256; :func:`~drmoo.experiments.checkpoints.checkpoint_provenance`),
so a later reader can tell whether it still describes the run's weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from drmoo.attacks import fgsm, pixel_step
from drmoo.models.multitask import MultiTaskModel
from drmoo.store import CheckpointError, UsageError, save_result

from .checkpoints import CHECKPOINT, checkpoint_provenance, load_checkpoint, payload_budget
from .devices import resolve_device
from .run_config import RunConfig, read_run_config

__all__ = ["Build", "accuracy", "check_eps", "evaluate_robustness", "load_trained", "load_trained_run",
           "task_accuracies"]

# How an experiment builds a run's model and data from its config (the registry's ``build``); here, below the
# trainer, which imports this module for :func:`accuracy` and re-exports it.
Build = Callable[[RunConfig], tuple[MultiTaskModel, Any]]


@torch.no_grad()
def accuracy(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int, device: torch.device,
             to_input: Callable[[Tensor], Tensor], eps: float = 0.0, eps_space: str = "pixel") -> list[float]:
    """Per-task accuracy over a split, optionally under FGSM with budget ``eps`` (in ``eps_space``, see attacks)."""
    model.eval()
    step_scale = pixel_step(model, eps_space)
    correct = torch.zeros(labels.shape[1], dtype=torch.long)
    for start in range(0, labels.shape[0], batch_size):
        x = to_input(images[start : start + batch_size]).to(device)
        y = labels[start : start + batch_size].to(device)
        if eps > 0:
            x = fgsm(model, x, y, eps, step_scale=step_scale)
        logits = model(x)
        correct += torch.stack([(z.argmax(1) == y[:, i]).sum() for i, z in enumerate(logits)]).cpu()
    return (correct.double() / labels.shape[0]).tolist()


def task_accuracies(logits: list[Tensor], labels: Tensor) -> list[float]:
    """Per-task accuracy of every task's logits ``[N, C]`` against ``labels[:, i]``."""
    return [float((z.argmax(1) == labels[:, i].to(z.device)).double().mean()) for i, z in enumerate(logits)]


def load_trained_run(run_dir: Path, build: Build, device: str | None = None
                     ) -> tuple[RunConfig, nn.Module, Any, torch.device, dict[str, Any]]:
    """:func:`load_trained` and the provenance of the weights loaded (see :func:`checkpoint_provenance`)."""
    config = read_run_config(run_dir)
    target = resolve_device(device or config.device)
    if not os.path.lexists(run_dir / CHECKPOINT):  # before building the model and data: the cheap refusal first
        raise FileNotFoundError(f"{run_dir / CHECKPOINT} does not exist: train the run first")
    model, data = build(config)  # then: the checkpoint's size is bounded by what this model and data can hold
    budget = payload_budget(model, data.num_tasks, data.train_labels.shape[0])
    # verified (size within the budget, SHA-256, config) and never unpickled freely
    checkpoint = load_checkpoint(run_dir, config, budget)
    try:
        model.load_state_dict(checkpoint.state["model"])
        provenance = checkpoint_provenance(checkpoint)
    except (KeyError, TypeError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"{run_dir / CHECKPOINT}: refused: its model does not fit the run's "
                              f"({str(error).strip().splitlines()[0] if str(error).strip() else error!r})") from None
    model.to(target)
    return config, model, data, target, provenance


def load_trained(run_dir: Path, build: Build, device: str | None = None
                 ) -> tuple[RunConfig, nn.Module, Any, torch.device]:
    """A trained run's config, model (weights loaded, on ``device`` or the run's), data and that device."""
    return load_trained_run(run_dir, build, device)[:4]


def check_eps(eps_values: Iterable[float]) -> list[float]:
    """FGSM budgets as floats, each finite and >= 0; a clear error otherwise."""
    values = []
    for eps in eps_values:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise UsageError(f"--eps values must be finite numbers >= 0, got {eps!r}")
        values.append(float(eps))
    return values


def evaluate_robustness(
    run_dir: Path, build: Build, eps_values: list[float],
    progress: bool = True, device: str | None = None, eps_space: str = "pixel",
    noise_sigmas: list[float] | None = None,
) -> dict[str, Any]:
    """FGSM accuracy and the robustness metrics per task and on average for each eps; writes and returns
    eval.json's content.

    Each eps's result carries :func:`~drmoo.experiments.robust_eval.metrics_block` (tail, worst case,
    calibration, worst digit) beside its accuracy; ``robustness`` holds the clean metrics with the fitted
    temperature and under graded shift (:func:`~drmoo.experiments.robust_eval.robustness_report`, Gaussian
    noise at ``noise_sigmas``, default :data:`~drmoo.experiments.shifts.NOISE_SIGMAS`).

    eval.json also records the eps space, the training budget spent (iterations, samples drawn) and the
    checkpoint evaluated (step, payload SHA-256), all read from the checkpoint the weights came from.
    When eval.json cannot be written, :class:`drmoo.store.ResultNotSaved` carries the report.
    """
    from .robust_eval import collect_logits, fit_temperatures, json_safe, metrics_block, robustness_report, run_ball

    eps_values = check_eps(eps_values)
    config, model, data, target, provenance = load_trained_run(run_dir, build, device)
    batch, labels, ball = 2 * config.batch_size, data.test_labels, run_ball(config)
    step_scale = pixel_step(model, eps_space)
    results, attacked, clean = [], [], None
    for eps in tqdm(eps_values, desc="FGSM", disable=not progress):
        logits = collect_logits(model, data.test_images, labels, data.images, batch, target, eps=eps,
                                step_scale=step_scale)
        task_acc = task_accuracies(logits, labels)
        results.append({"eps": eps, "mean_acc": sum(task_acc) / len(task_acc), "task_acc": task_acc,
                        "metrics": metrics_block(logits, labels, ball)})
        attacked.append(logits)
        clean = logits if eps == 0 else clean
    if clean is None:
        clean = collect_logits(model, data.test_images, labels, data.images, batch, target)
    # The clean split's cross-fitted temperatures, applied to each eps's logits as well: what a model
    # recalibrated on clean data meets under the attack (the attack itself sees the unscaled model).
    fitted = fit_temperatures(clean, labels) if labels.shape[0] >= 2 else None
    if fitted is not None:
        for result, logits in zip(results, attacked, strict=True):
            result["metrics_temperature_scaled"] = metrics_block(fitted.apply(logits), labels, ball)
    report = {"run": str(run_dir), "method": config.method, "label": config.name, "seed": config.seed,
              "experiment": config.experiment, "model": config.model, "eval_split": config.eval_split,
              "attack": "fgsm", "eps_space": eps_space, "test_samples": int(labels.shape[0]),
              **provenance, "results": results,
              "robustness": robustness_report(model, data.test_images, labels, data.images, batch, target, config,
                                              clean, noise_sigmas=noise_sigmas, fitted=fitted)}
    save_result(run_dir / "eval.json", json_safe(report))  # strict JSON: NaN as null
    return report
