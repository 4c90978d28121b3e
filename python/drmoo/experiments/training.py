"""The training loop of the deep multi-task experiments, with checkpoints and exact resume.

A run directory holds:

* ``config.json`` - every setting of the run (:class:`~drmoo.experiments.run_config.RunConfig`);
* ``checkpoint.pt`` - model, both optimizers, data-stream and RNG states, step counters and the
  metrics so far; written atomically at the end of every epoch (before its evaluation), at
  ``--max-steps`` and on SIGINT/SIGTERM, so ``--resume RUN_DIR`` continues bit-identically;
* ``steps.csv`` (per iteration) and ``metrics.csv`` / ``metrics.json`` (per epoch, strict JSON);
* ``environment.json`` - where each training session ran (torch, threads, CPU and its vector ISA, GPU;
  :mod:`~drmoo.experiments.environment`): a retrain is bitwise only in the same environment;
* ``eval.json`` after ``drmoo eval`` (:mod:`~drmoo.experiments.evaluation`); ``done`` marks a finished run;
* ``train.lock`` - held (``flock``) by the one process training in the directory, removed when it
  leaves (:func:`drmoo.store.run_lock`).

Every file is written and read through the run store (:mod:`drmoo.store`, which also owns the
checkpoint format); :mod:`~drmoo.experiments.checkpoints` binds a checkpoint to its run's config.
:func:`train` builds and checks everything (settings, device, model, data, optimizer, the checkpoint
and its state) before the run directory is created or changed, so a refused run or resume leaves it
as it was.  One training step (:func:`_train_step`) asks the multi-objective optimizer for the shared
parameters' step, then steps the heads with their own SGD; fp16 runs scale the losses dynamically as
``torch.amp.GradScaler`` does.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drmoo import distributed
from drmoo.cuda_graph import GraphedStep, check_graphable
from drmoo.models.multitask import MultiTaskModel
from drmoo.optim import MultiObjectiveOptimizer, NonFiniteStepError, create
from drmoo.optim._features import OneBatchPerStep
from drmoo.store import (
    LOCK_FILE,
    TEMP_SUFFIX,
    CheckpointError,
    UsageError,
    atomic_write,
    check_writable,
    json_bytes,
    make_directory,
    read_json,
    remove_file,
    run_lock,
    write_csv,
    write_files,
    write_json,
)

from .checkpoints import (
    CHECKPOINT,
    check_saved_optimizers,
    max_recorded_steps,
    payload_budget,
    read_checkpoint,
    runs_capturable,
    write_checkpoint,
)
from .devices import agreed, check_backend, setup_distributed
from .environment import ENVIRONMENT, environment_record
from .evaluation import Build as Build  # re-exported: the experiments' modules take it from here
from .evaluation import accuracy
from .jobs import progress_bar
from .loggers import MetricsCallback, row_metrics
from .run_config import RunConfig, check_run_dir, read_run_config

__all__ = ["AMP_DTYPES", "DIVERGED", "IndexStream", "TrainingInterrupted", "check_fresh_directory", "check_run_names",
           "holds_run",
           "per_sample_losses", "read_diverged", "train"]

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # run_config.AMP_MODES -> dtype
# fp16: dynamic gradient scaling with torch.amp.GradScaler's defaults (2^16, x0.5 on overflow,
# x2 after 2000 good steps); 1 (no scaling) otherwise.
GRAD_SCALE_INIT, GRAD_SCALE_BACKOFF, GRAD_SCALE_GROWTH, GRAD_SCALE_GROWTH_INTERVAL = 2.0**16, 0.5, 2.0, 2000
MAX_SKIPPED_FP16_STEPS = 50  # and more than half of the steps: fp16 cannot train this run
DIVERGED = "diverged"  # the marker of a run that ended at a non-finite step (see _stop_diverged)


class TrainingInterrupted(RuntimeError):
    """Raised after a SIGINT/SIGTERM once the checkpoint is safely on disk.

    ``signum`` is the signal (the command exits with 128 + signum, as a process that signal ends),
    ``run_dir`` the run whose checkpoint was saved at ``step``.  Picklable with its fields, so that a
    comparison worker's interruption reaches the parent whole.
    """

    def __init__(self, signum: int, step: int, run_dir: Path) -> None:
        self.signum, self.step, self.run_dir = signum, step, run_dir
        super().__init__(f"stopped by signal {signum} after step {step}; checkpoint saved, continue with "
                         f"drmoo train --resume {run_dir}")

    def __reduce__(self) -> tuple[type[TrainingInterrupted], tuple[int, int, Path]]:
        return TrainingInterrupted, (self.signum, self.step, self.run_dir)


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
        """Restore a saved stream; a state that is not a stream over ``size`` rows is refused (ValueError)."""
        order, position, drawn = state["order"], state["position"], state["samples_drawn"]
        if (not isinstance(order, Tensor) or order.dtype != torch.int64 or tuple(order.shape) != (self.size,)
                or not torch.equal(order.sort().values, torch.arange(self.size))):
            raise ValueError(f"the saved index stream is not a permutation of the {self.size} training rows")
        for name, value in (("position", position), ("samples drawn", drawn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"the saved index stream's {name} {value!r} is not a count")
        if position > self.size:
            raise ValueError(f"the saved index stream's position {position} is past its {self.size} rows")
        self.generator.set_state(state["generator"])
        self.order, self.position, self.samples_drawn = order, position, drawn


def per_sample_losses(logits: list[Tensor], labels: Tensor) -> Tensor:
    """Cross-entropy per sample and task: [B, m]."""
    return torch.stack([F.cross_entropy(z, labels[:, i], reduction="none") for i, z in enumerate(logits)], dim=1)


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


@dataclass
class _Run:
    """A run being trained: what defines it, what :func:`_build_run` made, and where it stands.

    The fields from ``step`` on are the progress a checkpoint saves beside the modules' states.
    """

    config: RunConfig
    run_dir: Path
    device: torch.device
    is_main: bool  # only rank 0 writes checkpoints, logs and progress
    model: MultiTaskModel
    data: Any
    optimizer: MultiObjectiveOptimizer  # the method's, on the shared parameters
    heads: torch.optim.SGD  # the task-specific parameters'
    stream: IndexStream
    steps_per_epoch: int
    total: int  # the step the run stops at (epochs or --max-steps)
    step: int = 0
    epoch_rows: list[dict[str, Any]] = field(default_factory=list)
    step_rows: list[dict[str, Any]] = field(default_factory=list)
    pending_epoch: int | None = None  # an epoch whose training is saved but whose evaluation is not yet
    grad_scale: dict[str, float] = field(default_factory=dict)
    saved_step: int | None = None  # the step of the last save
    started: float = 0.0  # perf_counter() when this process began training: the epochs' wall_time_s
    graphed: GraphedStep | None = None  # --cuda-graph: the step captured on first use (None: eager steps)
    on_log: MetricsCallback | None = None  # rank 0's logger of every step's and epoch's metrics (train's on_log)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT


def holds_run(directory: Path) -> bool:
    """Whether ``directory`` holds a drmoo run: a ``config.json`` that reads as a drmoo run config (no link)."""
    try:
        read_run_config(directory)
    except (UsageError, FileNotFoundError, OSError):
        return False
    return True


def check_run_names(directory: Path, names: list[str]) -> None:
    """Refuse a comparison whose run directory names are symbolic links (one line, before anything is written).

    ``ln -s VICTIM CMP/mgda-seed0`` would otherwise make ``compare --out CMP`` train into VICTIM; the
    store refuses every read and write through it anyway, this says so before the work starts.
    """
    for name in names:
        if os.path.islink(directory / name):
            raise UsageError(f"{directory / name}, the directory of one of the runs compared, is a symbolic link: "
                             "drmoo never follows a link at a run directory (someone may have planted it); remove "
                             "it or pick another --out")


def check_fresh_directory(directory: Path, what: str = "run directory", runs_below: bool = False) -> None:
    """Refuse to start writing into a directory that is neither new, empty, nor drmoo's own.

    ``directory`` may be absent, empty (drmoo's lock file and temporaries aside), or hold a drmoo
    run (``runs_below``: a comparison, with a run in one of its sub-directories).  Anything else is
    someone's data: ``--out`` pointed at the wrong place would overwrite their config.json or
    metrics.csv, so it is refused with one line and left as it is.
    """
    try:
        names = [name for name in os.listdir(directory) if name != LOCK_FILE and not name.endswith(TEMP_SUFFIX)]
    except (FileNotFoundError, NotADirectoryError):  # not there yet (or a file in the way: make_directory says so)
        return
    except OSError as error:
        raise UsageError(f"cannot list the {what} {directory}: {error.strerror or error}") from None
    if not names or holds_run(directory):
        return
    if runs_below and any(holds_run(directory / name) for name in names if not os.path.islink(directory / name)):
        return
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    raise UsageError(f"the {what} {directory} is not empty and holds no drmoo run ({shown}): refusing to write into "
                     "it; pick a new or empty --out")


def train(
    config: RunConfig,
    run_dir: Path,
    build: Build,
    *,
    resume: bool = False,
    progress: bool = True,
    sample_weight: Callable[[Tensor], Tensor] | None = None,
    on_log: MetricsCallback | None = None,
) -> dict[str, Any]:
    """Train (or continue) the run in ``run_dir``; returns the last epoch's metrics.

    ``build(config)`` returns the model and the data object (with ``train_images``,
    ``train_labels``, ``test_images``, ``test_labels``, ``images()``).  ``sample_weight(labels)``,
    when given, maps a batch's labels ``[B, m]`` to importance weights ``[B, m]`` that the closure
    returns with the losses (CelebA's label balancing).

    ``on_log(step, metrics)``, when given, is called by rank 0 after every step with the step's row of
    ``steps.csv`` (names under ``train/``) and after every epoch's evaluation with its row of
    ``metrics.csv`` (under ``epoch/``): see :mod:`drmoo.experiments.loggers`, whose
    :class:`~drmoo.experiments.loggers.TensorBoardLogger` writes them for TensorBoard.

    The process holds the directory's lock (:func:`drmoo.store.run_lock`) while it trains: a second
    trainer on the same directory is refused.  A resume may change only ``RESUMABLE_FIELDS`` (extend
    the run); its checkpoint must agree with ``config`` on everything else.
    """
    config.validate()
    run_dir = check_run_dir(run_dir)
    checkpoint_path = run_dir / CHECKPOINT
    if resume and not checkpoint_path.exists():
        raise FileNotFoundError(f"cannot resume: {checkpoint_path} does not exist")
    if not resume and checkpoint_path.exists():  # checked again under the lock
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it or pick a new "
                              "--out")
    if not resume:
        check_fresh_directory(run_dir)
    created_group, device = setup_distributed(config.device)
    is_main = distributed.rank() == 0
    try:
        check_backend(config.backend, device)
        # Every setting is checked by building the run before the directory is touched: a refusal
        # (a bad hyperparameter, backend, data root, weights file) leaves no trace on disk.
        run = _build_run(config, run_dir, build, device, is_main)
        run.on_log = on_log if is_main else None
        if is_main:
            make_directory(run_dir, "run directory")
        with run_lock(run_dir) if is_main else nullcontext():
            return _train_locked(run, resume, progress, sample_weight)
    finally:
        if created_group:
            torch.distributed.destroy_process_group()


def _build_run(config: RunConfig, run_dir: Path, build: Build, device: torch.device, is_main: bool) -> _Run:
    """The run's model (on ``device``), data, optimizer, heads' SGD and index stream, at step 0; nothing is written."""
    torch.manual_seed(config.seed)
    model, data = build(config)
    model.to(device)
    optimizer = create(config.method, model.shared_parameters(), data.num_tasks, backend=config.backend,
                       jacobian_strategy=config.jacobian_strategy,  # --jacobian-strategy (--hp refuses it)
                       # fp16 scaling needs the eager step's raise on a non-finite step
                       **{"capturable": runs_capturable(device.type, config.amp), **config.hparams})
    heads = torch.optim.SGD(model.task_parameters(), lr=config.head_lr)
    if config.cuda_graph:  # refused before anything is written (RunConfig.validate refused CPU devices and fp16)
        if distributed.world_size() > 1:
            raise UsageError("--cuda-graph trains in one process (the heads' gradients are summed over processes "
                             "between the method's step and theirs, outside the graph): drop --nproc or --cuda-graph")
        try:
            check_graphable(optimizer)
        except ValueError as error:
            raise UsageError(f"--cuda-graph: {error}") from None
    stream = IndexStream(data.train_labels.shape[0], config.batch_size, seed=config.seed)
    if stream.batch_size // distributed.world_size() < 2 and any(
            isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        # BatchNorm cannot normalise one sample per channel: say which setting, not torch's message
        raise UsageError(f"a training batch of {stream.batch_size} sample(s) per process (--batch-size "
                         f"{config.batch_size}, --train-size {data.train_labels.shape[0]}) is too small for the "
                         f"model's BatchNorm: use at least 2")
    steps_per_epoch = math.ceil(data.train_labels.shape[0] / stream.batch_size)
    total = config.epochs * steps_per_epoch if config.max_steps is None else min(
        config.epochs * steps_per_epoch, config.max_steps)
    if total > max_recorded_steps(data.num_tasks):  # its checkpoint could not be read back (payload_budget)
        raise UsageError(f"a run of {total} steps ({config.epochs} epochs of {steps_per_epoch}) is longer than the "
                         f"{max_recorded_steps(data.num_tasks)} steps whose per-step rows a checkpoint of "
                         f"{data.num_tasks} tasks may hold: lower --epochs or --max-steps")
    grad_scale = {"value": GRAD_SCALE_INIT if config.amp == "fp16" else 1.0, "good_steps": 0, "skipped_steps": 0}
    return _Run(config, run_dir, device, is_main, model, data, optimizer, heads, stream, steps_per_epoch, total,
                grad_scale=grad_scale)


def _train_locked(run: _Run, resume: bool, progress: bool, sample_weight: Callable[[Tensor], Tensor] | None
                  ) -> dict[str, Any]:
    """Restore a resumed run, then train it to ``run.total`` steps; called holding the run's lock."""
    if resume:
        # verified before anything is written; its size bounded by what this model and data can hold
        budget = payload_budget(run.model, run.data.num_tasks, run.stream.size)
        _restore(run, read_checkpoint(run.run_dir, run.config, budget))
    elif run.checkpoint_path.exists():
        raise FileExistsError(
            f"{run.run_dir} already holds a run; pass --resume {run.run_dir} to continue it or pick a new --out"
        )
    if run.is_main:  # everything is checked: from here on the run directory changes
        _start_session(run)
    run.started = time.perf_counter()
    if run.pending_epoch is not None:  # the last run saved an epoch, then its evaluation failed: evaluate it now
        _evaluate_epoch(run, run.pending_epoch)
        _save(run)
    closure = _BatchLosses(run, sample_weight)
    if run.config.cuda_graph:  # checked in _build_run; captured at its first steps after the eager warm-up
        run.graphed = GraphedStep(run.optimizer, closure.losses_of, heads=run.heads)
    _loop(run, closure, progress)
    if run.saved_step != run.step:  # the last epoch's end usually saved it already
        _save(run)
    config = run.config
    finished = run.step >= config.epochs * run.steps_per_epoch or (
        config.max_steps is not None and run.step >= config.max_steps)
    if finished and run.is_main:
        atomic_write(run.run_dir / "done", [f"{run.step}\n".encode()])
    return run.epoch_rows[-1] if run.epoch_rows else {}


# Markers, not work: written again when the session ends; eval.json describes the weights being replaced,
# so it goes too (drmoo eval writes it again for the new ones).
MARKERS = ("done", DIVERGED, "eval.json")
# Every file a session writes in its run directory (the lock aside).
SESSION_FILES = ("config.json", ENVIRONMENT, CHECKPOINT, "steps.csv", "metrics.csv", "metrics.json", *MARKERS)


def _start_session(run: _Run) -> None:
    """Write the session's config.json and environment.json and remove the markers, or change nothing.

    Every file the session will write or remove is checked first (a read-only file, a directory at its
    name); then the two files are written together (:func:`~drmoo.store.write_files`: a full disk refuses
    both), and only then are the markers removed.  A refused resume leaves the finished run as it was:
    its ``done``, ``eval.json`` and ``config.json`` untouched.
    """
    check_writable(run.run_dir / name for name in SESSION_FILES)
    # where this session's floats are made: a retrain is bitwise only on the same CPU type, threads, torch
    environment = environment_record(run.run_dir, run.step, run.device, run.optimizer.backend)
    write_files({run.run_dir / "config.json": run.config.to_json().encode(),
                 run.run_dir / ENVIRONMENT: json_bytes(environment)})
    for marker in MARKERS:
        remove_file(run.run_dir / marker)


def _check_state(state: dict[str, Any], config: RunConfig, steps_per_epoch: int) -> None:
    """Refuse a hash-valid state whose counters do not describe a run of ``config`` (forged or damaged)."""
    step, pending = state.get("step"), state.get("pending_epoch")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step {step!r} is not a count")
    if not isinstance(state.get("epochs"), list) or not isinstance(state.get("steps"), list) or not all(
            isinstance(row, dict) for row in state["epochs"] + state["steps"]):
        raise ValueError("its metrics are not lists of rows")
    if len(state["steps"]) != step:
        raise ValueError(f"it holds {len(state['steps'])} step rows for step {step}")
    last_epoch = (step - 1) // steps_per_epoch + 1 if step else 0
    if pending is not None and (isinstance(pending, bool) or not isinstance(pending, int)
                                or not 1 <= pending <= last_epoch):
        raise ValueError(f"pending epoch {pending!r} is not an epoch of its {step} steps")
    scale = state.get("grad_scale", {})
    if not isinstance(scale, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in scale.values()) or set(scale) - {"value", "good_steps", "skipped_steps"}:
        raise ValueError("its gradient scale is not a set of finite numbers")


def _check_optimizer_counters(optimizer: MultiObjectiveOptimizer, step: int) -> None:
    """The loaded optimizer's step counter against the checkpoint's ``step``: one optimizer step per training
    step, plus the capturable steps skipped on the device (each ends its session with the step counted)."""
    own = optimizer.state["drmoo"]
    skipped = int(own["skipped_steps"]) if "skipped_steps" in own else 0
    if own["step"] != step + skipped:
        raise ValueError(f"its optimizer's step counter (state.drmoo.step) is {own['step']}, but the checkpoint is "
                         f"at step {step} with {skipped} step(s) skipped on the device")


def _restore(run: _Run, state: dict[str, Any]) -> None:
    """Put a verified checkpoint's state into ``run``; refuse one that does not fit it or cannot extend it."""
    # the optimizers the settings built, before anything is loaded into them
    check_saved_optimizers(run.checkpoint_path, state, {"optimizer": run.optimizer, "heads": run.heads})
    try:
        _check_state(state, run.config, run.steps_per_epoch)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        _check_optimizer_counters(run.optimizer, int(state["step"]))
        run.heads.load_state_dict(state["heads"])
        run.stream.load_state_dict(state["stream"])
        torch.set_rng_state(state["rng"])
        if torch.cuda.is_available() and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        run.step, run.epoch_rows, run.step_rows = int(state["step"]), list(state["epochs"]), list(state["steps"])
        run.grad_scale.update(state.get("grad_scale", {}))
        run.pending_epoch = state.get("pending_epoch")
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:  # a hash-valid, wrong state
        raise CheckpointError(f"{run.checkpoint_path}: refused: its state does not fit this run "
                              f"({str(error).strip().splitlines()[0] if str(error).strip() else error!r})"
                              ) from None
    _check_extends(run, state["config"])


def _check_extends(run: _Run, saved: dict[str, Any]) -> None:
    """Refuse a resume that would shorten the run (``saved``: the checkpoint's config) or train nothing."""
    config, step, total = run.config, run.step, run.total
    if step > total:
        raise UsageError(f"cannot resume {run.run_dir} to {total} steps: it has trained {step} already; a resume "
                         "can only extend a run (--epochs / --max-steps)")
    unchanged = (saved.get("epochs"), saved.get("max_steps")) == (config.epochs, config.max_steps)
    if step == total and unchanged and run.pending_epoch is None and (run.run_dir / "done").exists():
        # a finished run resumed as it is: a session would only remove its eval.json and rewrite its files
        raise UsageError(f"{run.run_dir} is finished ({step} steps): nothing to train, and its files stay as they "
                         "are; raise --epochs or --max-steps to extend it")
    if step == total and not unchanged:
        # asked to go further, but the other limit stops the run where it is
        limit = (f"--max-steps {config.max_steps}" if config.max_steps is not None and config.max_steps == total
                 else f"--epochs {config.epochs}")
        # Named by the setting that stops it, not by --resume: compare extends runs without one.
        raise UsageError(f"{run.run_dir}: nothing to train: the run has {step} steps already and {limit} stops it "
                         "there; raise that setting too to go further")


def _save(run: _Run) -> None:
    """The checkpoint (rank 0) and the metrics files as of ``run.step``."""
    run.saved_step = run.step
    if not run.is_main:
        return
    write_checkpoint(run.checkpoint_path, {
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "heads": run.heads.state_dict(),
        "stream": run.stream.state_dict(), "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "step": run.step, "epochs": run.epoch_rows, "steps": run.step_rows, "config": asdict(run.config),
        "grad_scale": dict(run.grad_scale), "pending_epoch": run.pending_epoch,
    }, run.config)
    write_csv(run.run_dir / "steps.csv", run.step_rows)
    write_csv(run.run_dir / "metrics.csv", run.epoch_rows)
    write_json(run.run_dir / "metrics.json", run.epoch_rows)


def _evaluate_epoch(run: _Run, epoch: int) -> None:
    """Test accuracy of the model as it is; the epoch's row of metrics.csv / .json."""
    rows = [r for r in run.step_rows if r["epoch"] == epoch]
    data = run.data
    test_acc = accuracy(run.model, data.test_images, data.test_labels, 2 * run.config.batch_size, run.device,
                        data.images)
    run.model.train()
    run.epoch_rows = [r for r in run.epoch_rows if r["epoch"] != epoch] + [{
        "epoch": epoch, "step": run.step, "samples": run.stream.samples_drawn,
        "dual_objective": sum(r["dual_objective"] for r in rows) / len(rows),
        "train_acc": sum(r["train_acc"] for r in rows) / len(rows),
        "balanced_grad_norm": sum(r["balanced_grad_norm"] for r in rows) / len(rows),
        "test_acc": sum(test_acc) / len(test_acc),
        **{f"test_acc_{i + 1}": a for i, a in enumerate(test_acc)},
        "wall_time_s": time.perf_counter() - run.started,
    }]
    run.pending_epoch = None


class _BatchLosses:
    """The closure the optimizer calls: this rank's next batch through the model, per-sample losses [B, m].

    ``same_batch=True`` recomputes the previous call's batch (FAMO re-evaluates the losses after its
    step).  The last batch's logits and labels stay here for the step's training accuracy.

    With ``jacobian="features"`` a step's per-task gradients must all come from one batch (one z; see
    :mod:`drmoo.optim._features`), so the second and later draws *with a graph* of one step (MoDo's
    and SDMGrad's three batches, Double-Loop's Y, Y_bar and Y_tilde) return the step's first one: these
    methods run their single-batch form.  Draws without a graph (Double-Clip's and Double-Loop's
    dual-variable steps) stay fresh batches, as in parameters mode.  The rule is
    :class:`~drmoo.optim._features.OneBatchPerStep`'s, which ``--cuda-graph``'s closure applies too;
    :meth:`end_step` closes a step.
    """

    def __init__(self, run: _Run, sample_weight: Callable[[Tensor], Tensor] | None) -> None:
        self.run, self.sample_weight = run, sample_weight
        self.rows: Tensor | None = None
        self.logits: list[Tensor] = []
        self.labels: Tensor | None = None
        self.draws = OneBatchPerStep(self._draw, lambda: self.features_mode)

    def end_step(self) -> None:
        """Forget the step's draw with a graph: the next call draws a fresh batch, and the graph is freed."""
        self.draws.end_step()

    def __call__(self, same_batch: bool = False) -> Tensor | tuple[Tensor, ...]:
        return self.draws(same_batch)

    def _draw(self, same_batch: bool) -> Tensor | tuple[Tensor, ...]:
        if not same_batch:
            self.rows = distributed.shard(self.run.stream())  # this rank's share
        return self.losses_of(*self.batch(self.rows))

    @property
    def features_mode(self) -> bool:
        return getattr(self.run.optimizer, "features_engine", None) is not None

    def batch(self, rows: Tensor | None) -> tuple[Tensor, Tensor]:
        """The images and labels of ``rows`` (None: the next batch of this rank's share), on the device."""
        run = self.run
        if rows is None:
            rows = self.rows = distributed.shard(run.stream())
        x = run.data.images(run.data.train_images[rows]).to(run.device, non_blocking=True)
        y = run.data.train_labels[rows].to(run.device, non_blocking=True)
        return x, y

    def losses_of(self, x: Tensor, y: Tensor) -> Tensor | tuple[Tensor, ...]:
        """What the closure returns for a batch (the per-sample losses, with the features and/or weights);
        keeps the batch's logits and labels (with --cuda-graph: the graph's static tensors)."""
        run = self.run
        # jacobian="features" (a method variant such as double-clip[jacobian=features]): the optimizer takes
        # the task gradients w.r.t. the trunk's output, so the closure hands it that output too.
        features_mode = self.features_mode
        with torch.autocast(run.device.type, dtype=AMP_DTYPES.get(run.config.amp), enabled=run.config.amp != "none"):
            if features_mode:
                model = getattr(run.model, "_orig_mod", run.model)  # a compiled model: its module's parts
                trunk_output = model.features(x)
                logits = [head(trunk_output) for head in model.heads]
            else:
                logits = run.model(x)
        # losses and the dual math in float32 at least, whatever the forward's dtype (a float64 model, as the
        # reproduction test's exact reference trajectory uses, stays float64)
        logits = [z if z.dtype == torch.float64 else z.float() for z in logits]
        self.logits, self.labels = [z.detach() for z in logits], y
        losses = per_sample_losses(logits, y)
        weights = None if self.sample_weight is None else self.sample_weight(y)
        if features_mode:
            return (losses, trunk_output) if weights is None else (losses, trunk_output, weights)
        return losses if weights is None else (losses, weights)


def _loop(run: _Run, closure: _BatchLosses, progress: bool) -> None:
    """Train from ``run.step`` to ``run.total``; each epoch's end is saved, evaluated, saved; a signal saves, stops."""
    bar = progress_bar(total=run.total, initial=run.step, desc=f"{run.config.name} seed {run.config.seed}",
                       disable=not progress or not run.is_main, dynamic_ncols=True, mininterval=1.0)
    run.model.train()
    skipped: list[dict[str, Any]] = []  # fp16 steps abandoned on overflow
    with bar, _StopFlag() as stop:
        while run.step < run.total:
            try:
                row = _train_step(run, closure, skipped)
            except NonFiniteStepError as error:
                raise _stop_diverged(run, error) from None
            if row is None:  # an fp16 overflow: nothing changed, draw the next batch
                continue
            if run.on_log is not None:
                run.on_log(run.step, row_metrics(row, "train/"))
            bar.update(1)
            bar.set_postfix(loss=f"{row['dual_objective']:.3f}", acc=f"{row['train_acc']:.2f}",
                            bgn=f"{row['balanced_grad_norm']:.3g}", refresh=False)
            if run.step % run.steps_per_epoch == 0 or run.step == run.total:
                # Save the epoch's training first: its evaluation reads the test split, and a failure
                # there must not lose the epoch (a resume evaluates a pending epoch first).
                run.pending_epoch = row["epoch"]
                _save(run)
                _evaluate_epoch(run, row["epoch"])
                _save(run)
                if run.on_log is not None:
                    run.on_log(run.step, row_metrics(run.epoch_rows[-1], "epoch/"))
            if agreed(stop.raised is not None, run.device):  # every rank stops after the same step
                _save(run)
                # A rank that got no signal itself stops with the others (a launcher's SIGTERM).
                raise TrainingInterrupted(stop.raised if stop.raised is not None else signal.SIGTERM, run.step,
                                          run.run_dir)


def _train_step(run: _Run, closure: _BatchLosses, skipped: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One step of the shared parameters (the method's) and the heads (SGD); its row of steps.csv.

    None: an fp16 step overflowed and was skipped (recorded in ``skipped``); the run is unchanged.
    """
    step_started = time.perf_counter()
    if run.graphed is not None:  # --cuda-graph: the heads' zero_grad and step are in the graph
        objective = run.graphed.step(lambda: closure.batch(None))
        _refuse_skipped_step(run)  # (the heads' SGD step on a skipped step's zero gradients changed nothing)
        return _step_row(run, closure, objective, step_started)
    run.heads.zero_grad(set_to_none=True)
    run.optimizer.loss_scale = run.grad_scale["value"]
    try:
        objective = run.optimizer.step(closure)
    except NonFiniteStepError as error:
        if run.config.amp != "fp16":
            raise
        _skip_overflowed_step(run, error, skipped)
        return None
    finally:
        closure.end_step()  # (whether the step finished or raised)
    _refuse_skipped_step(run)
    distributed.all_reduce_grads(run.model.task_parameters())
    _unscale_head_grads(run)
    run.heads.step()
    return _step_row(run, closure, objective, step_started)


def _refuse_skipped_step(run: _Run) -> None:
    """Raise NonFiniteStepError if the capturable step just taken was skipped on the device."""
    stats = run.optimizer.stats
    if "found_inf" in stats and bool(stats["found_inf"]):
        # A capturable step (CUDA) skips a non-finite step on the device instead of raising;
        # stop here as the eager step would, so a run never trains on while applying nothing.
        # The heads' gradients of a skipped step are zero, and nothing is saved: the forward
        # may have put NaN into BatchNorm's running statistics.
        raise NonFiniteStepError(
            f"step {run.step + 1} met a non-finite (NaN or Inf) loss, gradient or dual quantity and was "
            f"skipped on the device ({int(stats['skipped_steps'])} skipped so far); nothing was "
            "updated"
        )


def _step_row(run: _Run, closure: _BatchLosses, objective: Tensor, step_started: float) -> dict[str, Any]:
    """Count the step just taken and return its row of steps.csv (its values read on the host here)."""
    stats = run.optimizer.stats
    run.step += 1
    labels = closure.labels  # the last batch's: set by every call of the closure, and the step called it
    if labels is None:
        raise RuntimeError(f"{type(run.optimizer).__name__}.step returned without calling the closure")
    task_acc = [float((z.argmax(1) == labels[:, i]).float().mean()) for i, z in enumerate(closure.logits)]
    row = {"step": run.step, "epoch": (run.step - 1) // run.steps_per_epoch + 1, "samples": run.stream.samples_drawn,
           "dual_objective": float(objective.mean()), "train_acc": sum(task_acc) / len(task_acc),
           "balanced_grad_norm": float(stats["balanced_grad_norm"]),
           "step_s": time.perf_counter() - step_started}
    row.update({f"w_{i + 1}": v for i, v in enumerate(stats["w"].tolist())})
    row.update({f"eta_{i + 1}": v for i, v in enumerate(stats["eta"].tolist())})
    run.step_rows.append(row)
    return row


def _stop_diverged(run: _Run, error: NonFiniteStepError) -> NonFiniteStepError:
    """End a run at a non-finite step: save its state, mark it ``diverged``; returns the error to raise.

    The abandoned step updated nothing, so the state saved is the one after the last completed
    step -- what the method produced, finite or not (an earlier step may have written Inf weights
    whose losses only now fail the check): a long run keeps its progress up to the failure, and a
    comparison evaluates exactly the model the method reached.  The ``diverged`` marker (JSON: the
    failed step, the saved step, the reason) tells ``compare`` that the run ended there: a
    diverged run is a result, reported as such, not retrained.
    """
    _save(run)
    if run.is_main:
        atomic_write(run.run_dir / DIVERGED, [json.dumps(
            {"step": run.step + 1, "saved_step": run.step, "reason": str(error)}).encode()])
    return NonFiniteStepError(f"{error}. The run stops there: its state after step {run.step} is saved in "
                              f"{run.checkpoint_path} and {run.run_dir / DIVERGED} records the failure (lower "
                              "the learning rate or check the data, and train a new run)")


def read_diverged(run_dir: Path) -> dict[str, Any] | None:
    """A run's ``diverged`` marker (the failed step, the saved step, the reason), or None when it has none.

    The marker is a run-directory file (untrusted): read through the store, bounded, and checked.
    """
    path = Path(run_dir) / DIVERGED
    if not path.is_file():
        return None
    marker = read_json(path, what="divergence marker")
    if not (isinstance(marker, dict) and all(isinstance(marker.get(key), int) and not isinstance(marker[key], bool)
                                             and marker[key] >= 0 for key in ("step", "saved_step"))
            and isinstance(marker.get("reason"), str)):
        raise UsageError(f"{path} is not a drmoo divergence marker")
    return marker


def _skip_overflowed_step(run: _Run, error: NonFiniteStepError, skipped: list[dict[str, Any]]) -> None:
    """An fp16 overflow: the optimizer changed nothing; halve the gradient scale as torch.amp.GradScaler would."""
    scale = run.grad_scale
    scale["value"] = max(scale["value"] * GRAD_SCALE_BACKOFF, 1.0)
    scale["good_steps"] = 0
    scale["skipped_steps"] += 1
    skipped.append({"step": run.step + 1, "reason": str(error)})
    if len(skipped) > MAX_SKIPPED_FP16_STEPS and len(skipped) > run.step // 2:
        raise RuntimeError(f"{len(skipped)} of {run.step + 1} fp16 steps overflowed; use --amp bf16") from error


def _unscale_head_grads(run: _Run) -> None:
    """Divide the heads' gradients by the fp16 loss scale (they come back scaled); grow it after good steps."""
    scale = run.grad_scale
    if scale["value"] == 1.0:
        return
    for param in run.model.task_parameters():
        if param.grad is not None:
            param.grad.div_(scale["value"])
    scale["good_steps"] += 1
    if scale["good_steps"] % GRAD_SCALE_GROWTH_INTERVAL == 0:
        scale["value"] *= GRAD_SCALE_GROWTH
