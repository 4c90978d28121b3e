"""MGDA's clipped-step option (``clip_c1``, ``clip_c2``) against a plain step-by-step version.

The option scales MGDA's joint step by Double-Clip's theta clip, alpha = min(c1, c2 / ||J^T w||).
It is the ``mgda[lr=1.0,clip_c1=1.0,clip_c2=0.5]`` ablation row of the 2-digit small comparison
(MGDA at Double-Clip's step length), so what it computes must be exactly that.  The reference is
written out here in float64 torch on a small multi-task linear regression: dual objectives through
the chi^2 conjugate by autograd, the simplex projection by sorting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from drmoo.optim import MGDA

LAM, BATCH, SAMPLES, DIM, TASKS, STEPS = 0.8, 16, 200, 4, 3, 12
HP = {"lr": 0.5, "pref_lr": 0.2, "rho": 1e-2}


def data() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    inputs = 0.5 * torch.randn(SAMPLES, DIM, generator=gen, dtype=torch.float64)
    optima = torch.randn(DIM, TASKS, generator=gen, dtype=torch.float64)
    return inputs, inputs @ optima + 0.2 * torch.randn(SAMPLES, TASKS, generator=gen, dtype=torch.float64)


def losses_of(theta: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
    return ((inputs @ theta)[:, None] - targets) ** 2


def batches() -> Callable[[], Tensor]:
    gen = torch.Generator().manual_seed(11)
    return lambda: torch.randint(0, SAMPLES, (BATCH,), generator=gen)


def project(v: Tensor) -> Tensor:
    u = torch.sort(v, descending=True).values
    cumulative = torch.cumsum(u, 0)
    k = max(j for j in range(1, len(v) + 1) if u[j - 1] - (cumulative[j - 1] - 1.0) / j > 0)
    return torch.clamp(v - (cumulative[k - 1] - 1.0) / k, min=0.0)


def plain_clipped_mgda(c1: float, c2: float) -> tuple[Tensor, Tensor, Tensor, list[float]]:
    """theta, eta, w after STEPS steps, and every step's alpha."""
    inputs, targets = data()
    draw = batches()
    theta = torch.full((DIM,), 0.1, dtype=torch.float64)
    eta = torch.zeros(TASKS, dtype=torch.float64)
    w = torch.full((TASKS,), 1.0 / TASKS, dtype=torch.float64)
    alphas = []
    for _ in range(STEPS):
        rows = draw()
        theta_leaf, eta_leaf = theta.clone().requires_grad_(), eta.clone().requires_grad_()
        losses = losses_of(theta_leaf, inputs[rows], targets[rows])
        u = (losses - eta_leaf) / LAM
        objective = LAM * (0.25 * torch.clamp(u + 2.0, min=0.0) ** 2 - 1.0).mean(dim=0) + eta_leaf
        J = torch.stack([torch.autograd.grad(objective[i], theta_leaf, retain_graph=True)[0] for i in range(TASKS)])
        (z,) = torch.autograd.grad(objective.sum(), eta_leaf)
        K = J @ J.T + torch.diag(z * z)
        w = project(w - HP["pref_lr"] * (K @ w + HP["rho"] * w))
        d = J.T @ w
        alpha = min(c1, c2 / float(d.norm()))
        alphas.append(alpha)
        theta = theta - HP["lr"] * alpha * d
        eta = eta - HP["lr"] * alpha * z * w
    return theta, eta, w, alphas


def drmoo_mgda(**clip: float) -> tuple[Tensor, MGDA]:
    inputs, targets = data()
    draw = batches()
    theta = torch.full((DIM,), 0.1, dtype=torch.float64, requires_grad=True)
    opt = MGDA([theta], TASKS, lam=LAM, **HP, **clip)
    for _ in range(STEPS):
        rows = draw()
        opt.step(lambda rows=rows: losses_of(theta, inputs[rows], targets[rows]))
    return theta.detach(), opt


@pytest.mark.parametrize("c1,c2", [(1.0, 0.5), (0.7, 0.2)])
def test_clipped_mgda_matches_plain_implementation(c1: float, c2: float) -> None:
    """Guards the option's definition: the joint step (theta and eta) scaled by min(c1, c2 / ||J^T w||)."""
    theta, opt = drmoo_mgda(clip_c1=c1, clip_c2=c2)
    ref_theta, ref_eta, ref_w, alphas = plain_clipped_mgda(c1, c2)
    torch.testing.assert_close(theta, ref_theta, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(opt.eta.double(), ref_eta, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(opt.w.double(), ref_w, rtol=1e-9, atol=1e-9)
    # both branches of the clip are exercised, or the comparison proves less than it claims
    assert min(alphas) < c1 and max(alphas) == c1


def test_clip_off_by_default_and_differs_when_on() -> None:
    """Guards the default: no clip keys = plain MGDA; a binding clip changes the trajectory."""
    plain, _ = drmoo_mgda()
    ref_unclipped, _, _, _ = plain_clipped_mgda(1.0, float("inf"))
    torch.testing.assert_close(plain, ref_unclipped, rtol=1e-9, atol=1e-9)
    clipped, _ = drmoo_mgda(clip_c1=1.0, clip_c2=0.5)
    assert float((clipped - plain).norm()) > 1e-3


@pytest.mark.parametrize("clip", [{"clip_c1": 1.0}, {"clip_c2": 0.5}])
def test_clip_needs_both_factors(clip: dict[str, float]) -> None:
    theta = torch.zeros(DIM, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="give both or neither"):
        MGDA([theta], TASKS, **clip)


def test_clip_factors_must_be_positive() -> None:
    theta = torch.zeros(DIM, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="clip_c2"):
        MGDA([theta], TASKS, clip_c1=1.0, clip_c2=-0.5)


@pytest.mark.parametrize("jacobian", ["parameters", "features"])
def test_the_clip_taken_on_the_host_above_the_face_enumeration_is_the_devices(toy, jacobian: str) -> None:
    """For m > 10 an eager step finds the min-norm weights on the host and takes the clip's factor there too
    (one host read); a capturable step takes both on the device.  Same theta, eta and w, to rounding, with the
    clip active (c2 small: alpha < c1)."""
    results = []
    for capturable in (False, True):
        problem = toy(num_tasks=14)
        optimizer = MGDA(problem.shared, 14, lr=0.05, solver="min_norm", clip_c1=1.0, clip_c2=0.05,
                         capturable=capturable, jacobian=jacobian, features_rate_chosen=True)
        draw = problem.batches(1)
        alphas = []
        for _ in range(4):
            rows = draw()

            def closure(rows: Tensor = rows, problem: Any = problem) -> Tensor | tuple[Tensor, Tensor]:
                z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
                losses = (z @ problem.H - problem.targets[rows]) ** 2
                return (losses, z) if jacobian == "features" else losses

            optimizer.step(closure)
            stats = optimizer.stats
            alphas.append(min(1.0, 0.05 / float(stats["theta_grad_norm"])))
        results.append((problem.A.detach().clone(), problem.c.detach().clone(), optimizer.eta.clone(),
                        optimizer.w.clone()))
        assert max(alphas) < 1.0, "the clip must be active for this comparison"
    for eager, device in zip(*results):
        torch.testing.assert_close(eager, device, rtol=1e-12, atol=1e-14)
