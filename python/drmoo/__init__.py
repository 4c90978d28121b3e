"""drmoo: distributionally robust multi-objective optimization for PyTorch.

* :func:`dual_objective` - the f-divergence DR dual of each task (differentiable);
* :mod:`drmoo.optim` - Double-Clip MGDA, Double-Loop MGDA (and the baselines) as torch optimizers;
* :mod:`drmoo.experiments` - the paper's experiments; ``drmoo`` on the command line runs them.
"""

# drmoo_kernels is imported first: it refuses an unsupported torch (ImportError) before anything runs.
from drmoo_kernels import DIVERGENCE_NAMES, Divergence, get_divergence, project_simplex

from . import optim
from .objective import dual_objective, worst_case_weights

__all__ = [
    "DIVERGENCE_NAMES",
    "Divergence",
    "dual_objective",
    "get_divergence",
    "optim",
    "project_simplex",
    "worst_case_weights",
]
__version__ = "0.1.0"
