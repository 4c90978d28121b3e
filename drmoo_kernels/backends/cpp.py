"""The ``cpp`` backend: the compiled CPU kernels of csrc/cpu.

torch's ``parallel_for`` over fixed-size column/row tasks (so results do not depend on the thread
count), float32 math (float64 for float64 inputs) with float64 accumulation across tasks.

Same signatures, return values and in-place semantics as :mod:`drmoo_kernels.reference`; the
extension ``drmoo_kernels._C`` (built on torch's stable ABI: one build serves every torch >= 2.11)
is imported on first use (see :mod:`drmoo_kernels._ops`).
Differences: the parameters must have J's dtype, and J given as a list of blocks is concatenated
(one copy) before the kernels run.
"""

from __future__ import annotations

from .._ops import CompiledBackend

__all__ = ["availability", "combine", "dual_forward", "dual_step", "gram", "gram_step", "sum_squares"]

_OPS = CompiledBackend("cpu")
availability = _OPS.availability
dual_forward = _OPS.dual_forward
dual_step = _OPS.dual_step
gram = _OPS.gram
combine = _OPS.combine
gram_step = _OPS.gram_step
sum_squares = _OPS.sum_squares
