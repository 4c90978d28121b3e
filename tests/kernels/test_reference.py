"""The pure-torch reference layer: simplex projection, ops' internal consistency, backend dispatch."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from drmoo_kernels import available_backends, get_divergence, project_simplex, reference, resolve_backend


def brute_force_projection(v: list[float]) -> torch.Tensor:
    """Enumerate supports S: w_S = v_S - tau with tau fixing the sum; keep the one meeting the KKT
    conditions of the projection: v_i - tau >= 0 on S and v_j - tau <= 0 off it.

    The conditions decide the support exactly.  Comparing the candidates' distances to v instead is
    not an oracle: the entries off S add the same large (v_j)^2 to every distance, and float64
    rounding of that sum can swamp the difference between two supports (v = [0, 0, 0.99999, -512]:
    3.3e-11 against 1e-10 next to 512^2).  The slack is tau's rounding-error bound.
    """
    values = torch.tensor(v, dtype=torch.float64)
    slack = 8 * len(v) * torch.finfo(torch.float64).eps * (1.0 + float(values.abs().max()))
    for size in range(1, len(v) + 1):
        for support in itertools.combinations(range(len(v)), size):
            idx = list(support)
            off = [j for j in range(len(v)) if j not in support]
            tau = (values[idx].sum() - 1.0) / size
            if bool((values[idx] - tau >= -slack).all()) and bool((values[off] - tau <= slack).all()):
                w = torch.zeros_like(values)
                w[idx] = (values[idx] - tau).clamp(min=0)
                return w
    raise AssertionError(f"no support meets the KKT conditions for {v}")


finite_floats = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(finite_floats, min_size=1, max_size=6))
@example([0.0, 0.0, 0.99999, -512.0])  # found by CI: the old distance-based oracle picked the wrong support
def test_projection_is_on_the_simplex_idempotent_and_optimal(v: list[float]) -> None:
    w = project_simplex(torch.tensor(v, dtype=torch.float64))
    assert bool((w >= 0).all())
    assert abs(float(w.sum()) - 1.0) < 1e-9
    torch.testing.assert_close(project_simplex(w), w, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, brute_force_projection(v), atol=1e-9, rtol=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.lists(finite_floats, min_size=2, max_size=40), st.floats(-1e6, 1e6))
def test_projection_ignores_a_common_shift(v: list[float], shift: float) -> None:
    base = torch.tensor(v, dtype=torch.float64)
    torch.testing.assert_close(project_simplex(base + shift), project_simplex(base), atol=1e-6, rtol=0)


def test_projection_edge_cases() -> None:
    # m = 1 is always [1]
    assert project_simplex(torch.tensor([-5.0])).tolist() == [1.0]
    # ties share the mass equally
    torch.testing.assert_close(project_simplex(torch.tensor([2.0, 2.0, -1.0])), torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(project_simplex(torch.full((5,), 7.0)), torch.full((5,), 0.2))
    # huge values: the "- 1" of the threshold must survive next to 1e30
    torch.testing.assert_close(project_simplex(torch.tensor([1e30, 0.0, -1e30])), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(
        project_simplex(torch.tensor([1e30, 1e30], dtype=torch.float64)), torch.tensor([0.5, 0.5], dtype=torch.float64)
    )
    # a point of the simplex stays put; batched input projects each row
    point = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    torch.testing.assert_close(project_simplex(point), point)
    rows = project_simplex(torch.tensor([[3.0, 0.0], [0.0, 3.0]]))
    torch.testing.assert_close(rows, torch.eye(2))
    assert project_simplex(torch.tensor([0.7, 0.1], dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="empty"):
        project_simplex(torch.tensor([]))


def test_dual_step_equals_dual_forward_composition() -> None:
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(40, 3, generator=gen, dtype=torch.float64) * 3
    eta = torch.tensor([0.5, 1.0, -0.2], dtype=torch.float64)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    divergence = get_divergence("chi2")
    _, z_expected, _ = reference.dual_forward(losses, eta, 0.6, 1.5, divergence)
    moved = eta.clone()
    z, mu, weights = reference.dual_step(losses, moved, w, 0.6, 1.5, divergence, 0.1, 1.0, 0.05)
    torch.testing.assert_close(z, z_expected)
    direction = z_expected * w
    torch.testing.assert_close(mu, torch.clamp(0.05 / direction.norm(), max=1.0))
    torch.testing.assert_close(moved, eta - 0.1 * mu * direction)
    torch.testing.assert_close(weights, reference.dual_forward(losses, moved, 0.6, 1.5, divergence)[2])


def test_clip_factor_guards_zero_norm() -> None:
    assert float(reference.clip_factor(0.5, 0.1, torch.tensor(0.0))) == 0.5
    assert float(reference.clip_factor(0.5, 0.1, torch.tensor(1.0))) == pytest.approx(0.1)
    assert float(reference.clip_factor(0.5, 0.1, torch.tensor(0.01))) == 0.5


def test_gram_step_matches_its_formula_and_refuses_non_finite_jacobians() -> None:
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    jac = torch.randn(2, 17, generator=gen, dtype=torch.float64)
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    z = torch.tensor([0.4, -1.0], dtype=torch.float64)
    before = [p.clone() for p in params]
    gram, d_norm, alpha = reference.gram_step(jac, w, params, 0.1, 1.0, 0.5, 0.01, 1e-3, torch.tensor(0.5), z)
    w0 = torch.tensor([0.3, 0.7], dtype=torch.float64)
    d = jac.T @ w0
    torch.testing.assert_close(gram, jac @ jac.T)
    torch.testing.assert_close(d_norm.double(), d.norm(), rtol=1e-6, atol=0)
    expected_alpha = min(1.0, 0.5 / float(d.norm()))
    assert float(alpha) == pytest.approx(expected_alpha, rel=1e-6)
    flat = torch.cat([p.flatten() for p in params])
    torch.testing.assert_close(flat, torch.cat([b.flatten() for b in before]) - 0.1 * expected_alpha * d)
    expected_w = project_simplex(w0 - 0.01 * (expected_alpha * (jac @ jac.T) @ w0 + 0.5 * z**2 * w0 + 1e-3 * w0))
    torch.testing.assert_close(w, expected_w)

    # A NaN anywhere in J: nothing is written, alpha = 0, the Gram reports the problem.
    jac[1, 3] = float("nan")
    kept_params, kept_w = [p.clone() for p in params], w.clone()
    gram, _, alpha = reference.gram_step(jac, w, params, 0.1, 1.0, 0.5, 0.01, 1e-3, 0.5, z)
    assert not bool(torch.isfinite(gram).all()) and float(alpha) == 0.0
    for p, kept in zip(params, kept_params):
        torch.testing.assert_close(p, kept)
    torch.testing.assert_close(w, kept_w)


def test_combine_rejects_a_size_mismatch() -> None:
    with pytest.raises(ValueError, match="columns"):
        reference.combine(torch.ones(2, 5), torch.tensor([0.5, 0.5]), [torch.zeros(4)], 0.1)


def test_dispatch_names_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "reference" in available_backends()
    assert resolve_backend("reference", "cpu") == "reference"
    assert resolve_backend(None, "cpu") in available_backends()
    with pytest.raises(ValueError, match=r"unknown backend 'fast'.*reference"):
        resolve_backend("fast", "cpu")
    monkeypatch.setenv("DRMOO_BACKEND", "reference")
    assert resolve_backend(None, "cpu") == "reference"
    monkeypatch.setenv("DRMOO_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend(None, "cpu")
    if not torch.cuda.is_available():
        monkeypatch.delenv("DRMOO_BACKEND")
        with pytest.raises(RuntimeError, match="'cuda' is not available"):
            resolve_backend("cuda", "cpu")


def test_projection_of_nan_is_nan_not_a_crash() -> None:
    assert bool(torch.isnan(project_simplex(torch.tensor([float("nan"), 0.0, 1.0]))).any())
