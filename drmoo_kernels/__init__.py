"""drmoo_kernels: the numerical core of drmoo, independent of models and data.

* :mod:`~drmoo_kernels.divergences` - ``f*``, ``f*'`` (and ``f``) of every supported f-divergence;
* :mod:`~drmoo_kernels.reference`   - the pure-torch reference of every op (the contract);
* :mod:`~drmoo_kernels.dispatch`    - backend selection (reference, cpp, cuda, triton).
"""

# First, before anything else touches torch: an unsupported torch is an ImportError, not a wrong result.
from ._compat import check_torch_version

check_torch_version()

from . import reference  # noqa: E402
from ._warnings import KernelsUnavailableWarning  # noqa: E402
from .dispatch import BACKENDS, available_backends, backend_module, resolve_backend, why_unavailable  # noqa: E402
from .divergences import DIVERGENCE_NAMES, Divergence, get_divergence  # noqa: E402
from .reference import project_simplex  # noqa: E402

__all__ = [
    "BACKENDS",
    "DIVERGENCE_NAMES",
    "Divergence",
    "KernelsUnavailableWarning",
    "available_backends",
    "backend_module",
    "get_divergence",
    "project_simplex",
    "reference",
    "resolve_backend",
    "why_unavailable",
]
