"""Issue 28, items 1-2: the Balancer's traps for a new user.

1. Heads passed as shared parameters (``model.parameters()`` instead of ``model.trunk.parameters()``)
   were accepted silently and each head got w_i times its gradient.  Now the first Jacobian shows
   the parameters that only some tasks reach, and the Balancer and the step optimizers refuse them,
   naming the shape and the tasks; ``allow_partial_shared=True`` keeps the old behaviour.
2. eta's step size was the balancer's own ``lr``, out of reach of the optimizer's scheduler.  With
   ``optimizer=opt`` each backward takes eta's step with the current lr of the optimizer's group of
   the shared parameters; with neither ``optimizer`` nor ``lr`` the balancer says so once.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import available, create

M = 3


class ThreeTaskNet(nn.Module):
    """A shared tanh trunk and one linear head per task."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double()
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(M)]).double()

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    return x, torch.stack([x[:, 0], x[:, 1] - x[:, 2], torch.sin(x[:, 3])], dim=1)


def losses_of(model: nn.Module, seed: int = 1) -> Tensor:
    x, y = batch(seed)
    return (model(x) - y) ** 2


# ------------------------------------------------------------------------------------- 1. heads
@pytest.mark.parametrize("method", sorted(available()))
def test_heads_passed_as_shared_parameters_are_refused_by_the_balancer(method: str) -> None:
    """Guards the trap: model.parameters() as the shared set gave each head w_i of its gradient silently."""
    model = ThreeTaskNet()
    balancer = drmoo.Balancer(method, model.parameters(), num_tasks=M, lr=0.01)
    refusal = r"shape \(1, 8\)\) is reached only by the losses of task\(s\) \[0\] of 3"
    with pytest.raises(ValueError, match=refusal) as error:
        balancer.backward(losses_of(model))
    message = str(error.value)
    assert "model.trunk.parameters()" in message and "allow_partial_shared=True" in message
    assert balancer.steps_taken == 0 and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("method", ["mgda", "double-clip", "nashmtl", "famo"])
def test_heads_passed_as_shared_parameters_are_refused_by_the_step_optimizers(method: str) -> None:
    model = ThreeTaskNet()
    optimizer = create(method, model.parameters(), M)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"only by the losses of task\(s\) \[0\]"):
        optimizer.step(lambda: losses_of(model))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_famo_checks_with_one_backward_per_task_on_its_first_step_only() -> None:
    """FAMO forms no Jacobian, so its check takes a backward per task -- on the first step, not after
    (guards both the check, which FAMO skipped, and its cost, which must not recur every step)."""
    model = ThreeTaskNet()
    balancer = drmoo.Balancer("famo", model.trunk.parameters(), num_tasks=M, lr=0.01)
    passes = []
    model.trunk[0].weight.register_hook(lambda grad: passes.append(1))
    balancer.backward(losses_of(model, seed=1))
    first = len(passes)
    balancer.backward(losses_of(model, seed=2))
    assert (first, len(passes) - first) == (M + 1, 1)


def test_allow_partial_shared_keeps_the_old_behaviour() -> None:
    """The explicit opt-in: the heads go through the multi-objective update (w_i times their gradient)."""
    model = ThreeTaskNet()
    balancer = drmoo.Balancer("mgda", model.parameters(), num_tasks=M, lr=0.01, allow_partial_shared=True)
    balancer.backward(losses_of(model))
    reference = ThreeTaskNet()  # the heads as heads: their own task's DR gradient, unscaled
    drmoo.Balancer("mgda", reference.trunk.parameters(), num_tasks=M, lr=0.01).backward(losses_of(reference))
    for task in range(M):
        torch.testing.assert_close(model.heads[task].weight.grad,
                                   balancer.w[task] * reference.heads[task].weight.grad, rtol=1e-12, atol=0.0)
    stepped = ThreeTaskNet()
    stepper = create("mgda", stepped.parameters(), M)
    stepper.allow_partial_shared = True
    stepper.step(lambda: losses_of(stepped))


def test_the_trunk_alone_with_a_zero_initialised_head_and_zero_sample_weights_is_accepted() -> None:
    """No false alarm from values: a task whose whole Jacobian row is zero (its head's weights are
    zero, or all its sample weights are) tells nothing about which parameters it reaches."""
    model = ThreeTaskNet()
    with torch.no_grad():
        model.heads[2].weight.zero_()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), num_tasks=M, lr=0.01)
    balancer.backward(losses_of(model))
    weights = torch.ones(16, M, dtype=torch.float64)
    weights[:, 0] = 0.0
    fresh = ThreeTaskNet()
    drmoo.Balancer("mgda", fresh.trunk.parameters(), num_tasks=M, lr=0.01).backward((losses_of(fresh), weights))


