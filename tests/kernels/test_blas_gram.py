"""The cpp backend's gram at many tasks: the BLAS product in row blocks (drmoo_kernels._blas_gram).

Same contract as the kernel it replaces there: J J^T in J's dtype (float64 for float64 J) within the any-order
error bound of an n-term dot product, exactly symmetric, the same bits on every call with the same thread count.
"""

from __future__ import annotations

import pytest
import torch

from drmoo_kernels import backend_module, why_unavailable
from drmoo_kernels._blas_gram import BLAS_MIN_TASKS, blas_gram

from .error_bounds import assert_within, gram_error_bound

pytestmark = pytest.mark.skipif(why_unavailable("cpp") is not None, reason="the cpp backend is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tasks", [BLAS_MIN_TASKS, 300])  # one row block, and several (the mirrored triangle)
def test_many_task_gram_is_exact_to_rounding_and_symmetric(tasks: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(tasks)
    J = (torch.randn(tasks, 1_000, generator=gen, dtype=torch.float64)
         * 10 ** torch.empty(tasks, 1, dtype=torch.float64).uniform_(-3, 3, generator=gen)).to(dtype)
    got = backend_module("cpp").gram(J)
    assert got.dtype == dtype and got.shape == (tasks, tasks)
    assert torch.equal(got, got.T)
    exact = J.double() @ J.double().T
    assert_within(got.double(), exact, gram_error_bound(J), "gram")


def test_many_task_gram_repeats_bit_for_bit() -> None:
    """Same inputs, same thread count: the same bits (``drmoo train --resume`` relies on it).  Across thread counts
    BLAS promises nothing (its threads may split the dot products), unlike the kernel below BLAS_MIN_TASKS."""
    J = torch.randn(200, 3_000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(blas_gram(J), blas_gram(J.clone()))
