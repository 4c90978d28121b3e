"""drmoo.dual_objective: input checks and the worst-case weights."""

from __future__ import annotations

import pytest
import torch

from drmoo import dual_objective, worst_case_weights


@pytest.mark.parametrize(
    ("losses", "eta", "kwargs", "message"),
    [
        (torch.rand(5), torch.zeros(1), {}, r"shape \[B, m\]"),
        (torch.rand(5, 3), torch.zeros(2), {}, r"eta must have shape \[m\] = \[3\]"),
        (torch.rand(0, 3), torch.zeros(3), {}, "empty batch"),
        (torch.rand(4, 2), torch.zeros(2), {"lam": 0.0}, "lam.*must be finite and > 0"),
        (torch.rand(4, 2), torch.zeros(2), {"lam": -0.5}, "lam.*must be finite and > 0"),
        (torch.rand(4, 2), torch.zeros(2), {"scale": 0.0}, "scale"),
        (torch.rand(4, 2), torch.zeros(2), {"divergence": "tv"}, "unknown divergence"),
        (torch.rand(4, 2), torch.zeros(2), {"sample_weight": torch.ones(4, 3)}, "sample_weight must have the shape"),
        (torch.tensor([[1.0, float("nan")]]), torch.zeros(2), {}, "NaN or Inf"),
        (torch.tensor([[1.0, float("inf")]]), torch.zeros(2), {}, "NaN or Inf"),
    ],
)
def test_bad_input_is_named(losses: torch.Tensor, eta: torch.Tensor, kwargs: dict, message: str) -> None:
    arguments = {"lam": 0.6, **kwargs}
    with pytest.raises(ValueError, match=message):
        dual_objective(losses, eta, **arguments)


def test_integer_losses_are_rejected() -> None:
    with pytest.raises(TypeError, match="floating point"):
        dual_objective(torch.ones(3, 2, dtype=torch.long), torch.zeros(2), 0.6)


def test_importance_weights_scale_the_expectation() -> None:
    losses = torch.tensor([[1.0], [3.0]], dtype=torch.float64)
    eta = torch.tensor([0.5], dtype=torch.float64)
    weighted = dual_objective(losses, eta, 0.6, "kl", sample_weight=torch.tensor([[2.0], [0.0]], dtype=torch.float64))
    only_first = dual_objective(losses[:1], eta, 0.6, "kl")
    # omega = (2, 0) averages to the first sample's term alone
    torch.testing.assert_close(weighted, only_first)


def test_worst_case_weights_average_to_one_at_the_optimal_eta() -> None:
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(500, 2, generator=gen, dtype=torch.float64)
    eta = 0.6 * torch.log(torch.exp(losses / 0.6).mean(0))  # KL's optimal eta
    weights = worst_case_weights(losses, eta, 0.6, "kl")
    torch.testing.assert_close(weights.mean(0), torch.ones(2, dtype=torch.float64))
    # larger losses get larger weight
    order = losses[:, 0].argsort()
    assert bool((weights[order, 0].diff() >= 0).all())


def test_half_precision_losses_get_float32_math_and_gradients_in_their_dtype() -> None:
    losses = torch.rand(16, 3).to(torch.bfloat16).requires_grad_()
    eta = torch.zeros(3, requires_grad=True)
    objective = dual_objective(losses, eta, 0.6)
    assert objective.dtype == torch.float32
    objective.sum().backward()
    assert losses.grad.dtype == torch.bfloat16 and eta.grad.dtype == torch.float32
