"""fp16 gradient scaling: a loss scale multiplies every backward's cotangents and is divided back out."""

from __future__ import annotations

import pytest
import torch

from drmoo.optim import available, create


@pytest.mark.parametrize("method", sorted(available()))
def test_a_power_of_two_loss_scale_changes_nothing_but_the_heads_scale(toy, method: str) -> None:
    runs = []
    for scale in (1.0, 1024.0):
        problem = toy()
        torch.manual_seed(0)
        optimizer = create(method, problem.shared, 3, lr=0.05, backend="reference")
        optimizer.loss_scale = scale
        draw = problem.batches(4)
        last: list[torch.Tensor] = []

        def closure(same_batch: bool = False, draw=draw, last=last, problem=problem) -> torch.Tensor:
            if not same_batch:
                last[:] = [draw()]
            return problem.losses(last[0])

        head_grads = []
        for _ in range(3):
            problem.H.grad = None
            optimizer.step(closure)
            head_grads.append(problem.H.grad.clone() / scale)  # the heads get scaled gradients
            with torch.no_grad():
                problem.H -= 0.01 * head_grads[-1]
        runs.append([*problem.snapshot(), optimizer.w.clone(), optimizer.eta.clone(), *head_grads])
    for plain, scaled in zip(*runs):
        # powers of two scale exactly; the only differences are the order of a few roundings
        torch.testing.assert_close(scaled, plain, rtol=1e-12, atol=1e-14)
