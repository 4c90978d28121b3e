"""Training and evaluating the deep multi-task experiments, with checkpoints and exact resume.

A run directory holds:

* ``config.json`` - every setting of the run (the resolved preset, method hyperparameters, data);
* ``checkpoint.pt`` - model, both optimizers, data-stream and RNG states, step counters and the
  metrics so far; written atomically at the end of every epoch (before its evaluation), at
  ``--max-steps`` and on SIGINT/SIGTERM, so ``--resume RUN_DIR`` continues bit-identically;
* ``steps.csv`` (per iteration) and ``metrics.csv`` / ``metrics.json`` (per epoch, strict JSON);
* ``eval.json`` after ``drmoo eval``; ``done`` marks a finished training run;
* ``train.lock`` - held (``flock``) by the one process training in the directory.

Checkpoints are trusted only after checks (:func:`read_checkpoint`): the file is a one-line JSON
header (the run's config, the payload's size and SHA-256) followed by the ``torch.save`` payload.
Loading verifies the size, the hash and that the config agrees with ``config.json`` *before*
unpickling, and unpickles with ``weights_only=True`` (tensors and plain containers only), so a
crafted or damaged file is refused with one line and never runs code.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
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

from .reporting import training_progress

__all__ = ["CheckpointError", "IndexStream", "RunConfig", "RunLockedError", "TrainingInterrupted", "UsageError",
           "config_differences", "evaluate_robustness", "load_trained", "read_checkpoint", "read_run_config",
           "resolve_device", "run_lock", "train", "write_json"]

CHECKPOINT = "checkpoint.pt"
LOCK_FILE = "train.lock"
CHECKPOINT_MAGIC = b"DRMOO-CHECKPOINT 1\n"  # then one line of JSON header, then the torch.save payload
MAX_HEADER_BYTES = 1 << 20
# The settings a resume may change: how far the run goes.  Every other field defines the run.
RESUMABLE_FIELDS = ("epochs", "max_steps")
MODELS = ("resnet18", "lenet")
EVAL_SPLITS = ("test", "validation")
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_SCALE_INIT, GRAD_SCALE_BACKOFF, GRAD_SCALE_GROWTH, GRAD_SCALE_GROWTH_INTERVAL = 2.0**16, 0.5, 2.0, 2000


class TrainingInterrupted(RuntimeError):
    """Raised after a SIGINT/SIGTERM once the checkpoint is safely on disk."""


class UsageError(ValueError):
    """A setting or a file the user handed in is refused; the message is one line naming the problem.

    The command line prints it without a traceback and exits with status 2.
    """


class CheckpointError(UsageError):
    """A checkpoint that is corrupt, truncated, crafted or from another run: refused, never unpickled freely."""


class RunLockedError(UsageError):
    """Another process is training in the run directory."""


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
    def from_json(cls, text: str) -> RunConfig:
        values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError("expected a JSON object")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
        return cls(**values)

    def validate(self) -> None:
        """Refuse settings that cannot define a run (counts below 1, a non-finite rate, ...)."""
        for name in ("epochs", "batch_size", "input_size", "train_size", "test_size", "max_steps"):
            value = getattr(self, name)
            if value is None and name in ("train_size", "test_size", "max_steps"):
                continue  # None: all of the split / no step limit
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"--seed must be an integer >= 0, got {self.seed!r}")
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
    path = run_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory of drmoo train?")
    try:
        return RunConfig.from_json(path.read_text())
    except (ValueError, TypeError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise UsageError(f"{path} is not a drmoo run config ({error})") from None


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


def prepare_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and its parents) or refuse with one line: a file in the way, no permission."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"{run_dir} is a file, not a directory: pick another --out")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent that is a file, a read-only or forbidden place
        raise UsageError(f"cannot create the run directory {run_dir}: {error.strerror or error}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write in the run directory {run_dir}: permission denied")


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir/train.lock`` (an exclusive ``flock``) or refuse at once: one trainer per directory.

    The lock goes with the process (closing the descriptor, or dying, releases it), so a crashed run
    never leaves the directory locked.  The file itself stays: removing it would let two processes
    lock two different files of the same name.
    """
    path = run_dir / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise UsageError(f"cannot write in the run directory {run_dir}: {error.strerror or error}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        holder = path.read_text(errors="replace").strip() or "?"
        raise RunLockedError(
            f"{run_dir} is in use by another drmoo process (pid {holder}, holding {path}); wait for it to "
            "finish or pick another --out"
        ) from None
    try:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(descriptor)


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


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # makes the rename itself durable
    finally:
        os.close(descriptor)


def atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    """Write ``path`` all or nothing: a per-process temporary file, fsynced, renamed over it, directory fsynced.

    A crash leaves either the old file or the new one, never a mix; two processes never share a
    temporary file (its name carries the pid).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, [text.getvalue().encode()])


def _finite_or_none(value: Any) -> Any:
    """``value`` with every NaN / infinity replaced by None (JSON has no token for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def write_json(path: Path, value: Any) -> None:
    """Strict JSON, written atomically: a non-finite number becomes null, never the ``NaN`` token."""
    text = json.dumps(_finite_or_none(value), indent=2, allow_nan=False)
    atomic_write(path, [text.encode(), b"\n"])


def write_checkpoint(path: Path, state: dict[str, Any], config: RunConfig) -> None:
    """``state`` behind a header with the run's config and the payload's size and SHA-256 (atomic)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = json.dumps({"format": 1, "config": asdict(config), "payload_bytes": len(payload),
                         "payload_sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True)
    atomic_write(path, [CHECKPOINT_MAGIC, header.encode(), b"\n", payload])


def read_checkpoint(run_dir: Path, config: RunConfig | None = None) -> dict[str, Any]:
    """The state in ``run_dir``'s checkpoint, after checking it belongs to the run and is intact.

    Refused (:class:`CheckpointError`, one line) unless, in this order: the file starts with drmoo's
    header; the payload has the announced size (not truncated) and SHA-256 (not corrupt); the header's
    config agrees with ``config`` (default: ``run_dir/config.json``) on every setting but
    ``RESUMABLE_FIELDS``; and the payload unpickles with ``weights_only=True`` (tensors and plain
    containers only: nothing in it can run code).  Nothing is unpickled before the hash matches.
    """
    path = run_dir / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train the run first")
    expected = config if config is not None else read_run_config(run_dir)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: refused: cannot be read ({error.strerror or error})") from None
    if not data.startswith(CHECKPOINT_MAGIC):
        raise CheckpointError(f"{path}: refused: not a drmoo checkpoint (no drmoo header: corrupt, or written by "
                              "something else or an older drmoo)")
    start = len(CHECKPOINT_MAGIC)
    end = data.find(b"\n", start, start + MAX_HEADER_BYTES)
    try:
        if end < 0:
            raise ValueError("no end of header")
        header = json.loads(data[start:end])
        size, digest, saved_config = int(header["payload_bytes"]), str(header["payload_sha256"]), header["config"]
        if not isinstance(saved_config, dict):
            raise TypeError("config is not a mapping")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated") from None
    payload = memoryview(data)[end + 1:]
    if len(payload) != size:
        raise CheckpointError(f"{path}: refused: truncated or extended: holds {len(payload)} payload bytes, its "
                              f"header announces {size}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: refused: the payload's SHA-256 differs from the one recorded in its header "
                              "(the file is corrupt)")
    differences = config_differences(saved_config, expected)
    if differences:
        raise CheckpointError(f"{path}: refused: it belongs to a run with other settings than "
                              f"{run_dir / 'config.json'} ({'; '.join(differences)})")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as error:  # untrusted bytes: any failure to parse them refuses the file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: refused: its payload holds more than tensors and plain containers "
                              f"or is malformed ({reason[:200]})") from None
    if not isinstance(state, dict) or state.get("config") != saved_config:
        raise CheckpointError(f"{path}: refused: its payload does not match its header")
    return state


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
    created_group, device = _setup_distributed(config)
    is_main = distributed.rank() == 0  # only rank 0 writes checkpoints, logs and progress
    if is_main:
        prepare_run_dir(run_dir)
    try:
        with run_lock(run_dir) if is_main else nullcontext():
            return _train_locked(config, run_dir, build, device, is_main, resume, progress, sample_weight)
    finally:
        if created_group:
            torch.distributed.destroy_process_group()


def _train_locked(
    config: RunConfig, run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], device: torch.device,
    is_main: bool, resume: bool, progress: bool, sample_weight: Callable[[Tensor], Tensor] | None,
) -> dict[str, Any]:
    checkpoint_path = run_dir / CHECKPOINT
    state: dict[str, Any] | None = None
    if resume:
        if not checkpoint_path.is_file():
            raise FileNotFoundError(f"cannot resume: {checkpoint_path} does not exist")
        state = read_checkpoint(run_dir, config)  # verified before anything is written
    elif checkpoint_path.exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it or pick a new --out"
        )
    if is_main:
        (run_dir / "done").unlink(missing_ok=True)  # a marker, not work: written again when this run finishes
        atomic_write(run_dir / "config.json", [config.to_json().encode()])

    torch.manual_seed(config.seed)
    model, data = build(config)
    model.to(device)
    shared = model.shared_parameters()
    optimizer = create(config.method, shared, data.num_tasks, backend=config.backend,  # fp16 scaling needs the raise
                       **{"capturable": device.type == "cuda" and config.amp != "fp16", **config.hparams})
    optimizer.jacobian_strategy = config.jacobian
    heads = torch.optim.SGD(model.task_parameters(), lr=config.head_lr)
    stream = IndexStream(data.train_labels.shape[0], config.batch_size, seed=config.seed)
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
        except (KeyError, TypeError, ValueError, RuntimeError) as error:  # a hash-valid file with a wrong state
            raise CheckpointError(f"{checkpoint_path}: refused: its state does not fit this run "
                                  f"({str(error).strip().splitlines()[0] if str(error).strip() else error!r})"
                                  ) from None
        if step > total:
            raise UsageError(f"cannot resume {run_dir} to {total} steps: it has trained {step} already; a resume "
                             "can only extend a run (--epochs / --max-steps)")

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
        _write_csv(run_dir / "steps.csv", step_rows)
        _write_csv(run_dir / "metrics.csv", epoch_rows)
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


def load_trained(run_dir: Path, build: Callable[[RunConfig], tuple[nn.Module, Any]], device: str | None = None
                 ) -> tuple[RunConfig, nn.Module, Any, torch.device]:
    """A trained run's config, model (weights loaded, on ``device`` or the run's), data and that device."""
    config = read_run_config(run_dir)
    state = read_checkpoint(run_dir, config)  # verified (size, SHA-256, config) and never unpickled freely
    target = resolve_device(device or config.device)
    model, data = build(config)
    try:
        model.load_state_dict(state["model"])
    except (KeyError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"{run_dir / CHECKPOINT}: refused: its model does not fit the run's "
                              f"({str(error).strip().splitlines()[0] if str(error).strip() else error!r})") from None
    model.to(target)
    return config, model, data, target


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

    eval.json also records the eps space and the training budget spent (iterations, samples drawn).
    """
    eps_values = check_eps(eps_values)
    config, model, data, target = load_trained(run_dir, build, device)
    results = []
    for eps in tqdm(eps_values, desc="FGSM", disable=not progress):
        task_acc = accuracy(model, data.test_images, data.test_labels, 2 * config.batch_size, target, data.images, eps,
                            eps_space)
        results.append({"eps": eps, "mean_acc": sum(task_acc) / len(task_acc), "task_acc": task_acc})
    report = {"run": str(run_dir), "method": config.method, "label": config.name, "seed": config.seed,
              "experiment": config.experiment, "model": config.model, "eval_split": config.eval_split,
              "attack": "fgsm", "eps_space": eps_space, "test_samples": int(data.test_labels.shape[0]),
              **training_progress(run_dir), "results": results}
    write_json(run_dir / "eval.json", report)
    return report
