"""Training and evaluating the deep multi-task experiments, with checkpoints and exact resume.

A run directory holds:

* ``config.json`` - every setting of the run (the resolved preset, method hyperparameters, data);
* ``checkpoint.pt`` - model, both optimizers, data-stream and RNG states, step counters and the
  metrics so far; written atomically at the end of every epoch (before its evaluation), at
  ``--max-steps`` and on SIGINT/SIGTERM, so ``--resume RUN_DIR`` continues bit-identically;
* ``steps.csv`` (per iteration) and ``metrics.csv`` / ``metrics.json`` (per epoch, strict JSON);
* ``eval.json`` after ``drmoo eval``; ``done`` marks a finished training run;
* ``train.lock`` - held (``flock``) by the one process training in the directory.

Every file here is written and read through the run store (:mod:`drmoo.store`): atomic writes into
exclusive temporaries, a lock that refuses symlinks, bounded reads, and the checkpoint format (a
one-line JSON header with the run's config and step and the payload's size and SHA-256, then the
``torch.save`` payload), verified before anything is unpickled with ``weights_only=True``.
:func:`train` builds and checks everything (settings, model, data, optimizer, the checkpoint and
its state) before the run directory is created or changed, so a refused run or resume leaves it as
it was.  ``eval.json`` records the checkpoint it evaluated (step, payload SHA-256).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from drmoo import distributed
from drmoo.attacks import fgsm, pixel_step
from drmoo.optim import NonFiniteStepError, create
from drmoo.store import (
    CHECKPOINT_MAGIC,
    LOCK_FILE,
    MAX_HEADER_BYTES,
    CheckpointError,
    CheckpointFile,
    RunLockedError,
    UsageError,
    atomic_write,
    make_directory,
    parse_json,
    read_bytes,
    read_checkpoint_file,
    read_checkpoint_header,
    remove_file,
    run_lock,
    save_result,
    write_checkpoint_file,
    write_csv,
    write_json,
)
from drmoo_kernels import resolve_backend

__all__ = ["CHECKPOINT_MAGIC", "LOCK_FILE", "MAX_HEADER_BYTES", "CheckpointError", "IndexStream", "RunConfig",
           "RunLockedError", "TrainingInterrupted", "UsageError", "atomic_write", "config_differences",
           "evaluate_robustness", "load_checkpoint", "load_trained", "read_checkpoint", "read_run_config",
           "resolve_device", "run_lock", "train", "write_json"]

CHECKPOINT = "checkpoint.pt"
MAX_CONFIG_BYTES = 1 << 20  # a config.json is ~1 KB
# Upper bounds of every count (a value past them is a typo, and past 2**63 it would overflow torch).
MAX_COUNTS = {"epochs": 100_000, "batch_size": 1 << 20, "input_size": 4096, "train_size": 1 << 31,
              "test_size": 1 << 31, "max_steps": 1 << 40}
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
JACOBIANS = ("loop", "batched")
# The settings a resume may change: how far the run goes, and where it runs (a GPU run may be continued
# on a CPU; the continuation is then not bit-identical to one on the GPU).  Every other field defines the run.
RESUMABLE_FIELDS = ("epochs", "max_steps", "device")
MODELS = ("resnet18", "lenet")
EVAL_SPLITS = ("test", "validation")
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
    model: str = "resnet18"  # the experiment's network: resnet18 (the paper's) | lenet (Multi-MNIST's MultiLeNet)
    eval_split: str = "test"  # test | validation (held-out training digits, for choosing hyperparameters)
    label: str = ""  # the run's name in tables and its directory, e.g. "mgda[pref_lr=0]" ("": the method)

    @property
    def name(self) -> str:
        """What tables call this run: its label, or the method's registry name."""
        return self.label or self.method

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, source: str | Path = "config") -> RunConfig:
        """A config from JSON (strict, depth-bounded: :func:`drmoo.store.parse_json`), validated."""
        values = parse_json(text, source)
        if not isinstance(values, dict):
            raise UsageError(f"{source}: expected a JSON object")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        missing = sorted(f.name for f in fields(cls) if f.name in ("experiment", "method", "preset")
                         and f.name not in values)
        if unknown or missing:
            raise UsageError(f"{source}: unknown setting(s) {', '.join(unknown)}" if unknown
                             else f"{source}: missing setting(s) {', '.join(missing)}")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Refuse settings that cannot define a run (counts below 1 or past their bound, a non-finite rate, ...)."""
        for name in ("experiment", "method", "preset", "weights", "device", "jacobian", "amp"):
            if not isinstance(getattr(self, name), str):
                raise UsageError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("data_root", "cache_dir", "backend"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value == ""):
                raise UsageError(f"--{name.replace('_', '-')} must be a non-empty string, got {value!r}")
        for name, bound in MAX_COUNTS.items():
            value = getattr(self, name)
            if value is None and name in ("train_size", "test_size", "max_steps"):
                continue  # None: all of the split / no step limit
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1 and <= {bound}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be an integer >= 0 and <= {MAX_SEED}, got {self.seed!r}")
        if self.jacobian not in JACOBIANS:
            raise UsageError(f"unknown --jacobian {self.jacobian!r}; valid choices: {', '.join(JACOBIANS)}")
        if isinstance(self.head_lr, bool) or not isinstance(self.head_lr, (int, float)) or not (
                math.isfinite(self.head_lr) and self.head_lr > 0):
            raise UsageError(f"--head-lr must be a finite number > 0, got {self.head_lr!r}")
        if self.amp not in AMP_DTYPES:
            raise UsageError(f"unknown --amp {self.amp!r}; valid choices: {', '.join(AMP_DTYPES)}")
        if not isinstance(self.hparams, dict):
            raise UsageError(f"hparams must be a mapping, got {type(self.hparams).__name__}")
        if self.model not in MODELS:
            raise UsageError(f"unknown --model {self.model!r}; valid choices: {', '.join(MODELS)}")
        if self.eval_split not in EVAL_SPLITS:
            raise UsageError(f"unknown --eval-split {self.eval_split!r}; valid choices: {', '.join(EVAL_SPLITS)}")
        if not isinstance(self.label, str) or len(self.label) > 200 or any(c in self.label for c in "/\\\0\n"):
            raise UsageError(f"a run label is a short name without path separators, got {self.label!r}")


def config_differences(saved: RunConfig | dict[str, Any], wanted: RunConfig | dict[str, Any],
                       ignore: Iterable[str] = RESUMABLE_FIELDS) -> list[str]:
    """``"field: saved -> wanted"`` for every setting (but ``ignore``'s) on which two runs differ."""
    old = saved if isinstance(saved, dict) else asdict(saved)
    new = wanted if isinstance(wanted, dict) else asdict(wanted)
    skipped = set(ignore)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if key not in skipped and old.get(key) != new.get(key)]


