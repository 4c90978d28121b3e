"""The types the optimizers' signatures use: what they take as parameters and as a closure."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

__all__ = ["Closure", "Losses", "MicroBatch", "ParamsT"]

Losses = Tensor | tuple[Tensor, ...]
"""One batch as a closure returns it: its per-sample losses ``[B, m]`` (with their graph) or
``(losses, sample_weight)``; with ``jacobian="features"`` ``(losses, z)`` or ``(losses, z, sample_weight)``."""

MicroBatch = Losses | Callable[[], Losses]
"""One micro-batch of a closure that returns its batch in parts: its :data:`Losses`, or a zero-argument
callable that computes them when the optimizer asks for them (then the next micro-batch's forward pass
runs only once this one's backward passes are done: one micro-batch's graph is alive at a time)."""

Closure = Callable[[], Losses | Iterable[MicroBatch]]
"""A step's closure: it draws a fresh batch and returns its :data:`Losses` -- or an iterable of
:data:`MicroBatch` (a generator, say), the batch in parts, which the step takes as the one batch they
make together: exact gradient accumulation (the closure protocol of :mod:`drmoo.optim`)."""

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]
"""The shared parameters, as torch optimizers take them: an iterable of tensors or of parameter groups
(dicts with ``"params"``)."""
