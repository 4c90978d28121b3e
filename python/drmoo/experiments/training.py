"""Training and evaluating the deep multi-task experiments, with checkpoints and exact resume.

A run directory holds:

* ``config.json`` - every setting of the run (the resolved preset, method hyperparameters, data);
* ``checkpoint.pt`` - model, both optimizers, data-stream and RNG states, step counters and the
  metrics so far; written atomically at the end of every epoch, at ``--max-steps`` and on
  SIGINT/SIGTERM, so ``--resume RUN_DIR`` continues bit-identically;
* ``steps.csv`` (per iteration) and ``metrics.csv`` / ``metrics.json`` (per epoch);
* ``eval.json`` after ``drmoo eval``; ``done`` marks a finished training run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from drmoo import distributed
from drmoo.attacks import fgsm, pixel_step
from drmoo.optim import NonFiniteStepError, create

from .reporting import training_progress

__all__ = ["IndexStream", "RunConfig", "TrainingInterrupted", "evaluate_robustness", "load_trained", "train"]

CHECKPOINT = "checkpoint.pt"
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_SCALE_INIT, GRAD_SCALE_BACKOFF, GRAD_SCALE_GROWTH, GRAD_SCALE_GROWTH_INTERVAL = 2.0**16, 0.5, 2.0, 2000


class TrainingInterrupted(RuntimeError):
    """Raised after a SIGINT/SIGTERM once the checkpoint is safely on disk."""


@dataclass
class RunConfig:
    """Everything that defines a training run (saved as config.json)."""

    experiment: str
    method: str
    preset: str
    seed: int = 0
    epochs: int = 1
    batch_size: int = 256
    input_size: int = 128
    train_size: int | None = None
    test_size: int | None = None
    weights: str = "none"
    data_root: str | None = None
    cache_dir: str | None = None
    head_lr: float = 1e-2
    max_steps: int | None = None
    device: str = "cpu"
    backend: str | None = None
    jacobian: str = "loop"
    amp: str = "none"  # autocast the model's forward: none | bf16 | fp16
    hparams: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls(**json.loads(text))


class IndexStream:
    """Shuffled passes over ``size`` rows, ``batch_size`` at a time; every call is a fresh batch.

    Its whole state (generator, current permutation, position) goes into checkpoints.
    """

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        if size < 1:
            raise ValueError("the training split is empty")
        self.size, self.batch_size = size, min(batch_size, size)
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(size, generator=self.generator)
        self.position = 0
        self.samples_drawn = 0

    def __call__(self) -> Tensor:
        if self.position + self.batch_size > self.size:  # drop the ragged tail, reshuffle
            self.order = torch.randperm(self.size, generator=self.generator)
            self.position = 0
        rows = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        self.samples_drawn += self.batch_size
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": self.order.clone(), "position": self.position,
                "samples_drawn": self.samples_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.position, self.samples_drawn = state["order"], state["position"], state["samples_drawn"]


def per_sample_losses(logits: list[Tensor], labels: Tensor) -> Tensor:
    """Cross-entropy per sample and task: [B, m]."""
    return torch.stack([F.cross_entropy(z, labels[:, i], reduction="none") for i, z in enumerate(logits)], dim=1)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


class _StopFlag:
    """Turns SIGINT/SIGTERM into a flag checked between steps (the step in flight completes)."""

    def __init__(self) -> None:
        self.raised: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.raised = signum

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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


def train(
    config: RunConfig,
    run_dir: Path,
    build: Callable[[RunConfig], tuple[nn.Module, Any]],
    *,
    resume: bool = False,
    progress: bool = True,
    sample_weight: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, Any]:
    """Train (or continue) the run in ``run_dir``; returns the last epoch's metrics.

    ``build(config)`` returns the model and the data object (with ``train_images``,
    ``train_labels``, ``test_images``, ``test_labels``, ``images()``).  ``sample_weight(labels)``,
    when given, maps a batch's labels ``[B, m]`` to importance weights ``[B, m]`` that the closure
    returns with the losses (CelebA's label balancing).
    """
    if config.amp not in AMP_DTYPES:
        raise ValueError(f"unknown --amp {config.amp!r}; valid choices: {', '.join(AMP_DTYPES)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    created_group, device = _setup_distributed(config)
    is_main = distributed.rank() == 0  # only rank 0 writes checkpoints, logs and progress
    checkpoint_path = run_dir / CHECKPOINT
    if resume:
        if not checkpoint_path.is_file():
            raise FileNotFoundError(f"cannot resume: {checkpoint_path} does not exist")
    elif checkpoint_path.exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it or pick a new --out"
        )
    if is_main:
        (run_dir / "config.json").write_text(config.to_json())

    torch.manual_seed(config.seed)
    model, data = build(config)
    model.to(device)
    shared = model.shared_parameters()
    optimizer = create(config.method, shared, data.num_tasks, backend=config.backend, **config.hparams)
    optimizer.jacobian_strategy = config.jacobian
    heads = torch.optim.SGD(model.task_parameters(), lr=config.head_lr)
    stream = IndexStream(data.train_labels.shape[0], config.batch_size, seed=config.seed)
    steps_per_epoch = math.ceil(data.train_labels.shape[0] / stream.batch_size)
    total = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    step, epoch_rows, step_rows = 0, [], []
    # fp16: dynamic gradient scaling with torch.amp.GradScaler's defaults (2^16, x0.5 on overflow,
    # x2 after 2000 good steps); 1 (no scaling) otherwise.
    grad_scale = {"value": GRAD_SCALE_INIT if config.amp == "fp16" else 1.0, "good_steps": 0, "skipped_steps": 0}
    if resume:
        state = torch.load(checkpoint_path, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        heads.load_state_dict(state["heads"])
        stream.load_state_dict(state["stream"])
        torch.set_rng_state(state["rng"])
        if torch.cuda.is_available() and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        step, epoch_rows, step_rows = state["step"], state["epochs"], state["steps"]
        grad_scale.update(state.get("grad_scale", {}))

    def save() -> None:
        if not is_main:
            return
        _atomic_save({
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "heads": heads.state_dict(),
            "stream": stream.state_dict(), "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "step": step, "epochs": epoch_rows, "steps": step_rows, "config": asdict(config),
            "grad_scale": dict(grad_scale),
        }, checkpoint_path)
        _write_csv(run_dir / "steps.csv", step_rows)
        _write_csv(run_dir / "metrics.csv", epoch_rows)
        (run_dir / "metrics.json").write_text(json.dumps(epoch_rows, indent=2))

    last: dict[str, Tensor] = {}
    skipped: list[dict[str, Any]] = []  # fp16 steps abandoned on overflow

    def closure(same_batch: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        # same_batch: recompute the previous call's batch (FAMO re-evaluates the losses after its step)
        rows = last["rows"] if same_batch else distributed.shard(stream())  # this rank's share
        last["rows"] = rows
        x = data.images(data.train_images[rows]).to(device, non_blocking=True)
        y = data.train_labels[rows].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=AMP_DTYPES.get(config.amp), enabled=config.amp != "none"):
            logits = model(x)
        logits = [z.float() for z in logits]  # losses and the dual math in float32 whatever the forward's dtype
        last["logits"], last["labels"] = [z.detach() for z in logits], y
        losses = per_sample_losses(logits, y)
        return losses if sample_weight is None else (losses, sample_weight(y))

    model.train()
    started = time.perf_counter()
    bar = tqdm(total=total, initial=step, desc=f"{config.method} seed {config.seed}",
               disable=not progress or not is_main, dynamic_ncols=True, mininterval=1.0)
    with _StopFlag() as stop:
        while step < total:
            heads.zero_grad(set_to_none=True)
            step_started = time.perf_counter()
            optimizer.loss_scale = grad_scale["value"]
            try:
                objective = optimizer.step(closure)
            except NonFiniteStepError as error:
                if config.amp != "fp16":
                    raise
                # An fp16 overflow: the optimizer changed nothing; skip the step and halve the
                # gradient scale as torch.amp.GradScaler would, then draw the next batch.
                grad_scale["value"] = max(grad_scale["value"] * GRAD_SCALE_BACKOFF, 1.0)
                grad_scale["good_steps"] = 0
                grad_scale["skipped_steps"] += 1
                skipped.append({"step": step + 1, "reason": str(error)})
                if len(skipped) > 50 and len(skipped) > step // 2:
                    raise RuntimeError(f"{len(skipped)} of {step + 1} fp16 steps overflowed; use --amp bf16") from error
                continue
            distributed.all_reduce_grads(model.task_parameters())
            if grad_scale["value"] != 1.0:  # the heads' gradients come back scaled
                for param in model.task_parameters():
                    if param.grad is not None:
                        param.grad.div_(grad_scale["value"])
                grad_scale["good_steps"] += 1
                if grad_scale["good_steps"] % GRAD_SCALE_GROWTH_INTERVAL == 0:
                    grad_scale["value"] *= GRAD_SCALE_GROWTH
            heads.step()
            step += 1
            stats = optimizer.stats
            labels = last["labels"]
            task_acc = [float((z.argmax(1) == labels[:, i]).float().mean()) for i, z in enumerate(last["logits"])]
            row = {"step": step, "epoch": (step - 1) // steps_per_epoch + 1, "samples": stream.samples_drawn,
                   "dual_objective": float(objective.mean()), "train_acc": sum(task_acc) / len(task_acc),
                   "balanced_grad_norm": float(stats["balanced_grad_norm"]),
                   "step_s": time.perf_counter() - step_started}
            row.update({f"w_{i + 1}": v for i, v in enumerate(stats["w"].tolist())})
            row.update({f"eta_{i + 1}": v for i, v in enumerate(stats["eta"].tolist())})
            step_rows.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['dual_objective']:.3f}", acc=f"{row['train_acc']:.2f}",
                            bgn=f"{row['balanced_grad_norm']:.3g}", refresh=False)
            epoch_done = step % steps_per_epoch == 0 or step == total
            if epoch_done:
                rows = [r for r in step_rows if r["epoch"] == row["epoch"]]
                test_acc = accuracy(model, data.test_images, data.test_labels, 2 * config.batch_size, device,
                                    data.images)
                model.train()
                epoch_rows = [r for r in epoch_rows if r["epoch"] != row["epoch"]] + [{
                    "epoch": row["epoch"], "step": step, "samples": stream.samples_drawn,
                    "dual_objective": sum(r["dual_objective"] for r in rows) / len(rows),
                    "train_acc": sum(r["train_acc"] for r in rows) / len(rows),
                    "balanced_grad_norm": sum(r["balanced_grad_norm"] for r in rows) / len(rows),
                    "test_acc": sum(test_acc) / len(test_acc),
                    **{f"test_acc_{i + 1}": a for i, a in enumerate(test_acc)},
                    "wall_time_s": time.perf_counter() - started,
                }]
                save()
            if _agreed(stop.raised is not None, device):  # every rank stops after the same step
                save()
                bar.close()
                raise TrainingInterrupted(
                    f"stopped by signal {stop.raised} after step {step}; checkpoint saved, continue with "
                    f"drmoo train --resume {run_dir}"
                )
    bar.close()
    save()
    finished = step >= config.epochs * steps_per_epoch or (config.max_steps is not None and step >= config.max_steps)
    if finished and is_main:
        (run_dir / "done").write_text(f"{step}\n")
    if created_group:
        torch.distributed.destroy_process_group()
    return epoch_rows[-1] if epoch_rows else {}


def _setup_distributed(config: RunConfig) -> tuple[bool, torch.device]:
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns (created it, device)."""
    device = torch.device(config.device)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return False, device
    if device.type == "cuda":  # one GPU per process, NCCL between them
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True, device


def _agreed(flag: bool, device: torch.device) -> bool:
    """True on every rank as soon as it is true on one (a no-op in a single process)."""
    if not distributed.is_distributed():
        return flag
    return bool(distributed.all_reduce_max(torch.tensor([int(flag)], device=device)).item())


def load_trained(run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], device: str | None = None
                 ) -> tuple[RunConfig, nn.Module, Any, torch.device]:
    """A trained run's config, model (weights loaded, on ``device`` or the run's), data and that device."""
    config = RunConfig.from_json((run_dir / "config.json").read_text())
    checkpoint = run_dir / CHECKPOINT
    if not checkpoint.is_file():
        raise FileNotFoundError(f"{checkpoint} does not exist: train the run first")
    target = torch.device(device or config.device)
    model, data = build(config)
    model.load_state_dict(torch.load(checkpoint, weights_only=False, map_location="cpu")["model"])
    model.to(target)
    return config, model, data, target


def evaluate_robustness(
    run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], eps_values: list[float],
    progress: bool = True, device: str | None = None, eps_space: str = "pixel",
) -> dict[str, Any]:
    """FGSM accuracy per task and on average for each eps; writes and returns eval.json's content.

    eval.json also records the eps space and the training budget spent (iterations, samples drawn).
    """
    config, model, data, target = load_trained(run_dir, build, device)
    results = []
    for eps in tqdm(eps_values, desc="FGSM", disable=not progress):
        task_acc = accuracy(model, data.test_images, data.test_labels, 2 * config.batch_size, target, data.images, eps,
                            eps_space)
        results.append({"eps": eps, "mean_acc": sum(task_acc) / len(task_acc), "task_acc": task_acc})
    report = {"run": str(run_dir), "method": config.method, "seed": config.seed, "experiment": config.experiment,
              "attack": "fgsm", "eps_space": eps_space, "test_samples": int(data.test_labels.shape[0]),
              **training_progress(run_dir), "results": results}
    (run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    return report
