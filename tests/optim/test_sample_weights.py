"""Importance weights returned by the closure enter the dual objective of every method."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from drmoo.optim import available, create


def closure_for(problem, seed: int, weighted: bool) -> Callable[..., object]:
    """Weighted: the batch twice, weights 2 on the first copy and 0 on the second (same mean as the batch)."""
    draw = problem.batches(seed)
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> object:
        if not same_batch:
            last[:] = [draw()]
        losses = problem.losses(last[0])
        if not weighted:
            return losses
        doubled = torch.cat([losses, losses])
        weights = torch.cat([torch.full_like(losses, 2.0), torch.zeros_like(losses)]).detach()
        return doubled, weights

    return closure


@pytest.mark.parametrize("method", sorted(available()))
def test_weights_two_and_zero_on_a_doubled_batch_equal_the_batch(toy, method: str) -> None:
    runs = []
    for weighted in (False, True):
        problem = toy()
        torch.manual_seed(0)  # Double-Loop seeds its index generator from the global one
        optimizer = create(method, problem.shared, 3, lr=0.05, backend="reference")
        closure = closure_for(problem, 4, weighted)
        for _ in range(4):
            optimizer.step(closure)
        runs.append(problem.snapshot()[:2] + [optimizer.w.clone(), optimizer.eta.clone()])
    for plain, weighted in zip(*runs):
        torch.testing.assert_close(weighted, plain, rtol=1e-9, atol=1e-11)


def test_bad_weights_are_rejected(toy) -> None:
    problem = toy()
    optimizer = create("double-clip", problem.shared, 3)
    rows = torch.arange(8)
    for weights, message in ((torch.ones(8, 2), "must match the losses"), (-torch.ones(8, 3), "negative"),
                             (torch.full((8, 3), float("nan")), "NaN"), ("heavy", "must match the losses")):
        with pytest.raises(ValueError, match=message):
            optimizer.step(lambda weights=weights: (problem.losses(rows), weights))
    assert optimizer.steps_taken == 0