# ------------------------------------------------------------------------------- 2. one lr
def run_one_backward(method: str, **balancer_kwargs: Any) -> drmoo.Balancer:
    model = ThreeTaskNet()
    optimizer = torch.optim.Adam([{"params": model.trunk.parameters()}, {"params": model.heads.parameters()}],
                                 lr=1e-3)
    if balancer_kwargs.pop("couple", False):
        balancer_kwargs["optimizer"] = optimizer
    for group in optimizer.param_groups:
        group["lr"] = 0.002  # as a scheduler would, after the balancer was built
    balancer = drmoo.Balancer(method, model.trunk.parameters(), num_tasks=M, **balancer_kwargs)
    for seed in (1, 2):
        optimizer.zero_grad()
        balancer.backward(losses_of(model, seed))
        optimizer.step()
    return balancer


@pytest.mark.parametrize("method", ["double-clip", "mgda", "nashmtl"])
def test_eta_follows_the_optimizers_current_learning_rate(method: str) -> None:
    """Guards the two-learning-rates trap: optimizer=opt (lr changed to 0.002 after construction)
    gives the eta of lr=0.002 -- and not that of the method's default lr."""
    coupled = run_one_backward(method, couple=True)
    fixed = run_one_backward(method, lr=0.002)
    assert torch.equal(coupled.eta, fixed.eta)
    assert not torch.equal(coupled.eta, torch.zeros_like(coupled.eta))
    assert coupled.algorithm.hyper("lr") == 0.002


def test_a_scheduler_on_the_optimizer_reaches_eta() -> None:
    model = ThreeTaskNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=M, optimizer=optimizer)
    rates = []
    for seed in (1, 2, 3):
        optimizer.zero_grad()
        balancer.backward(losses_of(model, seed))
        rates.append(balancer.algorithm.hyper("lr"))
        optimizer.step()
        scheduler.step()
    assert rates == [0.1, 0.05, 0.025]


def test_neither_optimizer_nor_lr_warns_once_and_either_is_silent() -> None:
    model = ThreeTaskNet()
    with pytest.warns(UserWarning, match="eta's step size is the method's default lr=0.005") as record:
        balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=M)
        balancer.backward(losses_of(model))
        balancer.backward(losses_of(model, 2))
    assert len([w for w in record if "eta's step size" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=M, lr=0.01)
        drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=M,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_optimizer_and_lr_together_or_an_optimizer_without_the_shared_parameters_are_refused() -> None:
    model = ThreeTaskNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got StepLR"):
        drmoo.Balancer("mgda", model.trunk.parameters(), num_tasks=M,
                       optimizer=torch.optim.lr_scheduler.StepLR(optimizer, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        drmoo.Balancer("mgda", model.trunk.parameters(), num_tasks=M, optimizer=optimizer, lr=0.1)
    with pytest.raises(ValueError, match="holds none of the balancer's shared parameters"):
        drmoo.Balancer("mgda", model.trunk.parameters(), num_tasks=M,
                       optimizer=torch.optim.SGD(model.heads.parameters(), lr=0.1))
    split = torch.optim.SGD([{"params": model.trunk[0].weight, "lr": 0.1}, {"params": model.trunk[0].bias}], lr=0.2)
    with pytest.raises(ValueError, match=r"different learning rates \[0.1, 0.2\]"):
        drmoo.Balancer("mgda", model.trunk.parameters(), num_tasks=M, optimizer=split)
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), num_tasks=M, optimizer=optimizer)
    optimizer.param_groups[0]["lr"] = float("nan")  # a broken scheduler: refused like the method's own lr
    with pytest.raises(ValueError, match="lr must be"):
        balancer.backward(losses_of(model))
    assert balancer.steps_taken == 0


def test_a_refused_step_does_not_switch_the_check_off() -> None:
    """Catching the refusal and going on must not train the heads silently at w_i of their gradient."""
    model = ThreeTaskNet()
    balancer = drmoo.Balancer("mgda", model.parameters(), num_tasks=M, lr=0.01)
    for seed in (1, 2):
        with pytest.raises(ValueError, match="looks like a task-specific head"):
            balancer.backward(losses_of(model, seed))


def test_a_task_unseen_in_the_first_jacobian_is_checked_in_a_later_one() -> None:
    """Task 0's rows are all zero on the first batch (its sample weights are): the heads are found
    on the next batch, where every task is seen."""
    model = ThreeTaskNet()
    balancer = drmoo.Balancer("mgda", [*model.trunk.parameters(), *model.heads[0].parameters()], num_tasks=M,
                              lr=0.01)
    weights = torch.ones(16, M, dtype=torch.float64)
    weights[:, 0] = 0.0
    balancer.backward((losses_of(model), weights))  # nothing tells head 0 apart from the trunk yet
    with pytest.raises(ValueError, match=r"reached only by the losses of task\(s\) \[0\]"):
        balancer.backward(losses_of(model, 2))
