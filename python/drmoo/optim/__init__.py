"""drmoo optimizers: drop-in ``torch.optim``-style multi-objective optimizers on the DR dual.

One file per method.  ``available()`` maps the registry names to classes; ``create(name, params,
num_tasks, **overrides)`` builds one by name.
"""

from __future__ import annotations

from typing import Any

from ._base import MultiObjectiveOptimizer, NonFiniteStepError, ParamsT
from .double_clip import DoubleClipMGDA
from .double_loop import DoubleLoopMGDA
from .famo import FAMO
from .mgda import MGDA
from .moco import MoCo
from .modo import MoDo
from .nashmtl import NashMTL
from .sdmgrad import SDMGrad

__all__ = [
    "FAMO",
    "MGDA",
    "DoubleClipMGDA",
    "DoubleLoopMGDA",
    "MoCo",
    "MoDo",
    "MultiObjectiveOptimizer",
    "NashMTL",
    "NonFiniteStepError",
    "SDMGrad",
    "available",
    "create",
]

_REGISTRY: dict[str, type[MultiObjectiveOptimizer]] = {
    "double-clip": DoubleClipMGDA,
    "double-loop": DoubleLoopMGDA,
    "mgda": MGDA,
    "modo": MoDo,
    "moco": MoCo,
    "sdmgrad": SDMGrad,
    "nashmtl": NashMTL,
    "famo": FAMO,
}


def available() -> dict[str, type[MultiObjectiveOptimizer]]:
    """``{registry name: optimizer class}`` for every method drmoo implements."""
    return dict(_REGISTRY)


def create(name: str, params: ParamsT, num_tasks: int, **overrides: Any) -> MultiObjectiveOptimizer:
    """Build the optimizer registered as ``name`` (see :func:`available`)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid choices: {', '.join(_REGISTRY)}") from None
    return cls(params, num_tasks, **overrides)