def read_run_config(run_dir: Path) -> RunConfig:
    """The config.json of a run directory; a clear error when it is missing or not a drmoo run config."""
    if str(run_dir) == "":
        raise UsageError("the run directory is an empty path (an unset shell variable?)")
    path = run_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory of drmoo train?")
    try:
        return RunConfig.from_json(read_bytes(path, MAX_CONFIG_BYTES, "run config"), path)
    except (ValueError, TypeError) as error:  # a UsageError already names the file
        message = str(error) if isinstance(error, UsageError) else f"{path}: {error}"
        raise UsageError(f"{message} (is {run_dir} a drmoo run directory?)") from None


def resolve_device(text: str) -> torch.device:
    """``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` as a device this machine has; a clear error otherwise."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown --device {text!r}; valid choices: auto, cpu, cuda, cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device {text}: drmoo runs on cpu or cuda (auto, cpu, cuda, cuda:N)")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {text}: no CUDA GPU is usable on this machine (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_backend(backend: str | None, device: torch.device) -> None:
    """Refuse (one line) a kernel backend that does not exist or cannot run on ``device`` here."""
    if backend is None:
        return
    try:
        resolve_backend(backend, device)
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"--backend {backend}: {reason}") from None


def prepare_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and its parents) or refuse with one line: empty, a file in the way, no permission."""
    make_directory(run_dir, "run directory")


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


