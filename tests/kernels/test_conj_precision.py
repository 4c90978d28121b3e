"""The dual objective keeps its precision at every lambda, in every backend: against its value computed in 60
digits (error_bounds.exact_dual_objective), within the float error bound of a cancellation-free evaluation.

The objective is lam * mean f*(u) + s eta with u = (loss - s eta) / lam, and at a large lam (a small ball)
f*(u) ~ u is tiny.  The conjugates were written as "something near 1, minus 1" (chi2's 0.25 (u + 2)^2 - 1,
Cressie-Read's power of 1 + (k - 1) u minus 1, cvar_smooth's log-sum-exp at log 1), which kept an absolute
error of one rounding of 1 -- lam times that in the objective: in float32 0 for every loss at lam = 1e8
(chi2, Cressie-Read), a factor 6 off (cvar_smooth), and in float64 a relative 2e-5 at lam = 1e12.
The triton backend's version of this test is in test_triton_ops.py (it needs the interpreter's setup).
"""

from __future__ import annotations

import math

import error_bounds as eb  # tests/kernels is on pytest's pythonpath (pyproject.toml)
import pytest
import torch

from drmoo_kernels import Divergence, reference
from drmoo_kernels.backends import cpp as cpp_backend
from drmoo_kernels.backends import cuda as cuda_backend

DIVERGENCES = [Divergence("chi2"), Divergence("kl"), Divergence("cvar_smooth", 0.2), Divergence("cvar_smooth", 0.999),
               Divergence("cvar_smooth", 1e-5), Divergence("cressie_read", 3.0), Divergence("cressie_read", 1.5)]
LAMS = [0.05, 1.0, 100.0, 1e4, 1e8, 1e12, 1e30]
BACKENDS = [
    pytest.param((reference, "cpu"), id="reference"),
    pytest.param((cpp_backend, "cpu"), id="cpp"),
    pytest.param((cuda_backend, "cuda"), id="cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (the cuda backend runs on GPU tensors)")),
]


def problem(dtype: torch.dtype, eta: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    losses = (torch.rand(13, 2, generator=generator, dtype=torch.float64) + 1.0).to(dtype)
    return losses, torch.tensor(eta, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
@pytest.mark.parametrize("eta", [(0.3, -0.2), (2.5, 3.0)], ids=["u-positive", "u-negative"])
def test_the_dual_objective_is_within_its_error_bound_at_every_lambda(
        backend: tuple[object, str], dtype: torch.dtype, divergence: Divergence, eta: tuple[float, float]) -> None:
    module, device = backend
    losses, eta_tensor = problem(dtype, eta)
    for lam in LAMS:
        objective = module.dual_forward(losses.to(device), eta_tensor.to(device), lam, 1.0, divergence)[0]
        exact, bounds = eb.exact_dual_objective(losses, eta_tensor, lam, 1.0, divergence)
        for task, (value, truth, bound) in enumerate(zip(objective.cpu().double().tolist(), exact, bounds)):
            assert abs(value - truth) <= bound, (
                f"lam={lam:g} task {task}: {value!r} against {truth!r}, error {abs(value - truth):.3g} > bound "
                f"{bound:.3g}")


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
def test_the_conjugates_keep_nan_and_their_floor(divergence: Divergence) -> None:
    """NaN stays NaN through every branch; far below the support's edge f* is its floor (-1 for chi2 and kl,
    -1/k for Cressie-Read, log(1 - alpha) / alpha for cvar_smooth); f*(0) = 0 exactly."""
    u = torch.tensor([float("nan"), -1e6, 0.0], dtype=torch.float64)
    values = divergence.conj(u)
    assert torch.isnan(values[0])
    if divergence.name == "cvar_smooth":
        floor = math.log1p(-divergence.param) / divergence.param
    elif divergence.name == "cressie_read":
        floor = -1.0 / divergence.param
    else:
        floor = -1.0
    assert values[1].item() == pytest.approx(floor, rel=1e-15)
    assert values[2].item() == 0.0


@pytest.mark.parametrize(("divergence", "u", "dtype"), [
    (Divergence("cressie_read", 3.0), -0.5 * (1 - 1e-5), torch.float32),  # f* near its floor -1/k
    (Divergence("cressie_read", 1.5), -2.0 * (1 - 1e-7), torch.float64),
    (Divergence("cvar_smooth", 0.999999), -30.0, torch.float64),  # outside the log1p window, alpha near 1
    (Divergence("cvar_smooth", 0.2), 1.0, torch.float64),  # the window's edge
    (Divergence("chi2"), -2.0 + 1e-6, torch.float32),
], ids=["cressie3-floor", "cressie1.5-floor", "cvar-alpha-near-1", "cvar-window-edge", "chi2-floor"])
def test_autograd_through_the_conjugate_is_conj_grad_near_its_floor(divergence: Divergence, u: float,
                                                                    dtype: torch.dtype) -> None:
    """Autograd of the reference f* keeps f*' 's digits where f* nears its floor (expm1's backward forms
    expm1(y) + 1, which cancels there, so exp(y) - 1 is taken below y = -1/2)."""
    point = torch.tensor([u], dtype=dtype, requires_grad=True)
    (grad,) = torch.autograd.grad(divergence.conj(point).sum(), point)
    expected = divergence.conj_grad(point.detach())
    assert expected.item() > 0
    torch.testing.assert_close(grad, expected, rtol=64 * torch.finfo(dtype).eps, atol=0.0)


@pytest.mark.parametrize("backend", BACKENDS[:2])
@pytest.mark.parametrize("divergence", DIVERGENCES, ids=str)
def test_an_infinite_loss_gives_an_infinite_objective(backend: tuple[object, str], divergence: Divergence) -> None:
    """u = +inf: f*(u) = +inf in every form (Cressie-Read's log1p(inf) * (inf / inf) was NaN in Triton)."""
    module, device = backend
    losses = torch.tensor([[1.0, float("inf")], [2.0, 1.5]], device=device)
    objective = module.dual_forward(losses, torch.zeros(2, device=device), 0.8, 1.0, divergence)[0]
    assert torch.isfinite(objective[0]) and objective[1].item() == float("inf")
