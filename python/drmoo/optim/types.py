"""The types the optimizers' signatures use: what they take as parameters and as a closure."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

__all__ = ["Closure", "ParamsT"]

Closure = Callable[[], Tensor | tuple[Tensor, ...]]
"""A step's closure: it draws a fresh batch and returns its per-sample losses ``[B, m]`` (with their
graph) or ``(losses, sample_weight)``; with ``jacobian="features"`` ``(losses, z)`` or
``(losses, z, sample_weight)`` (the closure protocol of :mod:`drmoo.optim`)."""

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]
"""The shared parameters, as torch optimizers take them: an iterable of tensors or of parameter groups
(dicts with ``"params"``)."""
