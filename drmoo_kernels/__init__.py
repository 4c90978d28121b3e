"""drmoo_kernels: the numerical core of drmoo, independent of models and data.

* :mod:`~drmoo_kernels.divergences` - f*, f*' (and f) of every supported f-divergence;
* :mod:`~drmoo_kernels.reference`   - the pure-torch reference of every op (the contract);
* :mod:`~drmoo_kernels.dispatch`    - backend selection (reference, cpp, cuda, triton).
"""

from . import reference
from .dispatch import BACKENDS, available_backends, backend_module, resolve_backend, why_unavailable
from .divergences import DIVERGENCE_NAMES, Divergence, get_divergence
from .reference import project_simplex

__all__ = [
    "BACKENDS",
    "DIVERGENCE_NAMES",
    "Divergence",
    "available_backends",
    "backend_module",
    "get_divergence",
    "project_simplex",
    "reference",
    "resolve_backend",
    "why_unavailable",
]
__version__ = "0.1.0"
