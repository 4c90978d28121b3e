"""Nash-MTL's weights for two tasks in closed form: the same alpha as the damped Newton iterations, exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drmoo.optim.nashmtl import NASH_RIDGE, _damped_newton, nash_weights


def _newton_alpha(gram: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """What nash_weights computed for m = 2 before the closed form: the iterations on the scaled K."""
    K = gram.double()
    d = torch.sqrt(torch.diagonal(K))
    scaled = K / d[:, None] / d[None, :] + NASH_RIDGE * torch.eye(2, dtype=torch.float64)
    return _damped_newton(scaled, iters) / d


@pytest.mark.parametrize("correlation", [-0.999, -0.7, -0.1, 0.0, 0.3, 0.9, 0.999999])
@pytest.mark.parametrize("norms", [(1.0, 1.0), (1e-3, 5.0), (1e4, 2e-2)])
def test_two_tasks_closed_form_equals_the_newton_iterations(correlation: float, norms: tuple[float, float]) -> None:
    n1, n2 = norms
    K = torch.tensor([[n1 * n1, correlation * n1 * n2], [correlation * n1 * n2, n2 * n2]], dtype=torch.float64)
    alpha = nash_weights(K)
    torch.testing.assert_close(alpha, _newton_alpha(K), rtol=1e-10, atol=0.0)
    # and it solves the bargaining system alpha_i (K alpha)_i = 1 (with the ridge on the scaled K)
    ridged = K + NASH_RIDGE * torch.diag(torch.diagonal(K))
    torch.testing.assert_close(alpha * (ridged @ alpha), torch.ones(2, dtype=torch.float64), rtol=1e-12, atol=0.0)


def test_two_tasks_degenerate_cases() -> None:
    # opposite gradients: no solution without the ridge; with it a = 1/sqrt(ridge) on the scaled K
    g = torch.tensor([[1.0, 2.0], [-2.0, -4.0]], dtype=torch.float64)
    alpha = nash_weights(g @ g.T)
    norms = torch.linalg.vector_norm(g, dim=1)
    torch.testing.assert_close(alpha, 1.0 / (NASH_RIDGE**0.5 * norms), rtol=1e-3, atol=0.0)
    # a vanished task is left out (alpha = 0); the other gets 1/||g|| (up to the ridge)
    g = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    alpha = nash_weights(g @ g.T)
    assert float(alpha[1]) == 0.0
    torch.testing.assert_close(alpha[0], torch.tensor(0.2, dtype=torch.float64), rtol=1e-11, atol=0.0)
    assert torch.equal(nash_weights(torch.zeros(2, 2, dtype=torch.float64)), torch.zeros(2, dtype=torch.float64))
    # float32 Gram matrices are solved in float64, as for every m
    assert nash_weights(torch.eye(2)).dtype == torch.float64


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
        return func(*args, **(kwargs or {}))


def test_two_tasks_take_a_few_ops_and_no_host_read() -> None:
    K = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=torch.float64)
    with _CountOps() as two:
        nash_weights(K, iters=100)
    with _CountOps() as three:
        nash_weights(torch.eye(3, dtype=torch.float64) + 0.1, iters=100)
    assert two.host_reads == 0 and three.host_reads == 0
    assert two.ops < 40 < 100 * 10 < three.ops  # vs ~20 ops per Newton iteration for m >= 3
