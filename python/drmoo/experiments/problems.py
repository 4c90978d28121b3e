"""Small multi-task problems of the paper's Appendix E, as tensors plus a per-sample loss.

A :class:`Problem` holds the whole data set in memory, the shared parameters' initial values and
a function mapping (parameters, a batch of rows) to per-sample losses ``[B, m]`` - exactly what an
optimizer closure returns.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from drmoo.store import read_bytes

__all__ = ["WINE_FILE", "BatchStream", "Problem", "load_wine_table", "make_linear_problem", "make_wine_problem"]

LossFn = Callable[[list[Tensor], Tensor, Tensor], Tensor]


@dataclass
class Problem:
    """A multi-task data set with shared parameters.

    ``inputs`` [N, d] and ``targets`` [N, m]; ``initial_params`` are cloned into fresh leaves for
    every run; ``loss_fn(params, inputs_batch, targets_batch)`` returns per-sample losses [B, m].
    """

    name: str
    inputs: Tensor
    targets: Tensor
    initial_params: list[Tensor]
    loss_fn: LossFn
    description: str

    @property
    def num_tasks(self) -> int:
        return self.targets.shape[1]

    @property
    def num_samples(self) -> int:
        return self.inputs.shape[0]

    def fresh_params(self) -> list[Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.initial_params]


class BatchStream:
    """Independent uniform draws (with replacement) of batches of row indices, counting samples.

    Every call is a fresh draw from the data set - the "independent batches" the algorithms'
    analyses assume - from a dedicated, seedable generator.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.samples_drawn = 0

    def __call__(self) -> Tensor:
        self.samples_drawn += self.batch_size
        return torch.randint(0, self.num_samples, (self.batch_size,), generator=self.generator)


