"""The ``cuda`` backend: the compiled CUDA kernels of csrc/cuda.

Launched on the current stream with no host synchronisation: the m x m part of gram_step runs
in a one-block kernel, and the update pass skips its writes when the device-side finiteness flag
of the Gram is false.

Same signatures, return values and in-place semantics as :mod:`drmoo_kernels.reference`; the
extensions ``drmoo_kernels._C`` (the schemas) and ``drmoo_kernels._C_cuda`` (these kernels, on torch's
stable ABI like ``_C``) are imported on first use (see :mod:`drmoo_kernels._ops`).
Differences: the parameters must have J's dtype, and J given as a list of blocks is concatenated
(one copy) before the kernels run.  ``sum_squares`` has no CUDA kernel: it is the reference's (drmoo's
own NaN/Inf guard of a list of gradients calls ``torch._foreach_norm`` on a GPU, already one fused
launch; the compiled op exists for the CPU, where that one is a loop of per-tensor norms).
"""

from __future__ import annotations

from .. import reference
from .._ops import CompiledBackend

__all__ = ["availability", "combine", "dual_forward", "dual_step", "gram", "gram_step", "sum_squares"]

_OPS = CompiledBackend("cuda")
availability = _OPS.availability
dual_forward = _OPS.dual_forward
dual_step = _OPS.dual_step
gram = _OPS.gram
combine = _OPS.combine
gram_step = _OPS.gram_step
sum_squares = reference.sum_squares
