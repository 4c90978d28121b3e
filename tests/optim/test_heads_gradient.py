"""The heads' ``.grad`` is the gradient of their own task's dual objective, for every method and path.

Every drmoo optimizer promises that each trainable leaf outside the shared parameters (one head per
task here) receives in ``.grad`` the gradient of its task's dual objective L^i on the batch of the
parameter step, at that step's dual variables -- the heads are then stepped by the user's own
optimizer.  Nothing else in the step looks at those gradients, so a head silently left without its
gradient trains nothing and no other test notices (torch 2.11 did exactly that on the one-backward
path of FAMO and Nash-MTL).  Here the expected gradient is computed independently, with plain
autograd through the chi^2 conjugate, from the batch, parameters and dual variables the step used,
on every path: the first and later steps, Nash-MTL's reuse steps, Double-Clip with and without
resampling and with a dual scale, a loss scale, importance weights, and the batched Jacobian.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

from drmoo.optim import create

NUM_TASKS = 3
LAM = 0.8  # the optimizers' default lambda (the paper's main experiments), which some tests rely on
ROWS, FEATURES, HIDDEN, BATCH = 64, 5, 4, 12
STEPS = 3
LOSS_SCALE = 8.0

# (method, extra constructor arguments): every method, and each of its code paths for the heads.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("double-clip", {}),
    ("double-clip", {"resample": False}),
    ("double-clip", {"dual_scale": 2.0}),
    ("double-loop", {"inner_steps": 3, "dual_lr": 0.3, "seed": 5}),
    ("mgda", {}),
    ("mgda", {"solver": "min_norm"}),
    ("modo", {}),
    ("moco", {}),
    ("sdmgrad", {}),
    ("nashmtl", {"update_every": 2, "solver_iters": 30}),  # steps 0, 2: weight update; step 1: reuse
    ("famo", {}),
]
VARIANTS = ("plain", "loss_scale", "weighted", "batched_jacobian")


@dataclass
class Model:
    """tanh(x A + c) shared; task i has its own head (h_i, b_i): loss_i = (hidden h_i + b_i - y_i)^2."""

    weighted: bool
    inputs: Tensor = field(init=False)
    targets: Tensor = field(init=False)
    sample_weights: Tensor = field(init=False)
    shared: list[Tensor] = field(init=False)
    heads: list[list[Tensor]] = field(init=False)
    draws: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        f64 = torch.float64
        self.inputs = torch.randn(ROWS, FEATURES, generator=gen, dtype=f64)
        self.targets = torch.randn(ROWS, NUM_TASKS, generator=gen, dtype=f64) + torch.arange(NUM_TASKS, dtype=f64)
        self.sample_weights = 0.25 + 1.5 * torch.rand(ROWS, NUM_TASKS, generator=gen, dtype=f64)
        self.shared = [(0.5 * torch.randn(FEATURES, HIDDEN, generator=gen, dtype=f64)).requires_grad_(),
                       (0.1 * torch.randn(HIDDEN, generator=gen, dtype=f64)).requires_grad_()]
        self.heads = [[(0.5 * torch.randn(HIDDEN, generator=gen, dtype=f64)).requires_grad_(),
                       torch.zeros(1, dtype=f64).requires_grad_()] for _ in range(NUM_TASKS)]
        self.batch_gen = torch.Generator().manual_seed(1)

    def losses(self, rows: Tensor, shared: list[Tensor], heads: list[list[Tensor]]) -> Tensor:
        hidden = torch.tanh(self.inputs[rows] @ shared[0] + shared[1])
        columns = [hidden @ h + b for h, b in heads]
        return (torch.stack(columns, dim=1) - self.targets[rows]) ** 2

    def closure(self, same_batch: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if not same_batch:
            self.draws.append(torch.randint(0, ROWS, (BATCH,), generator=self.batch_gen))
        rows = self.draws[-1]
        losses = self.losses(rows, self.shared, self.heads)
        return (losses, self.sample_weights[rows]) if self.weighted else losses

    def dual(self, rows: Tensor, shared: list[Tensor], heads: list[list[Tensor]], eta: Tensor,
             scale: float = 1.0) -> Tensor:
        """L^i = lam mean_b[omega_b^i f*((l_b^i - s eta^i) / lam)] + s eta^i with chi^2's f*, by autograd."""
        losses = self.losses(rows, shared, heads)
        u = (losses - scale * eta) / LAM
        conj = 0.25 * torch.clamp(u + 2.0, min=0.0) ** 2 - 1.0
        if self.weighted:
            conj = self.sample_weights[rows] * conj
        return LAM * conj.mean(dim=0) + scale * eta

    def own_task_head_gradients(self, rows: Tensor, shared: list[Tensor], eta: Tensor,
                                scale: float = 1.0) -> list[list[Tensor]]:
        """d L^i / d head_i for each task i, at fresh copies of the parameters."""
        shared = [p.detach().clone() for p in shared]
        heads = [[p.detach().clone().requires_grad_() for p in head] for head in self.heads]
        objective = self.dual(rows, shared, heads, eta.detach(), scale)
        return [list(torch.autograd.grad(objective[i], heads[i], retain_graph=True)) for i in range(NUM_TASKS)]

    def inner_loop_eta(self, rows_per_step: list[Tensor], shared: list[Tensor], eta: Tensor,
                       dual_lr: float) -> list[Tensor]:
        """Double-Loop's eta_{t,0..D}: plain SGD on eta, dL/deta by autograd."""
        etas = [eta.detach().clone()]
        for rows in rows_per_step:
            leaf = etas[-1].clone().requires_grad_()
            with torch.no_grad():
                losses = self.losses(rows, shared, self.heads)
            u = (losses - leaf) / LAM
            conj = 0.25 * torch.clamp(u + 2.0, min=0.0) ** 2 - 1.0
            if self.weighted:
                conj = self.sample_weights[rows] * conj
            (grad,) = torch.autograd.grad((LAM * conj.mean(dim=0) + leaf).sum(), leaf)
            etas.append(etas[-1] - dual_lr * grad)
        return etas


