"""The paper's reported numbers, for the side-by-side tables of ``drmoo compare`` and ``drmoo report``.

Transcribed from the paper's LaTeX source (the copy this project works from is
/work/shared/paper/000_5d56ab1801ccc9df.txt; the line numbers below refer to it):

* Table 1, "Test Accuracy under FGSM attack" (§5.1, label ``Table: Multi-mnist FGSM``, lines
  463-509): test accuracy (%) of each method on Multi-MNIST 2 digits (70 epochs) and 3 digits
  (100 epochs) at FGSM eps = 0, 0.01, 0.03, 0.05, 0.08.  The paper reports one number per cell
  (no seeds, no spread).
* Table 2, "Test Performance against Label Imbalance" (§5.2, label ``table:accuracy-celeba``,
  lines 519-538): averaged accuracy, balanced accuracy and AUC (%) on CelebA, 8 attributes.

Method names map to drmoo's registry names: "Double-Clip MGDA" -> double-clip, "Double-loop MGDA"
-> double-loop, and the baselines by their own names.  A test checks every number against the
paper's text, so a typo here fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PAPER_FILE", "REFERENCES", "Reference", "reference_for"]

PAPER_FILE = "/work/shared/paper/000_5d56ab1801ccc9df.txt"

PAPER_NAMES = {
    "double-clip": "Double-Clip MGDA", "double-loop": "Double-loop MGDA", "moco": "MoCo", "nashmtl": "NashMTL",
    "famo": "FAMO", "sdmgrad": "SDMGrad", "modo": "MoDo", "mgda": "MGDA",
}


@dataclass(frozen=True)
class Reference:
    """One block of a paper table: a value (%) per method and column."""

    experiment: str
    title: str
    source: str
    columns: tuple[Any, ...]  # FGSM eps (float) or a metric key of drmoo's reports (str)
    labels: tuple[str, ...]
    values: dict[str, tuple[float, ...]]  # drmoo method name -> one value per column

    def column_index(self, key: Any) -> int | None:
        """Where ``key`` (an eps or a metric key) sits among the columns; None when the paper has no such column."""
        for index, column in enumerate(self.columns):
            if isinstance(column, float) and isinstance(key, (int, float)) and not isinstance(key, bool):
                if math.isclose(column, float(key), rel_tol=0.0, abs_tol=1e-9):
                    return index
            elif column == key:
                return index
        return None

    def value(self, method: str, key: Any) -> float | None:
        index = self.column_index(key)
        row = self.values.get(method)
        return None if index is None or row is None else row[index]


_FGSM_EPS = (0.0, 0.01, 0.03, 0.05, 0.08)
_FGSM_LABELS = ("Clean", "0.01", "0.03", "0.05", "0.08")

REFERENCES: dict[str, Reference] = {
    "multimnist2": Reference(
        experiment="multimnist2",
        title="paper Table 1, Multi-MNIST 2 digits (70 epochs, ImageNet ResNet18, 128 px)",
        source="Table 1 'Test Accuracy under FGSM attack', left block (paper lines 477-507)",
        columns=_FGSM_EPS, labels=_FGSM_LABELS,
        values={
            "double-clip": (95.66, 83.48, 65.95, 60.40, 57.13),
            "double-loop": (92.80, 72.81, 57.71, 54.49, 51.63),
            "moco": (94.49, 77.69, 61.74, 58.63, 56.43),
            "nashmtl": (91.21, 62.58, 51.67, 49.54, 47.09),
            "famo": (89.05, 61.04, 50.82, 48.66, 46.48),
            "sdmgrad": (89.59, 64.02, 52.00, 49.91, 47.31),
            "modo": (91.10, 64.08, 51.95, 49.73, 47.49),
            "mgda": (89.44, 62.61, 52.19, 50.81, 48.30),
        },
    ),
    "multimnist3": Reference(
        experiment="multimnist3",
        title="paper Table 1, Multi-MNIST 3 digits (100 epochs, ImageNet ResNet18, 96 px)",
        source="Table 1 'Test Accuracy under FGSM attack', right block (paper lines 477-507)",
        columns=_FGSM_EPS, labels=_FGSM_LABELS,
        values={
            "double-clip": (98.76, 97.59, 94.40, 91.05, 86.65),
            "double-loop": (97.49, 95.38, 89.99, 85.25, 79.88),
            "moco": (98.27, 96.62, 92.75, 88.75, 83.43),
            "nashmtl": (96.17, 92.31, 84.53, 78.91, 73.48),
            "famo": (95.90, 91.86, 84.29, 78.94, 73.52),
            "sdmgrad": (96.46, 92.89, 85.06, 79.37, 73.50),
            "modo": (96.50, 93.15, 86.03, 80.56, 74.81),
            "mgda": (96.34, 92.85, 85.42, 80.26, 75.18),
        },
    ),
    "celeba": Reference(
        experiment="celeba",
        title="paper Table 2, CelebA 8 attributes (100 epochs, ImageNet ResNet18, 128 px)",
        source="Table 2 'Test Performance against Label Imbalance' (paper lines 529-536)",
        columns=("mean_accuracy", "mean_balanced_accuracy", "mean_auc"),
        labels=("Averaged Accuracy", "Balanced Accuracy", "AUC"),
        values={
            "double-clip": (88.41, 89.55, 94.63),
            "double-loop": (86.61, 87.97, 93.28),
            "moco": (87.27, 88.50, 93.31),
            "nashmtl": (85.58, 87.00, 92.41),
            "famo": (85.32, 86.03, 91.41),
            "sdmgrad": (85.89, 87.06, 92.45),
            "modo": (85.66, 87.08, 92.42),
            "mgda": (85.53, 86.87, 92.58),
        },
    ),
}


def reference_for(experiment: str) -> Reference | None:
    """The paper's numbers for ``experiment`` (None for one the paper does not report, e.g. the synthetic ones)."""
    return REFERENCES.get(experiment)
