"""Training metrics handed to a logger as they are made: the :class:`MetricsCallback` protocol, and TensorBoard.

:func:`drmoo.experiments.training.train` takes ``on_log``, any callable ``on_log(step, metrics)``: the
process that writes the run (rank 0 under torchrun) calls it after every training step with that
step's row of ``steps.csv`` under ``train/`` (``train/dual_objective``, ``train/train_acc``,
``train/balanced_grad_norm``, ``train/step_s``, the task weights ``train/w_1``... and dual variables
``train/eta_1``...), and after every epoch's evaluation with its row of ``metrics.csv`` under
``epoch/`` (``epoch/test_acc``, ``epoch/test_acc_1``..., ``epoch/wall_time_s``...).  ``step`` is the
optimizer step the values belong to, counted over the whole run (a resumed run goes on from its
checkpoint's step).  A value that is not finite (an evaluation without a result) is passed as NaN.

:class:`TensorBoardLogger` is one such callable: it writes the values as scalars of a TensorBoard
event file, through ``torch.utils.tensorboard`` (``pip install 'drmoo[tensorboard]'``);
``drmoo train --log-dir DIR`` uses it.  Any other logger (Weights & Biases, MLflow, a CSV of one's own)
is a function or an object with that ``__call__``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from drmoo._extras import MissingExtraError

__all__ = ["TENSORBOARD_INSTALL", "MetricsCallback", "TensorBoardLogger", "require_tensorboard", "row_metrics"]

TENSORBOARD_INSTALL = "pip install 'drmoo[tensorboard]'"
# Columns of the steps.csv / metrics.csv rows that are the row's place, not a measurement: the step is
# on_log's first argument.
_POSITION = ("step", "epoch")


class MetricsCallback(Protocol):
    """What :func:`~drmoo.experiments.training.train` calls with each step's and each epoch's metrics."""

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log ``metrics`` (name -> value) at optimizer step ``step``."""


def row_metrics(row: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The numbers of a ``steps.csv`` / ``metrics.csv`` row under ``prefix`` (None: NaN), its position left out."""
    return {f"{prefix}{name}": float("nan") if value is None else float(value) for name, value in row.items()
            if name not in _POSITION and (value is None or (isinstance(value, (int, float))
                                                            and not isinstance(value, bool)))}


def require_tensorboard() -> None:
    """Raise :class:`~drmoo._extras.MissingExtraError` (one line, with the install line) unless the
    ``tensorboard`` package, which ``torch.utils.tensorboard`` writes with, can be imported."""
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        found = False
    if not found:
        raise MissingExtraError(f"TensorBoard logging needs the tensorboard package: {TENSORBOARD_INSTALL}")


class TensorBoardLogger:
    """A :class:`MetricsCallback` that writes each metric as a TensorBoard scalar in ``log_dir``.

    The event file is created on the first call, so a run refused before it starts leaves no
    ``log_dir`` behind.  Use it as a context manager, or call :meth:`close`, to flush the file.

    Raises:
        MissingExtraError: the ``tensorboard`` package is not installed (checked here, at construction).
    """

    def __init__(self, log_dir: str | Path) -> None:
        require_tensorboard()
        self.log_dir = Path(log_dir)
        self._writer: Any = None  # torch.utils.tensorboard.SummaryWriter, made on the first call

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        """Flush and close the event file (nothing to do when nothing was logged)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