def write_checkpoint(path: Path, state: dict[str, Any], config: RunConfig) -> str:
    """``state`` behind a header with the run's config and the payload's size and SHA-256 (atomic); the hash."""
    return write_checkpoint_file(path, state, {"config": asdict(config), "step": state.get("step")})


def load_checkpoint(run_dir: Path, config: RunConfig | None = None) -> CheckpointFile:
    """The verified checkpoint of ``run_dir`` (header, state, payload SHA-256); see :func:`read_checkpoint`."""
    path = run_dir / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: train the run first")
    expected = config if config is not None else read_run_config(run_dir)
    checkpoint = read_checkpoint_file(path)
    saved_config = checkpoint.header.get("config")
    if not isinstance(saved_config, dict):
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated")
    differences = config_differences(saved_config, expected)
    if differences:
        raise CheckpointError(f"{path}: refused: it belongs to a run with other settings than "
                              f"{run_dir / 'config.json'} ({'; '.join(differences)})")
    if checkpoint.state.get("config") != saved_config:
        raise CheckpointError(f"{path}: refused: its payload does not match its header")
    return checkpoint


def read_checkpoint(run_dir: Path, config: RunConfig | None = None) -> dict[str, Any]:
    """The state in ``run_dir``'s checkpoint, after checking it belongs to the run and is intact.

    Refused (:class:`CheckpointError`, one line) unless the run store's checks pass
    (:func:`drmoo.store.read_checkpoint_file`: a regular file, drmoo's header, the announced size,
    the SHA-256, ``weights_only=True`` unpickling) and the header's config agrees with ``config``
    (default: ``run_dir/config.json``) on every setting but ``RESUMABLE_FIELDS``.
    """
    return load_checkpoint(run_dir, config).state


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

    The process holds the directory's lock (:func:`run_lock`) while it trains: a second trainer on
    the same directory is refused.  A resume may change only ``RESUMABLE_FIELDS`` (extend the run);
    its checkpoint must agree with ``config`` on everything else.
    """
    config.validate()
    if str(run_dir) == "":
        raise UsageError("the run directory is an empty path (an unset shell variable?)")
    run_dir = Path(run_dir)
    checkpoint_path = run_dir / CHECKPOINT
    if resume and not checkpoint_path.exists():
        raise FileNotFoundError(f"cannot resume: {checkpoint_path} does not exist")
    if not resume and checkpoint_path.exists():  # checked again under the lock
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it or pick a new "
                              "--out")
    created_group, device = _setup_distributed(config)
    is_main = distributed.rank() == 0  # only rank 0 writes checkpoints, logs and progress
    try:
        check_backend(config.backend, device)
        # Every setting is checked by building the run before the directory is touched: a refusal
        # (a bad hyperparameter, backend, data root, weights file) leaves no trace on disk.
        parts = _build_run(config, build, device)
        if is_main:
            prepare_run_dir(run_dir)
        with run_lock(run_dir) if is_main else nullcontext():
            return _train_locked(config, run_dir, parts, device, is_main, resume, progress, sample_weight)
    finally:
        if created_group:
            torch.distributed.destroy_process_group()


def _build_run(config: RunConfig, build: Callable[[RunConfig], tuple[nn.Module, Any]], device: torch.device
               ) -> tuple[nn.Module, Any, Any, torch.optim.Optimizer, IndexStream]:
    """The run's model (on ``device``), data, optimizer, heads' SGD and index stream; nothing is written."""
    torch.manual_seed(config.seed)
    model, data = build(config)
    model.to(device)
    optimizer = create(config.method, model.shared_parameters(), data.num_tasks, backend=config.backend,
                       # fp16 scaling needs the eager step's raise on a non-finite step
                       **{"capturable": device.type == "cuda" and config.amp != "fp16", **config.hparams})
    optimizer.jacobian_strategy = config.jacobian
    heads = torch.optim.SGD(model.task_parameters(), lr=config.head_lr)
    stream = IndexStream(data.train_labels.shape[0], config.batch_size, seed=config.seed)
    if stream.batch_size // distributed.world_size() < 2 and any(
            isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        # BatchNorm cannot normalise one sample per channel: say which setting, not torch's message
        raise UsageError(f"a training batch of {stream.batch_size} sample(s) per process (--batch-size "
                         f"{config.batch_size}, --train-size {data.train_labels.shape[0]}) is too small for the "
                         f"model's BatchNorm: use at least 2")
    return model, data, optimizer, heads, stream


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


def _train_locked(
    config: RunConfig, run_dir: Path, parts: tuple[nn.Module, Any, Any, torch.optim.Optimizer, IndexStream],
    device: torch.device, is_main: bool, resume: bool, progress: bool,
    sample_weight: Callable[[Tensor], Tensor] | None,
) -> dict[str, Any]:
    checkpoint_path = run_dir / CHECKPOINT
    state: dict[str, Any] | None = None
    if resume:
        state = read_checkpoint(run_dir, config)  # verified before anything is written
    elif checkpoint_path.exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it or pick a new --out"
        )
    model, data, optimizer, heads, stream = parts
    steps_per_epoch = math.ceil(data.train_labels.shape[0] / stream.batch_size)
    total = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    step, epoch_rows, step_rows = 0, [], []
    pending_epoch: int | None = None  # an epoch whose training is saved but whose evaluation is not yet
    # fp16: dynamic gradient scaling with torch.amp.GradScaler's defaults (2^16, x0.5 on overflow,
    # x2 after 2000 good steps); 1 (no scaling) otherwise.
    grad_scale = {"value": GRAD_SCALE_INIT if config.amp == "fp16" else 1.0, "good_steps": 0, "skipped_steps": 0}
    if state is not None:
        try:
            _check_state(state, config, steps_per_epoch)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            heads.load_state_dict(state["heads"])
            stream.load_state_dict(state["stream"])
            torch.set_rng_state(state["rng"])
            if torch.cuda.is_available() and state.get("cuda_rng") is not None:
                torch.cuda.set_rng_state_all(state["cuda_rng"])
            step, epoch_rows, step_rows = int(state["step"]), list(state["epochs"]), list(state["steps"])
            grad_scale.update(state.get("grad_scale", {}))
            pending_epoch = state.get("pending_epoch")
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:  # a hash-valid, wrong state
            raise CheckpointError(f"{checkpoint_path}: refused: its state does not fit this run "
                                  f"({str(error).strip().splitlines()[0] if str(error).strip() else error!r})"
                                  ) from None
        if step > total:
            raise UsageError(f"cannot resume {run_dir} to {total} steps: it has trained {step} already; a resume "
                             "can only extend a run (--epochs / --max-steps)")
        saved = state["config"]
        if step == total and (saved.get("epochs"), saved.get("max_steps")) != (config.epochs, config.max_steps):
            # asked to go further, but the other limit stops the run where it is
            limit = (f"--max-steps {config.max_steps}" if config.max_steps is not None and config.max_steps == total
                     else f"--epochs {config.epochs}")
            raise UsageError(f"--resume {run_dir}: nothing to train: the run has {step} steps and its {limit} stops "
                             "it there; raise that setting too to go further")
    if is_main:  # everything is checked: from here on the run directory changes
        remove_file(run_dir / "done")  # a marker, not work: written again when this run finishes
        atomic_write(run_dir / "config.json", [config.to_json().encode()])

    saved_at: dict[str, int] = {}

    def save() -> None:
        saved_at["step"] = step
        if not is_main:
            return
        write_checkpoint(checkpoint_path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "heads": heads.state_dict(),
            "stream": stream.state_dict(), "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "step": step, "epochs": epoch_rows, "steps": step_rows, "config": asdict(config),
            "grad_scale": dict(grad_scale), "pending_epoch": pending_epoch,
        }, config)
        write_csv(run_dir / "steps.csv", step_rows)
        write_csv(run_dir / "metrics.csv", epoch_rows)
        write_json(run_dir / "metrics.json", epoch_rows)

    started = time.perf_counter()

    def evaluate_epoch(epoch: int) -> None:
        """Test accuracy of the model as it is; the epoch's row of metrics.csv / .json."""
        nonlocal epoch_rows, pending_epoch
        rows = [r for r in step_rows if r["epoch"] == epoch]
        test_acc = accuracy(model, data.test_images, data.test_labels, 2 * config.batch_size, device, data.images)
        model.train()
        epoch_rows = [r for r in epoch_rows if r["epoch"] != epoch] + [{
            "epoch": epoch, "step": step, "samples": stream.samples_drawn,
            "dual_objective": sum(r["dual_objective"] for r in rows) / len(rows),
            "train_acc": sum(r["train_acc"] for r in rows) / len(rows),
            "balanced_grad_norm": sum(r["balanced_grad_norm"] for r in rows) / len(rows),
            "test_acc": sum(test_acc) / len(test_acc),
            **{f"test_acc_{i + 1}": a for i, a in enumerate(test_acc)},
            "wall_time_s": time.perf_counter() - started,
        }]
        pending_epoch = None

    if pending_epoch is not None:  # the last run saved an epoch, then its evaluation failed: evaluate it now
        evaluate_epoch(pending_epoch)
        save()

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
            stats = optimizer.stats
            if "found_inf" in stats and bool(stats["found_inf"]):
                # A capturable step (CUDA) skips a non-finite step on the device instead of raising;
                # stop here as the eager step would, so a run never trains on while applying nothing.
                # The heads' gradients of a skipped step are zero, and nothing is saved: the forward
                # may have put NaN into BatchNorm's running statistics.
                raise NonFiniteStepError(
                    f"step {step + 1} met a non-finite (NaN or Inf) loss, gradient or dual quantity and was "
                    f"skipped on the device ({int(stats['skipped_steps'])} skipped so far); nothing was "
                    "updated. The last checkpoint is the last saved epoch; lower the learning rate or check "
                    "the data before resuming"
                )
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
                # Save the epoch's training first: its evaluation reads the test split, and a failure
                # there must not lose the epoch (a resume evaluates a pending epoch first).
                pending_epoch = row["epoch"]
                save()
                evaluate_epoch(row["epoch"])
                save()
            if _agreed(stop.raised is not None, device):  # every rank stops after the same step
                save()
                bar.close()
                raise TrainingInterrupted(
                    f"stopped by signal {stop.raised} after step {step}; checkpoint saved, continue with "
                    f"drmoo train --resume {run_dir}"
                )
    bar.close()
    if saved_at.get("step") != step:  # the last epoch's end usually saved it already
        save()
    finished = step >= config.epochs * steps_per_epoch or (config.max_steps is not None and step >= config.max_steps)
    if finished and is_main:
        atomic_write(run_dir / "done", [f"{step}\n".encode()])
    return epoch_rows[-1] if epoch_rows else {}


