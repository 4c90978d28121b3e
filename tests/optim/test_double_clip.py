"""DoubleClipMGDA against a plain, step-by-step transcription of the paper's Algorithm 2."""

from __future__ import annotations

import io

import pytest
import torch
from torch import Tensor

from drmoo.optim import DoubleClipMGDA

HP = {"lr": 0.05, "pref_lr": 0.3, "rho": 1e-3, "c1": 1.0, "c2": 0.4, "f1": 1.0, "f2": 0.3, "lam": 0.6}


def chi2_conj(u: Tensor) -> Tensor:
    return 0.25 * torch.clamp(u + 2, min=0) ** 2 - 1


def chi2_conj_grad(u: Tensor) -> Tensor:
    return 0.5 * torch.clamp(u + 2, min=0)


def plain_projection(v: Tensor) -> Tensor:
    """Bisection on the threshold tau of sum(max(v - tau, 0)) = 1 (independent of the sort-based one)."""
    low, high = float(v.min()) - 1.0, float(v.max())
    for _ in range(200):
        mid = 0.5 * (low + high)
        if float(torch.clamp(v - mid, min=0).sum()) > 1.0:
            low = mid
        else:
            high = mid
    return torch.clamp(v - 0.5 * (low + high), min=0)


def plain_algorithm2(problem, steps: int, seed: int, scale: float = 1.0, resample: bool = True) -> list[dict]:
    """Algorithm 2 as printed: every quantity computed directly with autograd on the dual objective."""
    m, lam, gamma = problem.num_tasks, HP["lam"], HP["lr"]
    eta = torch.zeros(m, dtype=torch.float64)
    w = torch.full((m,), 1.0 / m, dtype=torch.float64)
    draw = problem.batches(seed)
    history = []
    for _ in range(steps):
        rows = draw()
        with torch.no_grad():
            losses = problem.losses(rows)
        z = scale * (1 - chi2_conj_grad((losses - scale * eta) / lam).mean(0))  # Z_t
        zw_norm = float((z * w).norm())
        mu = HP["f1"] if zw_norm == 0 else min(HP["f1"], HP["f2"] / zw_norm)
        eta_next = eta - gamma * mu * z * w
        grad_rows = draw() if resample else rows
        losses = problem.losses(grad_rows)
        dual = lam * chi2_conj((losses - scale * eta_next) / lam).mean(0) + scale * eta_next
        rows_of_x = []
        for i in range(m):
            grads = torch.autograd.grad(dual[i], problem.shared, retain_graph=True)
            rows_of_x.append(torch.cat([g.flatten() for g in grads]))
        x = torch.stack(rows_of_x)  # X_t^T, rows = tasks
        (head_grad,) = torch.autograd.grad(dual.sum(), problem.H)
        d = x.T @ w
        d_norm = float(d.norm())
        alpha = HP["c1"] if d_norm == 0 else min(HP["c1"], HP["c2"] / d_norm)
        with torch.no_grad():
            offset = 0
            for p in problem.shared:
                p -= gamma * alpha * d[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            problem.H -= 0.01 * head_grad  # the user's head optimizer (SGD)
        w = plain_projection(w - HP["pref_lr"] * (alpha * (x @ x.T) @ w + mu * z * z * w + HP["rho"] * w))
        eta = eta_next
        history.append({"w": w.clone(), "eta": eta.clone(), "alpha": alpha, "mu": mu, "head_grad": head_grad,
                        "params": problem.snapshot()})
    return history


@pytest.mark.parametrize("resample", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_matches_plain_algorithm_2(toy, resample: bool, scale: float) -> None:
    expected = plain_algorithm2(toy(), steps=12, seed=7, scale=scale, resample=resample)
    problem = toy()
    optimizer = DoubleClipMGDA(problem.shared, problem.num_tasks, **HP, dual_scale=scale, resample=resample,
                               backend="reference")
    heads = torch.optim.SGD([problem.H], lr=0.01)
    closure = problem.closure(7)
    clipped = 0
    for step, want in enumerate(expected):
        heads.zero_grad()
        optimizer.step(closure)
        torch.testing.assert_close(problem.H.grad, want["head_grad"], msg=f"head gradient, step {step}")
        heads.step()
        for got, ref in zip(problem.snapshot(), want["params"]):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=f"params, step {step}")
        torch.testing.assert_close(optimizer.w, want["w"], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(optimizer.eta, want["eta"], rtol=1e-10, atol=1e-12)
        assert float(optimizer.stats["alpha"]) == pytest.approx(want["alpha"], rel=1e-6)
        assert float(optimizer.stats["mu"]) == pytest.approx(want["mu"], rel=1e-6)
        clipped += want["alpha"] < HP["c1"]
    assert clipped > 0, "the test should exercise the clipping branch"
    assert not torch.allclose(optimizer.w, torch.full((3,), 1 / 3, dtype=torch.float64)), "w should move"


def test_closure_calls_per_step(toy) -> None:
    for resample, expected_calls in ((True, 2), (False, 1)):
        problem = toy()
        calls = []
        inner = problem.closure(0)

        def closure(calls: list = calls, inner=inner) -> Tensor:
            calls.append(1)
            return inner()

        optimizer = DoubleClipMGDA(problem.shared, 3, resample=resample)
        optimizer.step(closure)
        assert len(calls) == expected_calls


def test_state_dict_round_trip_continues_identically(toy) -> None:
    problem = toy()
    optimizer = DoubleClipMGDA(problem.shared, 3, **HP)
    draw = problem.batches(3)
    closure = lambda: problem.losses(draw())  # noqa: E731
    for _ in range(5):
        optimizer.step(closure)
    buffer = io.BytesIO()
    torch.save({"optim": optimizer.state_dict(), "params": problem.snapshot()}, buffer)
    rows_state = [draw() for _ in range(10)]  # the batches both continuations will see
    for rows in rows_state:
        optimizer.step(lambda rows=rows: problem.losses(rows))
    reference_after = problem.snapshot() + [optimizer.w.clone(), optimizer.eta.clone()]

    buffer.seek(0)
    saved = torch.load(buffer)
    fresh = toy()
    with torch.no_grad():
        for p, value in zip((fresh.A, fresh.c, fresh.H), saved["params"]):
            p.copy_(value)
    restored = DoubleClipMGDA(fresh.shared, 3, **HP)
    restored.load_state_dict(saved["optim"])
    assert restored.steps_taken == 5
    for rows in rows_state:
        restored.step(lambda rows=rows: fresh.losses(rows))
    for got, want in zip(fresh.snapshot() + [restored.w, restored.eta], reference_after):
        assert torch.equal(got, want)


def test_zero_gradients_fall_back_to_the_caps() -> None:
    theta = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    optimizer = DoubleClipMGDA([theta], 2, c1=0.7, f1=0.9)
    # losses that do not depend on theta's value at 0 (the gradient of x*theta^2 vanishes there)
    optimizer.step(lambda: (theta**2).sum() * torch.ones(8, 2, dtype=torch.float64) + 1.0)
    assert float(optimizer.stats["alpha"]) == pytest.approx(0.7)
    assert bool(torch.isfinite(theta).all()) and bool(torch.isfinite(optimizer.w).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_eager_m_by_m_step_is_the_masked_one_bit_for_bit_where_the_gram_is_finite(dtype: torch.dtype) -> None:
    """The Balancer / features path of an eager step drops gram_step_small's capturable masks (half its ops):
    wherever the Gram is finite -- a zero Gram (||d|| = 0: alpha = c1) included -- every output is the same."""
    from drmoo.optim.double_clip import gram_step_unmasked
    from drmoo_kernels.reference import gram_step_small

    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        m = int(torch.randint(1, 41, (1,), generator=generator))
        rows = torch.randn(m, 7, generator=generator, dtype=dtype) * 10.0 ** int(torch.randint(-15, 15, (1,),
                                                                                                generator=generator))
        gram = torch.zeros(m, m, dtype=dtype) if trial % 10 == 0 else rows @ rows.T
        w = torch.rand(m, generator=generator, dtype=dtype)
        w = w / w.sum()
        z = torch.randn(m, generator=generator, dtype=dtype)
        mu = torch.rand((), generator=generator) if trial % 2 else 0.7
        args = (gram, w, 1.0, 0.5, float(torch.rand(1, generator=generator)), 1e-5, mu, z)
        _, alpha, d_norm, w_next = gram_step_small(*args)
        _, alpha_eager, d_norm_eager, w_next_eager = gram_step_unmasked(*args)
        assert torch.equal(alpha, alpha_eager) and torch.equal(d_norm, d_norm_eager), trial
        assert torch.equal(w_next, w_next_eager) and w_next_eager.dtype == dtype, trial