def _squared_error(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
    (theta,) = params
    return (inputs @ theta).unsqueeze(1).sub(targets).pow(2)


def make_linear_problem(
    seed: int, data_root: str | Path | None = None, num_samples: int = 6000, dim: int = 10
) -> Problem:
    """Multi-task linear regression of App. E.1 (m = 3, n = 10, 6000 samples, MSE).

    x ~ N(0, I); theta1* ~ N(0, I), theta2* ~ N(-0.2 theta1*, 0.04 I), theta3* ~ N(0.5 theta1*, 0.25 I);
    y^i = x^T theta_i* + eps^i with Var(eps) = 0.04, 0.36, 0.25.  One shared theta (start 0) is
    fitted to all three tasks, whose optima partly conflict.  Everything is drawn from ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, dim, generator=gen)
    theta1 = torch.randn(dim, generator=gen)
    theta2 = -0.2 * theta1 + 0.2 * torch.randn(dim, generator=gen)
    theta3 = 0.5 * theta1 + 0.5 * torch.randn(dim, generator=gen)
    optima = torch.stack([theta1, theta2, theta3], dim=1)  # [d, 3]
    noise_std = torch.tensor([0.04, 0.36, 0.25]).sqrt()
    targets = inputs @ optima + noise_std * torch.randn(num_samples, 3, generator=gen)
    return Problem(
        name="linear",
        inputs=inputs,
        targets=targets,
        initial_params=[torch.zeros(dim)],
        loss_fn=_squared_error,
        description=f"App. E.1 multi-task linear regression: m = 3, n = {dim}, {num_samples} samples, "
        f"squared error, theta_0 = 0, data seed {seed}",
    )


WINE_FILE = "winequality-white.csv"
WINE_COLUMNS = (
    "fixed acidity", "volatile acidity", "citric acid", "residual sugar", "chlorides", "free sulfur dioxide",
    "total sulfur dioxide", "density", "pH", "sulphates", "alcohol", "quality",
)
# (column, quantile) per task, App. E.2: quality / residual sugar / alcohol at 0.5 / 0.8 / 0.1.
WINE_TASKS = (("quality", 0.5), ("residual sugar", 0.8), ("alcohol", 0.1))


def _wine_path(data_root: str | Path) -> Path:
    path = Path(data_root).expanduser()
    if path.is_dir():
        path = path / WINE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"wine data not found: {path} does not exist; pass --data-root pointing to the UCI white-wine CSV "
            f"({WINE_FILE}) or the directory holding it"
        )
    return path


def load_wine_table(data_root: str | Path) -> tuple[list[str], Tensor]:
    """Read the UCI white-wine CSV (';' or ',' separated, header row) into (column names, [N, 12] float64).

    Raises ``ValueError`` naming the file, line and problem for a malformed file.
    """
    path = _wine_path(data_root)
    # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
    text = read_bytes(path, what="wine CSV").decode("utf-8-sig", errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: the file is empty")
    delimiter = ";" if lines[0].count(";") > lines[0].count(",") else ","
    reader = csv.reader(lines, delimiter=delimiter)
    header = [name.strip().strip('"') for name in next(reader)]
    missing = [c for c in WINE_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path}: line 1 (header) lacks the column(s) {missing}; found {header}")
    order = [header.index(c) for c in WINE_COLUMNS]
    rows = []
    for number, fields in enumerate(reader, start=2):
        if len(fields) != len(header):
            raise ValueError(f"{path}: line {number} has {len(fields)} fields, the header has {len(header)}")
        try:
            values = [float(fields[i]) for i in order]
        except ValueError:
            raise ValueError(f"{path}: line {number} has a non-numeric value: {fields}") from None
        if not all(v == v and abs(v) != float("inf") for v in values):
            raise ValueError(f"{path}: line {number} has a NaN or infinite value")
        rows.append(values)
    if len(rows) < 10:
        raise ValueError(f"{path}: only {len(rows)} data rows; the wine experiment needs the full table")
    return list(WINE_COLUMNS), torch.tensor(rows, dtype=torch.float64)


def _logistic(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
    weight, bias = params
    # inputs [B, m, d]: each task sees the table with its own label column zeroed (removed).
    logits = inputs @ weight + bias
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none")


def make_wine_problem(seed: int, data_root: str | Path | None = None) -> Problem:
    """Multi-task logistic regression on UCI white wine (App. E.2).

    Labels: y^i = 1(column_i >= its q_i-quantile) ("greater or equal", as in the paper's
    y = 1(y >= s)), for quality (q = 0.5), residual sugar (0.8) and alcohol (0.1).
    Inputs: all 12 columns standardized (z-scores), with task i's own label column removed -
    set to 0 in task i's copy of the input, so one shared weight vector (12) and bias serve all
    three tasks (n = 13, start 0).  Logistic (binary cross-entropy) loss.  The table itself is
    fixed; ``seed`` only matters through the batch draws.
    """
    if data_root is None:
        raise ValueError(f"the wine problem needs --data-root (the UCI white-wine CSV {WINE_FILE} or its directory)")
    columns, table = load_wine_table(data_root)
    del seed  # the data set is fixed; the runner seeds the batches
    standardized = (table - table.mean(0)) / table.std(0).clamp(min=1e-12)
    task_inputs, labels = [], []
    for name, quantile in WINE_TASKS:
        column = columns.index(name)
        threshold = torch.quantile(table[:, column], quantile)
        labels.append((table[:, column] >= threshold).to(torch.float32))
        masked = standardized.clone()
        masked[:, column] = 0.0
        task_inputs.append(masked.to(torch.float32))
    inputs = torch.stack(task_inputs, dim=1)  # [N, 3, 12]
    targets = torch.stack(labels, dim=1)  # [N, 3]
    rates = ", ".join(f"{name} {float(y.mean()):.2f}" for (name, _), y in zip(WINE_TASKS, labels))
    return Problem(
        name="wine",
        inputs=inputs,
        targets=targets,
        initial_params=[torch.zeros(len(columns)), torch.zeros(())],
        loss_fn=_logistic,
        description=f"App. E.2 UCI white wine ({table.shape[0]} rows), logistic regression, tasks thresholded "
        f"with >= at quantiles 0.5/0.8/0.1 (positive rates: {rates}); 12 standardized columns, each task's own "
        "label column removed (zeroed) from its inputs; shared weights and bias, start 0",
    )