def _setup_distributed(config: RunConfig) -> tuple[bool, torch.device]:
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns (created it, device)."""
    device = resolve_device(config.device)
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


def load_trained_run(run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], device: str | None = None
                     ) -> tuple[RunConfig, nn.Module, Any, torch.device, dict[str, Any]]:
    """:func:`load_trained` and the provenance of the weights loaded (see :func:`checkpoint_provenance`)."""
    config = read_run_config(run_dir)
    checkpoint = load_checkpoint(run_dir, config)  # verified (size, SHA-256, config) and never unpickled freely
    target = resolve_device(device or config.device)
    model, data = build(config)
    try:
        model.load_state_dict(checkpoint.state["model"])
        provenance = checkpoint_provenance(checkpoint)
    except (KeyError, TypeError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"{run_dir / CHECKPOINT}: refused: its model does not fit the run's "
                              f"({str(error).strip().splitlines()[0] if str(error).strip() else error!r})") from None
    model.to(target)
    return config, model, data, target, provenance


def load_trained(run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], device: str | None = None
                 ) -> tuple[RunConfig, nn.Module, Any, torch.device]:
    """A trained run's config, model (weights loaded, on ``device`` or the run's), data and that device."""
    return load_trained_run(run_dir, build, device)[:4]


def checkpoint_provenance(checkpoint: CheckpointFile) -> dict[str, Any]:
    """What a result computed from ``checkpoint``'s weights records: the iterations and samples that trained
    them, and the checkpoint itself (step and payload SHA-256) so a later reader can tell it still describes it."""
    step, drawn = checkpoint.state["step"], checkpoint.state["stream"]["samples_drawn"]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (step, drawn)):
        raise ValueError("its step or samples drawn is not a count")
    return {"iterations": step, "samples_seen": drawn,
            "checkpoint": {"step": step, "payload_sha256": checkpoint.sha256}}


def result_matches_checkpoint(run_dir: Path, result: Any) -> bool:
    """Whether a saved result (eval.json) was computed from the checkpoint ``run_dir`` holds now."""
    recorded = result.get("checkpoint") if isinstance(result, dict) else None
    if not isinstance(recorded, dict):
        return False  # written by an older drmoo, or forged: not known to describe these weights
    try:
        header = read_checkpoint_header(run_dir / CHECKPOINT)
    except (UsageError, FileNotFoundError):
        return False
    return recorded.get("payload_sha256") == header["payload_sha256"] and recorded.get("step") == header.get("step")


def check_eps(eps_values: Iterable[float]) -> list[float]:
    """FGSM budgets as floats, each finite and >= 0; a clear error otherwise."""
    values = []
    for eps in eps_values:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise UsageError(f"--eps values must be finite numbers >= 0, got {eps!r}")
        values.append(float(eps))
    return values


def evaluate_robustness(
    run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], eps_values: list[float],
    progress: bool = True, device: str | None = None, eps_space: str = "pixel",
) -> dict[str, Any]:
    """FGSM accuracy per task and on average for each eps; writes and returns eval.json's content.

    eval.json also records the eps space, the training budget spent (iterations, samples drawn) and the
    checkpoint evaluated (step, payload SHA-256), all read from the checkpoint the weights came from.
    When eval.json cannot be written, :class:`drmoo.store.ResultNotSaved` carries the report.
    """
    eps_values = check_eps(eps_values)
    config, model, data, target, provenance = load_trained_run(run_dir, build, device)
    results = []
    for eps in tqdm(eps_values, desc="FGSM", disable=not progress):
        task_acc = accuracy(model, data.test_images, data.test_labels, 2 * config.batch_size, target, data.images, eps,
                            eps_space)
        results.append({"eps": eps, "mean_acc": sum(task_acc) / len(task_acc), "task_acc": task_acc})
    report = {"run": str(run_dir), "method": config.method, "label": config.name, "seed": config.seed,
              "experiment": config.experiment, "model": config.model, "eval_split": config.eval_split,
              "attack": "fgsm", "eps_space": eps_space, "test_samples": int(data.test_labels.shape[0]),
              **provenance, "results": results}
    save_result(run_dir / "eval.json", report)
    return report
