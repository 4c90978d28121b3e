"""drmoo: distributionally robust multi-objective optimization for PyTorch.

* :func:`dual_objective` - the f-divergence DR dual of each task (differentiable);
* :mod:`drmoo.optim` - Double-Clip MGDA, Double-Loop MGDA (and the baselines) as torch optimizers;
* :class:`Balancer` - any of those methods writing its direction into ``.grad``, for any torch optimizer
  (:data:`MethodName` its method names, :func:`method_name` one held in a ``str``);
* :mod:`drmoo.experiments` - the paper's experiments; ``drmoo`` on the command line runs them.

``import drmoo`` itself imports no torch: the names below are loaded on first use (PEP 562), so
that ``drmoo --version`` and ``drmoo --help`` answer at once.  The first use imports
:mod:`drmoo_kernels` first, which refuses an unsupported torch with an ImportError before anything runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from drmoo_kernels import DIVERGENCE_NAMES, Divergence, get_divergence, project_simplex

    from . import optim
    from ._grad_watch import GradientAccumulationWarning
    from .balancer import Balancer, LossesInput, MethodName, SharedParams, method_name
    from .objective import dual_objective, worst_case_weights

# public name -> the module that defines it (None: the name is that submodule itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "DIVERGENCE_NAMES": ("drmoo_kernels", "DIVERGENCE_NAMES"),
    "Divergence": ("drmoo_kernels", "Divergence"),
    "get_divergence": ("drmoo_kernels", "get_divergence"),
    "project_simplex": ("drmoo_kernels", "project_simplex"),
    "optim": ("drmoo.optim", None),
    "Balancer": ("drmoo.balancer", "Balancer"),
    "GradientAccumulationWarning": ("drmoo._grad_watch", "GradientAccumulationWarning"),
    "LossesInput": ("drmoo.balancer", "LossesInput"),
    "MethodName": ("drmoo.balancer", "MethodName"),
    "SharedParams": ("drmoo.balancer", "SharedParams"),
    "method_name": ("drmoo.balancer", "method_name"),
    "dual_objective": ("drmoo.objective", "dual_objective"),
    "worst_case_weights": ("drmoo.objective", "worst_case_weights"),
}

__all__ = [
    "DIVERGENCE_NAMES",
    "Balancer",
    "Divergence",
    "GradientAccumulationWarning",
    "LossesInput",
    "MethodName",
    "SharedParams",
    "__version__",
    "dual_objective",
    "get_divergence",
    "method_name",
    "optim",
    "project_simplex",
    "worst_case_weights",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'drmoo' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    importlib.import_module("drmoo_kernels")  # first: it refuses an unsupported torch
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