def expected_head_gradients(method: str, extra: dict[str, Any], model: Model, optimizer: Any,
                            shared_before: list[Tensor], eta_before: Tensor, draws: list[Tensor]) -> list[list[Tensor]]:
    """Which batch and which eta each method's parameter step uses (see each class docstring)."""
    if method == "double-clip":  # step 3 of Algorithm 2: the gradient batch at eta_{t+1}
        scale = extra.get("dual_scale", 1.0)
        rows = draws[-1]
        assert len(draws) == (1 if extra.get("resample") is False else 2)
        return model.own_task_head_gradients(rows, shared_before, optimizer.eta, scale)
    if method == "double-loop":  # batch xi (the first outer one) at eta_{t,d}
        depth = extra["inner_steps"]
        assert len(draws) == depth + 3
        etas = model.inner_loop_eta(draws[:depth], shared_before, eta_before, extra["dual_lr"])
        torch.testing.assert_close(optimizer.eta, etas[-1].to(optimizer.eta.dtype), rtol=1e-12, atol=1e-14)
        d = int(optimizer.stats["inner_indices"][0])
        return model.own_task_head_gradients(draws[depth], shared_before, etas[d])
    if method in ("modo", "sdmgrad"):  # the third of three batches steps
        assert len(draws) == 3
        return model.own_task_head_gradients(draws[2], shared_before, eta_before)
    assert len(draws) == 1  # mgda, moco, nashmtl, famo: one fresh batch at eta_t
    return model.own_task_head_gradients(draws[0], shared_before, eta_before)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("method", "extra"), CASES, ids=[f"{m}-{'-'.join(e) or 'default'}" for m, e in CASES])
def test_heads_get_their_own_tasks_dual_gradient(method: str, extra: dict[str, Any], variant: str) -> None:
    model = Model(weighted=variant == "weighted")
    optimizer = create(method, model.shared, NUM_TASKS, lr=0.05, backend="reference", **extra)
    if variant == "loss_scale":
        optimizer.loss_scale = LOSS_SCALE
    if variant == "batched_jacobian":
        optimizer.jacobian_strategy = "batched"
    head_scale = LOSS_SCALE if variant == "loss_scale" else 1.0  # the heads' .grad stay scaled
    head_optimizer = torch.optim.SGD([p for head in model.heads for p in head], lr=0.05)
    for step in range(STEPS):
        shared_before = [p.detach().clone() for p in model.shared]
        eta_before = optimizer.eta.detach().clone()
        first_draw = len(model.draws)
        head_optimizer.zero_grad(set_to_none=True)
        optimizer.step(model.closure)
        draws = model.draws[first_draw:]
        expected = expected_head_gradients(method, extra, model, optimizer, shared_before, eta_before, draws)
        for task, (head, want) in enumerate(zip(model.heads, expected)):
            for param, grad in zip(head, want):
                assert param.grad is not None, f"step {step}: head {task} got no gradient"
                assert bool(grad.abs().sum() > 0), "a vacuous check: the expected head gradient is 0"
                torch.testing.assert_close(param.grad / head_scale, grad, rtol=1e-10, atol=1e-12,
                                           msg=lambda msg, s=step, t=task: f"step {s}, head {t}: {msg}")
        for head in model.heads:
            for param in head:
                param.grad /= head_scale
        head_optimizer.step()  # as a user would: the next step starts from moved heads
    if method == "nashmtl":
        assert optimizer.stats["weights_updated"].item() is True  # step 2 solved again; step 1 reused


def test_the_check_tells_the_steps_batch_and_eta_apart() -> None:
    """The expected gradients differ, far beyond the tolerance, between the step's own batch and eta
    and a neighbouring batch or eta: a method feeding its heads from the wrong one fails the test."""
    model = Model(weighted=False)
    optimizer = create("double-clip", model.shared, NUM_TASKS, lr=0.05, backend="reference")
    optimizer.step(model.closure)
    shared_before, eta_before = [p.detach().clone() for p in model.shared], optimizer.eta.clone()
    for head in model.heads:
        for param in head:
            param.grad = None
    optimizer.step(model.closure)
    step_batch, other_batch = model.draws[-1], model.draws[-2]
    right = model.own_task_head_gradients(step_batch, shared_before, optimizer.eta)
    for wrong in (model.own_task_head_gradients(step_batch, shared_before, eta_before),  # eta_t, not eta_{t+1}
                  model.own_task_head_gradients(other_batch, shared_before, optimizer.eta)):
        for task in range(NUM_TASKS):
            gap = (wrong[task][0] - right[task][0]).abs().max()
            assert float(gap) > 1e3 * (1e-12 + 1e-10 * float(right[task][0].abs().max()))
    torch.testing.assert_close(model.heads[0][0].grad, right[0][0], rtol=1e-10, atol=1e-12)
