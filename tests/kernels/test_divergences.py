"""Divergences: closed forms, finite-difference gradients, Fenchel-Young, name lookup."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drmoo import dual_objective
from drmoo_kernels import DIVERGENCE_NAMES, Divergence, get_divergence

ALL_DIVERGENCES = [
    get_divergence("chi2"),
    get_divergence("kl"),
    get_divergence("cvar_smooth(0.2)"),
    get_divergence("cvar_smooth", 0.7),
    get_divergence("cressie_read(2)"),
    get_divergence("cressie_read(k=3.5)"),
]


def test_every_family_is_covered() -> None:
    assert {d.name for d in ALL_DIVERGENCES} == set(DIVERGENCE_NAMES)


def test_chi2_closed_form_at_mean_loss() -> None:
    gen = torch.Generator().manual_seed(1)
    losses = (1.0 + 0.3 * torch.rand(200, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    lam = 0.6
    eta = losses.detach().mean(dim=0).clone().requires_grad_()
    # no clipping: (l - eta)/lam > -2 everywhere
    assert bool(((losses - eta) / lam > -2).all())
    objective = dual_objective(losses, eta, lam, "chi2")
    expected = losses.detach().mean(0) + losses.detach().var(0, unbiased=False) / (4 * lam)
    torch.testing.assert_close(objective, expected, rtol=1e-12, atol=1e-12)
    (grad_eta,) = torch.autograd.grad(objective.sum(), eta)
    torch.testing.assert_close(grad_eta, torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)


def test_chi2_clipping_changes_the_closed_form() -> None:
    # With a sample far below eta the (u + 2)_+ clip is active, and the closed form no longer holds.
    losses = torch.tensor([[0.0], [10.0]], dtype=torch.float64)
    eta = losses.mean(0)
    objective = dual_objective(losses, eta, 0.5, "chi2")
    naive = losses.mean(0) + losses.var(0, unbiased=False) / 2.0
    assert not torch.allclose(objective, naive)


@pytest.mark.parametrize("scale_of_losses", [1.0, 300.0])
def test_kl_closed_form_is_stable(scale_of_losses: float) -> None:
    gen = torch.Generator().manual_seed(2)
    lam = 0.5
    losses = scale_of_losses * torch.rand(64, 2, generator=gen, dtype=torch.float64)
    # eta* = lam log mean exp(l/lam), computed stably; l/lam reaches 600 (exp overflows float64 at 709
    # and float32 at 88), and the objective at eta* must equal eta* itself.
    eta_star = lam * (torch.logsumexp(losses / lam, dim=0) - math.log(losses.shape[0]))
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        objective = dual_objective(losses.to(dtype), eta_star.to(dtype), lam, "kl")
        assert bool(torch.isfinite(objective).all())
        atol = 1e-4 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(objective.double(), eta_star, rtol=rtol, atol=atol)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
def test_gradients_match_finite_differences(divergence: Divergence, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    losses = (0.2 + torch.rand(7, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    eta = (0.4 * torch.rand(3, generator=gen, dtype=torch.float64) - 0.2).requires_grad_()
    weights = 0.5 + torch.rand(7, 3, generator=gen, dtype=torch.float64) if weighted else None

    def objective(losses_: torch.Tensor, eta_: torch.Tensor) -> torch.Tensor:
        return dual_objective(losses_, eta_, 0.6, divergence, scale=1.3, sample_weight=weights)

    assert torch.autograd.gradcheck(objective, (losses, eta), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES, ids=str)
def test_gradient_formulas_of_the_design(divergence: Divergence) -> None:
    # dL/dl_b = omega f*'(u)/B and dL/deta = s (1 - mean omega f*'(u)), u = (l - s eta)/lam.
    gen = torch.Generator().manual_seed(4)
    losses = torch.rand(11, 2, generator=gen, dtype=torch.float64).requires_grad_()
    eta = torch.tensor([0.1, -0.3], dtype=torch.float64, requires_grad=True)
    omega = torch.rand(11, 2, generator=gen, dtype=torch.float64)
    lam, scale = 0.8, 2.0
    dual_objective(losses, eta, lam, divergence, scale, omega).sum().backward()
    ratio = divergence.conj_grad((losses.detach() - scale * eta.detach()) / lam) * omega
    torch.testing.assert_close(losses.grad, ratio / 11)
    torch.testing.assert_close(eta.grad, scale * (1 - ratio.mean(0)))


@settings(max_examples=60, deadline=None)
@given(t=st.floats(0.0, 20.0), u=st.floats(-30.0, 8.0), which=st.sampled_from(range(len(ALL_DIVERGENCES))))
def test_fenchel_young(t: float, u: float, which: int) -> None:
    divergence = ALL_DIVERGENCES[which]
    tt, uu = torch.tensor(t, dtype=torch.float64), torch.tensor(u, dtype=torch.float64)
    lhs = divergence.primal(tt) + divergence.conj(uu)
    assert float(lhs) >= t * u - 1e-9 * (1 + abs(t * u))


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES, ids=str)
def test_fenchel_young_is_tight_at_the_derivative(divergence: Divergence) -> None:
    # Equality holds at t = f*'(u): this pins f* to f rather than just bounding it.
    u = torch.linspace(-1.5, 3.0, 19, dtype=torch.float64)
    t = divergence.conj_grad(u)
    torch.testing.assert_close(divergence.primal(t) + divergence.conj(u), t * u, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES, ids=str)
def test_conj_grad_is_the_derivative_of_conj(divergence: Divergence) -> None:
    u = torch.linspace(-1.5, 4.0, 23, dtype=torch.float64).requires_grad_()
    (auto,) = torch.autograd.grad(divergence.conj(u).sum(), u)
    torch.testing.assert_close(auto, divergence.conj_grad(u.detach()))
    assert bool((divergence.conj_grad(u.detach()) >= 0).all())


def test_cvar_weights_are_bounded_and_overflow_free() -> None:
    divergence = get_divergence("cvar_smooth(0.25)")
    u = torch.tensor([-1e4, 0.0, 50.0, 1e4])
    weights = divergence.conj_grad(u)
    assert bool(torch.isfinite(weights).all()) and float(weights.max()) <= 4.0 + 1e-6
    assert bool(torch.isfinite(divergence.conj(u)).all())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("wasserstein", "unknown divergence"),
        ("cvar_smooth(1.5)", "0 < alpha < 1"),
        ("cvar_smooth(0)", "0 < alpha < 1"),
        ("cressie_read(1)", "k > 1"),
        ("cressie_read(abc)", "cannot parse"),
        ("chi2(3)", "takes no parameter"),
        ("", "cannot parse"),
    ],
)
def test_bad_names_and_parameters_are_value_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        get_divergence(spec)
    if "unknown" in message:
        assert "chi2" in str(info.value) and "cressie_read" in str(info.value)


def test_lookup_forms_agree() -> None:
    assert get_divergence("CVaR_Smooth( alpha = 0.3 )") == Divergence("cvar_smooth", 0.3)
    assert get_divergence(Divergence("kl")) == Divergence("kl")
    assert get_divergence("cressie_read", 4) == Divergence("cressie_read", 4.0)
    assert str(get_divergence("cvar_smooth(0.3)")) == "cvar_smooth(0.3)"
    assert get_divergence(str(get_divergence("cressie_read(2.5)"))).param == 2.5
