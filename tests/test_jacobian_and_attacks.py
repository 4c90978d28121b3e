"""The Jacobian engine's strategies against per-task autograd, and FGSM on a hand-checkable model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from drmoo.attacks import fgsm
from drmoo.jacobian import task_jacobian


def small_net() -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh())
    heads = nn.ModuleList(nn.Linear(4, 1) for _ in range(3))
    model = nn.ModuleDict({"trunk": trunk, "heads": heads}).double()
    return model, list(trunk.parameters()), list(heads.parameters())


def per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    features = model["trunk"](x)
    return torch.cat([head(features) for head in model["heads"]], dim=1).sub(y).pow(2)


@pytest.mark.parametrize("strategy", ["loop", "batched"])
@pytest.mark.parametrize("feed_heads", [True, False])
def test_strategies_equal_per_task_autograd(strategy: str, feed_heads: bool) -> None:
    model, shared, heads = small_net()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    cotangent = torch.rand(9, 3, dtype=torch.float64)
    losses = per_sample(model, x, y)
    expected = []
    for task in range(3):
        grads = torch.autograd.grad((losses[:, task] * cotangent[:, task]).sum(), shared, retain_graph=True)
        expected.append(torch.cat([g.flatten() for g in grads]))
    head_expected = torch.autograd.grad((losses * cotangent).sum(), heads, retain_graph=True)
    out = torch.full((3, sum(p.numel() for p in shared)), float("nan"), dtype=torch.float64)
    task_jacobian(losses, cotangent, shared, out, strategy=strategy, feed_heads=feed_heads)
    torch.testing.assert_close(out, torch.stack(expected))
    assert all(p.grad is None for p in shared), "shared .grad must be restored"
    for p, g in zip(heads, head_expected):
        if feed_heads:
            torch.testing.assert_close(p.grad, g)
        else:
            assert p.grad is None


def test_unknown_strategy_and_bad_buffer() -> None:
    model, shared, _ = small_net()
    losses = per_sample(model, torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown Jacobian strategy"):
        task_jacobian(losses, torch.ones(2, 3), shared, torch.zeros(3, 10), strategy="magic")
    with pytest.raises(ValueError, match="buffer has shape"):
        task_jacobian(losses, torch.ones(2, 3), shared, torch.zeros(3, 10))


class TwoTaskLinear(nn.Module):
    """logits_i = x @ W_i: the input gradient of the summed CE is computable by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[[1.0, -1.0], [0.0, 0.0]], [[0.0, 0.0], [2.0, -2.0]]]))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x @ self.w[0], x @ self.w[1]]


def test_fgsm_matches_the_hand_computed_sign() -> None:
    model = TwoTaskLinear()
    x = torch.tensor([[0.5, 0.5]])
    labels = torch.tensor([[0, 1]])
    # task 0: logits (x0, -x0), label 0: dCE/dx0 = -2 (1 - softmax) < 0 -> sign -1 on x0
    # task 1: logits (2 x1, -2 x1), label 1: dCE/dx1 = +4 * softmax_0 > 0 -> sign +1 on x1
    adv = fgsm(model, x, labels, 0.1)
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.6]]))
    # clamped to [0, 1]
    torch.testing.assert_close(fgsm(model, torch.tensor([[0.05, 0.97]]), labels, 0.1), torch.tensor([[0.0, 1.0]]))
    assert torch.equal(fgsm(model, x, labels, 0.0), x)
    assert model.w.grad is None, "the attack must not leave parameter gradients"
    model.train()
    fgsm(model, x, labels, 0.1)
    assert model.training, "the model's mode is restored"
    with pytest.raises(ValueError, match="eps must be >= 0"):
        fgsm(model, x, labels, -0.1)
