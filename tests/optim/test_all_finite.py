"""The one-pass finiteness check of long vectors (FAMO's and Nash-MTL's combined gradient, MoDo's J_2^T w)."""

from __future__ import annotations

import pytest
import torch

from drmoo.optim._joint import all_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 7, 100_003])
def test_all_finite_is_isfinite_all(dtype: torch.dtype, size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    big = torch.finfo(dtype).max
    for bad in (None, float("nan"), float("inf"), float("-inf")):
        for position in {0, size // 2, size - 1}:
            x = (torch.randn(size, generator=gen) * 3).to(dtype)
            x[size // 3] = big  # finite extremes must not count as overflow
            x[(2 * size) // 3] = -big
            if bad is not None:
                x[position] = bad
            flag = all_finite(x)
            assert flag.dtype == torch.bool and flag.dim() == 0
            assert bool(flag) == bool(torch.isfinite(x).all()), (bad, position)
    assert bool(all_finite(torch.zeros(0)))  # nothing non-finite in an empty vector, as isfinite(x).all()
