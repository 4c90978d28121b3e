"""The six baselines (MGDA, MoDo, MoCo, SDMGrad, Nash-MTL, FAMO) against plain step-by-step versions.

Each reference below is the method written out in plain float64 torch on a small multi-task linear
regression: per-task dual objectives and their gradients come from autograd through the chi^2
conjugate (not from drmoo's ``dual_forward``), the simplex projection and the weight solvers are
written here (or come from scipy), and the batches come from the same seeded stream as the
optimizer's closure.  The optimizers run on float64 parameters, so the trajectories must agree to
~1e-9 after 12 steps.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from drmoo.optim import FAMO, MGDA, MoCo, MoDo, NashMTL, SDMGrad, available, create

LAM = 0.8  # the optimizers' default lambda (the paper's main experiments), which some tests rely on
BATCH = 16
NUM_SAMPLES = 300
DIM = 4
BASELINES = ("mgda", "modo", "moco", "sdmgrad", "nashmtl", "famo")


# ------------------------------------------------------------------------------------ problem
class Stream:
    """A multi-task linear regression data set and a seeded stream of fresh batches."""

    def __init__(self, num_tasks: int, seed: int = 0, identical_tasks: bool = False) -> None:
        gen = torch.Generator().manual_seed(1234)
        # small inputs and optima keep the losses O(1): the chi^2 dual weighs samples by (1 + l/2lam)
        self.inputs = 0.5 * torch.randn(NUM_SAMPLES, DIM, generator=gen, dtype=torch.float64)
        optima = 0.5 * torch.randn(DIM, num_tasks, generator=gen, dtype=torch.float64)
        if identical_tasks:
            optima = optima[:, :1].expand(DIM, num_tasks)
        noise = 0.2 * torch.randn(NUM_SAMPLES, num_tasks, generator=gen, dtype=torch.float64)
        self.targets = self.inputs @ optima + noise
        if identical_tasks:
            self.targets = self.targets[:, :1].expand(NUM_SAMPLES, num_tasks).clone()
        self.generator = torch.Generator().manual_seed(seed)
        self.rows = torch.zeros(0, dtype=torch.long)
        self.draws = 0

    def next_rows(self) -> Tensor:
        self.rows = torch.randint(0, NUM_SAMPLES, (BATCH,), generator=self.generator)
        self.draws += 1
        return self.rows


def per_sample_losses(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
    theta, bias = params
    return ((inputs @ theta + bias)[:, None] - targets) ** 2


def fresh_params(dtype: torch.dtype = torch.float64) -> list[Tensor]:
    gen = torch.Generator().manual_seed(7)
    theta = 0.5 * torch.randn(DIM, generator=gen)
    return [theta.to(dtype).requires_grad_(), torch.zeros(1, dtype=dtype).requires_grad_()]


def make_closure(params: list[Tensor], stream: Stream, loss_fn: Callable[..., Tensor] = per_sample_losses) -> Callable:
    def closure(same_batch: bool = False) -> Tensor:
        rows = stream.rows if same_batch else stream.next_rows()
        dtype = params[0].dtype
        return loss_fn(params, stream.inputs[rows].to(dtype), stream.targets[rows].to(dtype))

    return closure


# -------------------------------------------------------------------------- plain references
def chi2_conj(u: Tensor) -> Tensor:
    return 0.25 * torch.clamp(u + 2.0, min=0.0) ** 2 - 1.0


def reference_dual(params: list[Tensor], eta: Tensor, rows: Tensor, stream: Stream) -> tuple[Tensor, Tensor, Tensor]:
    """Dual objectives L^i, theta-Jacobian [m, n] and z = dL^i/deta^i, all by autograd."""
    leaves = [p.detach().clone().requires_grad_() for p in params]
    eta_leaf = eta.detach().clone().requires_grad_()
    losses = per_sample_losses(leaves, stream.inputs[rows], stream.targets[rows])
    objective = LAM * chi2_conj((losses - eta_leaf) / LAM).mean(dim=0) + eta_leaf
    rows_of_jacobian = []
    for i in range(objective.shape[0]):
        grads = torch.autograd.grad(objective[i], leaves, retain_graph=True)
        rows_of_jacobian.append(torch.cat([g.reshape(-1) for g in grads]))
    (z,) = torch.autograd.grad(objective.sum(), eta_leaf)
    return objective.detach(), torch.stack(rows_of_jacobian), z


def project(v: Tensor) -> Tensor:
    """Euclidean projection onto the simplex, written out (sort, largest admissible k)."""
    u = torch.sort(v, descending=True).values
    cumulative = torch.cumsum(u, 0)
    k = max(j for j in range(1, len(v) + 1) if u[j - 1] - (cumulative[j - 1] - 1.0) / j > 0)
    tau = (cumulative[k - 1] - 1.0) / k
    return torch.clamp(v - tau, min=0.0)


def step_params(params: list[Tensor], direction: Tensor, lr: float) -> list[Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(p - lr * direction[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


def flat(params: list[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def scipy_min_norm(K: Tensor) -> Tensor:
    from scipy.optimize import minimize

    Kn = K.numpy()
    m = Kn.shape[0]
    result = minimize(
        lambda w: w @ Kn @ w, [1.0 / m] * m, jac=lambda w: 2 * Kn @ w, bounds=[(0, 1)] * m, method="SLSQP",
        constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}], options={"ftol": 1e-16, "maxiter": 2000},
    )
    return torch.as_tensor(result.x)


def scipy_nash(K: Tensor) -> Tensor:
    import numpy as np
    from scipy.optimize import minimize

    Kn = K.numpy()
    m = Kn.shape[0]
    result = minimize(
        lambda a: 0.5 * a @ Kn @ a - np.log(a).sum(), [1.0] * m, jac=lambda a: Kn @ a - 1.0 / a,
        bounds=[(1e-9, None)] * m, method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000},
    )
    return torch.as_tensor(result.x)


class Reference:
    """Plain (theta, eta, w) state; each method a few lines on top of ``reference_dual``."""

    def __init__(self, num_tasks: int) -> None:
        self.stream = Stream(num_tasks)
        self.params = [p.detach() for p in fresh_params()]
        self.eta = torch.zeros(num_tasks, dtype=torch.float64)
        self.w = torch.full((num_tasks,), 1.0 / num_tasks, dtype=torch.float64)
        self.m = num_tasks

    def batch(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        rows = self.stream.next_rows()
        objective, J, z = reference_dual(self.params, self.eta, rows, self.stream)
        return objective, J, z, rows

    def joint_step(self, J: Tensor, z: Tensor, weights: Tensor, lr: float) -> None:
        self.params = step_params(self.params, J.T @ weights, lr)
        self.eta = self.eta - lr * z * weights


def run_mgda(ref: Reference, steps: int, lr: float, beta: float, rho: float, solver: str) -> None:
    for _ in range(steps):
        _, J, z, _ = ref.batch()
        K = J @ J.T + torch.diag(z * z)
        ref.w = project(ref.w - beta * (K @ ref.w + rho * ref.w)) if solver == "one_step" else scipy_min_norm(K)
        ref.joint_step(J, z, ref.w, lr)


def run_modo(ref: Reference, steps: int, lr: float, beta: float, rho: float) -> None:
    for _ in range(steps):
        (_, J1, z1, _), (_, J2, z2, _), (_, J3, z3, _) = ref.batch(), ref.batch(), ref.batch()
        cross = J1 @ (J2.T @ ref.w) + z1 * z2 * ref.w
        ref.w = project(ref.w - beta * (cross + rho * ref.w))
        ref.joint_step(J3, z3, ref.w, lr)


def run_moco(ref: Reference, steps: int, lr: float, beta: float, rho: float, ema: float) -> None:
    Y = torch.zeros(ref.m, DIM + 1, dtype=torch.float64)
    y_eta = torch.zeros(ref.m, dtype=torch.float64)
    for _ in range(steps):
        _, J, z, _ = ref.batch()
        Y = ema * Y + (1 - ema) * J
        y_eta = ema * y_eta + (1 - ema) * z
        ref.w = project(ref.w - beta * ((Y @ Y.T + torch.diag(y_eta**2) + rho * torch.eye(ref.m)) @ ref.w))
        ref.joint_step(Y, y_eta, ref.w, lr)


def run_sdmgrad(ref: Reference, steps: int, lr: float, beta: float, rho: float, lam_s: float, inner: int,
                momentum: float) -> None:
    velocity = torch.zeros(ref.m, dtype=torch.float64)
    for _ in range(steps):
        (_, J1, z1, _), (_, J2, z2, _), (_, J3, z3, _) = ref.batch(), ref.batch(), ref.batch()
        A = J1 @ J2.T + torch.diag(z1 * z2)
        s = torch.sqrt(torch.clamp(torch.diagonal(A), min=0)).mean()
        A = A / s**2
        b = A @ torch.full((ref.m,), 1.0 / ref.m, dtype=torch.float64)
        for _ in range(inner):
            velocity = momentum * velocity + A @ ref.w + lam_s * b + rho * ref.w
            ref.w = project(ref.w - beta * velocity)
        c = (ref.w + lam_s / ref.m) / (1 + lam_s)
        ref.joint_step(J3, z3, c, lr)


def run_nash(ref: Reference, steps: int, lr: float, update_every: int) -> list[Tensor]:
    alphas, alpha = [], None
    for t in range(steps):
        _, J, z, _ = ref.batch()
        if t % update_every == 0:
            alpha = scipy_nash(J @ J.T + torch.diag(z * z))
        assert alpha is not None
        d_theta, d_eta = J.T @ alpha, z * alpha
        norm = torch.sqrt(d_theta @ d_theta + d_eta @ d_eta)
        clip = min(1.0, 1.0 / float(norm))
        ref.params = step_params(ref.params, clip * d_theta, lr)
        ref.eta = ref.eta - lr * clip * d_eta
        alphas.append(alpha)
    return alphas


def run_famo(ref: Reference, steps: int, lr: float, logit_lr: float, decay: float, eps: float = 1e-8) -> Tensor:
    logits = torch.zeros(ref.m, dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([logits], lr=logit_lr, weight_decay=decay)
    for _ in range(steps):
        objective, J, z, rows = ref.batch()
        p = torch.softmax(logits.detach(), 0)
        D = objective + eps  # loss floor 0
        c = (p / D) / (p / D).sum()
        ref.joint_step(J, z, c, lr)
        after, _, _ = reference_dual(ref.params, ref.eta, rows, ref.stream)
        delta = torch.log(D) - torch.log(after + eps)
        adam.zero_grad()
        torch.softmax(logits, 0).backward(delta)  # vector-Jacobian product of softmax: p (.) (delta - p^T delta)
        adam.step()
        ref.w = c
    return logits.detach()


def run_optimizer(opt_factory: Callable[[list[Tensor]], Any], num_tasks: int, steps: int) -> tuple[Any, list[Tensor]]:
    params = fresh_params()
    stream = Stream(num_tasks)
    opt = opt_factory(params)
    closure = make_closure(params, stream)
    for _ in range(steps):
        opt.step(closure)
    return opt, params


def assert_matches(opt: Any, params: list[Tensor], ref: Reference, tol: float = 1e-9) -> None:
    torch.testing.assert_close(flat(params), flat(ref.params), rtol=tol, atol=tol)
    torch.testing.assert_close(opt.eta.double(), ref.eta, rtol=tol, atol=tol)
    torch.testing.assert_close(opt.w.double(), ref.w, rtol=tol, atol=tol)
    # the run must actually have moved, or the comparison proves nothing
    assert float((flat(params) - flat(fresh_params())).norm()) > 1e-2


STEPS = 12


# ------------------------------------------------------------------------- trajectory tests
@pytest.mark.parametrize("solver", ["one_step", "min_norm"])
def test_mgda_matches_plain_implementation(solver: str) -> None:
    hp = {"lr": 0.1, "pref_lr": 0.2, "rho": 1e-2}
    opt, params = run_optimizer(lambda p: MGDA(p, 3, lam=LAM, solver=solver, **hp), 3, STEPS)
    ref = Reference(3)
    run_mgda(ref, STEPS, hp["lr"], hp["pref_lr"], hp["rho"], solver)
    assert_matches(opt, params, ref, tol=1e-9 if solver == "one_step" else 1e-6)
    if solver == "one_step":
        assert float((opt.w.double() - 1 / 3).abs().max()) > 1e-3  # w moved off uniform


def test_modo_matches_plain_implementation() -> None:
    hp = {"lr": 0.1, "pref_lr": 0.2, "rho": 1e-2}
    opt, params = run_optimizer(lambda p: MoDo(p, 3, lam=LAM, **hp), 3, STEPS)
    ref = Reference(3)
    run_modo(ref, STEPS, hp["lr"], hp["pref_lr"], hp["rho"])
    assert_matches(opt, params, ref)
    assert opt.stats["batches"] == 3


def test_moco_matches_plain_implementation() -> None:
    hp = {"lr": 0.1, "pref_lr": 0.5, "rho": 1e-2, "ema": 0.8}
    opt, params = run_optimizer(lambda p: MoCo(p, 3, lam=LAM, **hp), 3, STEPS)
    ref = Reference(3)
    run_moco(ref, STEPS, hp["lr"], hp["pref_lr"], hp["rho"], hp["ema"])
    assert_matches(opt, params, ref)


def test_sdmgrad_matches_plain_implementation() -> None:
    hp = {"lr": 0.1, "pref_lr": 0.1, "rho": 1e-2, "sdm_lambda": 0.3, "inner_steps": 3, "momentum": 0.5}
    opt, params = run_optimizer(lambda p: SDMGrad(p, 3, lam=LAM, **hp), 3, STEPS)
    ref = Reference(3)
    run_sdmgrad(ref, STEPS, hp["lr"], hp["pref_lr"], hp["rho"], hp["sdm_lambda"], hp["inner_steps"], hp["momentum"])
    assert_matches(opt, params, ref)


def test_nashmtl_matches_plain_implementation_with_weight_reuse() -> None:
    opt, params = run_optimizer(lambda p: NashMTL(p, 3, lam=LAM, lr=0.1, update_every=3), 3, STEPS)
    ref = Reference(3)
    alphas = run_nash(ref, STEPS, 0.1, update_every=3)
    ref.w = alphas[-1] / alphas[-1].sum()
    assert_matches(opt, params, ref, tol=1e-7)  # scipy's L-BFGS-B solves alpha to ~1e-9
    torch.testing.assert_close(opt.stats["alpha"], alphas[-1], rtol=1e-6, atol=0)


def test_famo_matches_plain_implementation() -> None:
    opt, params = run_optimizer(lambda p: FAMO(p, 3, lam=LAM, lr=0.1, pref_lr=0.05, logit_decay=1e-2), 3, STEPS)
    ref = Reference(3)
    logits = run_famo(ref, STEPS, 0.1, 0.05, 1e-2)
    assert_matches(opt, params, ref)
    torch.testing.assert_close(opt.stats["logits"], logits, rtol=1e-9, atol=1e-12)
    assert float(logits.abs().max()) > 1e-2  # the logits moved


def test_sdmgrad_reduces_to_modo() -> None:
    """lambda_s = 0, S = 1, momentum 0, no normalization: SDMGrad's step is MoDo's (rho = 0)."""
    common = {"lr": 0.1, "pref_lr": 0.3, "rho": 0.0, "lam": LAM}
    sdm, sdm_params = run_optimizer(
        lambda p: SDMGrad(p, 3, sdm_lambda=0.0, inner_steps=1, momentum=0.0, normalize=False, **common), 3, STEPS
    )
    modo, modo_params = run_optimizer(lambda p: MoDo(p, 3, **common), 3, STEPS)
    torch.testing.assert_close(flat(sdm_params), flat(modo_params), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(sdm.w, modo.w, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(sdm.eta, modo.eta, rtol=1e-11, atol=1e-12)
    assert float((modo.w - 1 / 3).abs().max()) > 1e-3


# ------------------------------------------------------------------------------ the solvers
def test_min_norm_two_tasks_closed_form_and_exact_ends() -> None:
    from drmoo.optim.mgda import min_norm_weights

    gen = torch.Generator().manual_seed(3)
    start = torch.full((2,), 0.5, dtype=torch.float64)
    for _ in range(50):
        G = torch.randn(2, 5, generator=gen, dtype=torch.float64)
        K = G @ G.T
        expected = float(torch.clamp((K[1, 1] - K[0, 1]) / (K[0, 0] + K[1, 1] - 2 * K[0, 1]), 0, 1))
        w = min_norm_weights(K, start)
        assert float(w[0]) == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert float(w.sum()) == pytest.approx(1.0, abs=1e-15)
    # g2 = 3 g1: the min-norm point is g1 itself, weight exactly 1 (not 0.999)
    G = torch.tensor([[1.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    assert min_norm_weights(G @ G.T, start).tolist() == [1.0, 0.0]
    # identical gradients: the denominator vanishes, 0.5 each
    G = torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=torch.float64)
    assert min_norm_weights(G @ G.T, start).tolist() == [0.5, 0.5]


def test_min_norm_three_tasks_against_a_simplex_grid() -> None:
    from drmoo.optim.mgda import min_norm_weights

    gen = torch.Generator().manual_seed(4)
    steps = 300
    i, j = torch.meshgrid(torch.arange(steps + 1), torch.arange(steps + 1), indexing="ij")
    keep = i + j <= steps
    grid = torch.stack([i[keep], j[keep], steps - i[keep] - j[keep]], dim=1).double() / steps
    for n in (2, 3, 6):
        for _ in range(6):
            G = torch.randn(3, n, generator=gen, dtype=torch.float64)
            K = G @ G.T
            w = min_norm_weights(K, torch.full((3,), 1 / 3, dtype=torch.float64))
            value = float(w @ K @ w)
            grid_best = float(torch.einsum("gi,ij,gj->g", grid, K, grid).min())
            assert value <= grid_best + 1e-12  # never worse than the best grid point
            assert grid_best - value <= 5e-4 * float(K.diagonal().max())  # and the grid gets close
            assert float(w.min()) >= 0 and float(w.sum()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("m, n", [(3, 2), (4, 3), (5, 10), (8, 3), (8, 20), (12, 30)])
def test_min_norm_against_scipy_qp(m: int, n: int) -> None:
    from drmoo.optim.mgda import min_norm_weights

    gen = torch.Generator().manual_seed(m * 100 + n)
    for _ in range(4):
        G = torch.randn(m, n, generator=gen, dtype=torch.float64) * torch.rand(m, 1, generator=gen, dtype=torch.float64)
        K = G @ G.T
        w = min_norm_weights(K, torch.full((m,), 1 / m, dtype=torch.float64))
        w_qp = scipy_min_norm(K)
        scale = float(K.diagonal().max())
        assert float(w @ K @ w) <= float(w_qp @ K @ w_qp) + 1e-9 * scale
        # KKT: (K w)_i >= w^T K w everywhere, with equality on the support
        Kw, value = K @ w, float(w @ K @ w)
        assert float(Kw.min()) >= value - 1e-7 * scale


def test_nash_weights_solve_k_alpha_equals_inverse_alpha() -> None:
    from drmoo.optim.nashmtl import nash_weights

    gen = torch.Generator().manual_seed(5)
    for m, n in ((1, 4), (2, 5), (3, 2), (4, 4), (6, 40), (8, 5)):
        # task gradient norms spread over four orders of magnitude
        row_scales = 10 ** torch.empty(m, 1, dtype=torch.float64).uniform_(-2, 2, generator=gen)
        G = torch.randn(m, n, generator=gen, dtype=torch.float64) * row_scales
        K = G @ G.T + torch.diag(torch.rand(m, generator=gen, dtype=torch.float64) * 1e-3)
        alpha = nash_weights(K)
        assert bool((alpha > 0).all())
        residual = torch.linalg.vector_norm(K @ alpha - 1 / alpha) / torch.linalg.vector_norm(1 / alpha)
        assert float(residual) < 1e-6, (m, n, float(residual))


def test_nash_weights_degenerate_gram_matrices() -> None:
    from drmoo.optim.nashmtl import nash_weights

    g = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.5, -1.0, 3.0]], dtype=torch.float64)
    alpha = nash_weights(g @ g.T)
    assert float(alpha[1]) == 0.0  # a vanished task gradient is left out of the bargaining
    live = torch.tensor([0, 2])
    K_live = (g @ g.T)[live][:, live]
    assert float(torch.linalg.vector_norm(K_live @ alpha[live] - 1 / alpha[live])) < 1e-6 * float(
        torch.linalg.vector_norm(1 / alpha[live])
    )
    # opposite gradients: no solution exists; the ridge keeps alpha finite and positive
    g = torch.tensor([[1.0, 2.0], [-2.0, -4.0]], dtype=torch.float64)
    alpha = nash_weights(g @ g.T)
    assert bool(torch.isfinite(alpha).all()) and bool((alpha > 0).all())
    assert torch.equal(nash_weights(torch.zeros(2, 2, dtype=torch.float64)), torch.zeros(2, dtype=torch.float64))


def test_nash_weights_match_cvxpy() -> None:
    import cvxpy as cp  # a dev requirement (requirements-dev.txt): missing means a broken setup, not a skip

    from drmoo.optim.nashmtl import nash_weights

    gen = torch.Generator().manual_seed(6)
    for m, n in ((2, 6), (3, 8), (5, 12)):
        G = torch.randn(m, n, generator=gen, dtype=torch.float64)
        alpha = nash_weights(G @ G.T)
        a = cp.Variable(m)
        problem = cp.Problem(cp.Minimize(0.5 * cp.sum_squares(G.numpy().T @ a) - cp.sum(cp.log(a))))
        problem.solve()
        torch.testing.assert_close(alpha, torch.as_tensor(a.value), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------- FAMO
def test_famo_decreases_both_losses_of_two_quadratics() -> None:
    centres = torch.tensor([[2.0, 0.0], [0.0, -1.0]])
    theta = torch.tensor([-1.0, 2.0], requires_grad=True)
    noise = torch.Generator().manual_seed(8)
    current: dict[str, Tensor] = {}

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            current["x"] = 0.1 * torch.randn(32, 2, generator=noise)
        shifted = theta + current["x"]  # per-sample perturbation: a stochastic quadratic per task
        return torch.stack([((shifted - c) ** 2).sum(dim=1) for c in centres], dim=1)

    opt = FAMO([theta], 2, lr=0.02, pref_lr=0.025)
    opt.step(closure)
    first = opt.stats["dual_objective"].clone()
    for _ in range(200):
        opt.step(closure)
    last = opt.stats["dual_objective"]
    assert bool((last < 0.5 * first).all()), (first, last)


def test_famo_reevaluate_argument_and_plain_closure() -> None:
    params, stream = fresh_params(), Stream(2)
    closure = make_closure(params, stream)

    def plain_closure() -> Tensor:
        return closure()

    opt = FAMO(params, 2, lr=0.1)
    before = flat(params)
    opt.step(plain_closure, reevaluate=lambda: closure(same_batch=True))  # same-batch form
    assert stream.draws == 1 and opt.stats["batches"] == 1 and "dual_objective_after" in opt.stats
    assert not torch.equal(flat(params), before)
    logits = opt.state["drmoo"]["logits"].clone()
    assert not bool((logits == 0).all()) and float(opt.state["drmoo"]["pending"]) == 0.0
    # A plain closure: the next-batch form, one draw per step, the logit update waits for the next step.
    opt.step(plain_closure)
    assert stream.draws == 2 and torch.equal(opt.state["drmoo"]["logits"], logits)
    assert float(opt.state["drmoo"]["pending"]) == 1.0 and "dual_objective_after" not in opt.stats
    opt.step(plain_closure)
    assert stream.draws == 3 and not torch.equal(opt.state["drmoo"]["logits"], logits)


def test_famo_restores_parameters_when_the_reevaluation_is_nan() -> None:
    params, stream = fresh_params(), Stream(2)
    closure = make_closure(params, stream)

    def closure_nan_on_reevaluation(same_batch: bool = False) -> Tensor:
        losses = closure(same_batch)
        return losses * float("nan") if same_batch else losses

    opt = FAMO(params, 2, lr=0.1)
    opt.step(closure)
    snapshot = (flat(params), opt.eta.clone(), opt.w.clone(), opt.state["drmoo"]["logits"].clone())
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(closure_nan_on_reevaluation)
    assert torch.equal(flat(params), snapshot[0]) and torch.equal(opt.eta, snapshot[1])
    assert torch.equal(opt.w, snapshot[2]) and torch.equal(opt.state["drmoo"]["logits"], snapshot[3])
    assert opt.steps_taken == 1


# -------------------------------------------------------------------------- degenerate cases
def small_hparams(name: str) -> dict[str, Any]:
    # 30 Newton iterations: plenty for these well-conditioned problems, and a third of the run time
    return {"lr": 0.1, "solver_iters": 30} if name == "nashmtl" else {"lr": 0.1, "pref_lr": 0.1}


@pytest.mark.parametrize("name", BASELINES)
def test_identical_task_gradients(name: str) -> None:
    params, stream = fresh_params(), Stream(3, identical_tasks=True)
    opt = create(name, params, 3, **small_hparams(name))
    closure = make_closure(params, stream)
    for _ in range(5):
        opt.step(closure)
    assert bool(torch.isfinite(flat(params)).all()) and bool(torch.isfinite(opt.eta).all())
    assert float(opt.w.sum()) == pytest.approx(1.0, abs=1e-6) and bool((opt.w >= 0).all())
    assert math.isfinite(float(opt.stats["balanced_grad_norm"]))
    assert float((flat(params) - flat(fresh_params())).norm()) > 0


@pytest.mark.parametrize("name", BASELINES)
def test_one_zero_task_gradient(name: str) -> None:
    """Task 2's loss is identically 0: its theta gradient is 0 and, at eta = 0, so is z (chi^2)."""

    def losses_with_a_dead_task(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
        live = per_sample_losses(params, inputs, targets)
        return torch.cat([live[:, :2], 0.0 * live[:, 2:]], dim=1)

    params, stream = fresh_params(), Stream(3)
    opt = create(name, params, 3, **small_hparams(name))
    closure = make_closure(params, stream, losses_with_a_dead_task)
    for _ in range(5):
        opt.step(closure)
    assert bool(torch.isfinite(flat(params)).all()) and bool(torch.isfinite(opt.eta).all())
    assert bool(torch.isfinite(opt.w).all()) and float(opt.w.sum()) == pytest.approx(1.0, abs=1e-6)
    for key in ("balanced_grad_norm", "theta_grad_norm", "dual_objective"):
        assert bool(torch.isfinite(opt.stats[key]).all()), key
    if name == "nashmtl":  # the dead task takes no part in the bargaining
        assert float(opt.stats["alpha"][2]) == 0.0 and bool((opt.stats["alpha"][:2] > 0).all())


@pytest.mark.parametrize("name", BASELINES)
def test_single_task(name: str) -> None:
    params, stream = fresh_params(), Stream(1)
    opt = create(name, params, 1, **small_hparams(name))
    closure = make_closure(params, stream)
    first = None
    for _ in range(30):
        objective = opt.step(closure)
        first = objective if first is None else first
    assert opt.w.tolist() == [1.0]
    assert bool(torch.isfinite(flat(params)).all())
    assert float(objective[0]) < float(first[0])  # one task: plain descent on its dual objective


@pytest.mark.parametrize("name", BASELINES)
def test_nan_loss_raises_and_updates_nothing(name: str) -> None:
    params, stream = fresh_params(), Stream(3)
    opt = create(name, params, 3, **small_hparams(name))
    closure = make_closure(params, stream)
    opt.step(closure)
    calls = {"n": 0}

    def poisoned(same_batch: bool = False) -> Tensor:
        calls["n"] += 1
        losses = closure(same_batch)
        # poison the LAST fresh batch of the step: the earlier ones have already been processed
        return losses * float("nan") if calls["n"] == opt.stats["batches"] and not same_batch else losses

    snapshot = copy.deepcopy(opt.state_dict()), flat(params)
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(poisoned)
    assert torch.equal(flat(params), snapshot[1])
    assert_same_state(opt.state_dict(), snapshot[0])


@pytest.mark.parametrize("name", BASELINES)
def test_non_finite_gradient_raises_and_updates_nothing(name: str) -> None:
    """Finite losses whose gradient is NaN (sqrt at 0): caught by the Jacobian / direction checks."""

    def sqrt_losses(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
        theta, bias = params
        out = torch.sqrt(((inputs @ theta) * 0.0 + bias)[:, None].abs()) + 0.0 * targets
        return out.expand(-1, targets.shape[1])

    params = [torch.ones(DIM, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    params = [p.requires_grad_() for p in params]
    stream = Stream(3)
    opt = create(name, params, 3, **small_hparams(name))
    snapshot = copy.deepcopy(opt.state_dict()), flat(params)
    with pytest.raises(ValueError, match="non-finite gradients"):
        opt.step(make_closure(params, stream, sqrt_losses))
    assert torch.equal(flat(params), snapshot[1])
    assert_same_state(opt.state_dict(), snapshot[0])


def assert_same_state(current: dict[str, Any], saved: dict[str, Any]) -> None:
    mine, theirs = current["state"]["drmoo"], saved["state"]["drmoo"]
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, Tensor):
            assert torch.equal(mine[key], value), key
        else:
            assert mine[key] == value, key


# ----------------------------------------------------------------------- heads, state_dict
@pytest.mark.parametrize("name", BASELINES)
def test_heads_get_the_raw_gradient_of_their_task(name: str) -> None:
    """Per-task scale heads: head i's grad is d L^i / d head_i on the step batch, whatever the weights."""
    theta = fresh_params()
    heads = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    stream = Stream(3)
    seen: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        rows = stream.rows if same_batch else stream.next_rows()
        if not same_batch:
            seen.append(rows)
        prediction = (stream.inputs[rows] @ theta[0] + theta[1])[:, None] * heads
        return (prediction - stream.targets[rows]) ** 2

    # Nash-MTL: the second step reuses alpha and takes the one-backward path, checked here
    extra = {"update_every": 2} if name == "nashmtl" else {}
    opt = create(name, theta, 3, **small_hparams(name), **extra)
    opt.step(closure)
    heads.grad = None
    eta_before = opt.eta.clone()
    theta_before = [p.detach().clone() for p in theta]
    opt.step(closure)
    rows = seen[-1]  # every method steps on its last fresh batch
    head_leaf = heads.detach().clone().requires_grad_()
    prediction = (stream.inputs[rows] @ theta_before[0] + theta_before[1])[:, None] * head_leaf
    losses = (prediction - stream.targets[rows]) ** 2
    objective = LAM * chi2_conj((losses - eta_before) / LAM).mean(dim=0) + eta_before
    (expected,) = torch.autograd.grad(objective.sum(), head_leaf)
    assert heads.grad is not None
    torch.testing.assert_close(heads.grad, expected, rtol=1e-10, atol=1e-12)


STATEFUL = {
    "moco": {"lr": 0.1, "pref_lr": 0.2, "ema": 0.9},
    "famo": {"lr": 0.1, "pref_lr": 0.05},
    "sdmgrad": {"lr": 0.1, "pref_lr": 0.1, "inner_steps": 2},
    "nashmtl": {"lr": 0.1, "update_every": 3, "solver_iters": 30},
    "mgda": {"lr": 0.1, "pref_lr": 0.2, "solver": "min_norm"},
    "modo": {"lr": 0.1, "pref_lr": 0.2},
}


@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_dict_round_trip_continues_identically(name: str) -> None:
    params, stream = fresh_params(), Stream(3)
    opt = create(name, params, 3, **STATEFUL[name])
    closure = make_closure(params, stream)
    for _ in range(4):
        opt.step(closure)
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]
    saved_stream = stream.generator.get_state()
    for _ in range(5):
        opt.step(closure)

    resumed_params = [p.clone().requires_grad_() for p in saved_params]
    resumed_stream = Stream(3)
    resumed_stream.generator.set_state(saved_stream)
    resumed = create(name, resumed_params, 3, **STATEFUL[name])
    resumed.load_state_dict(saved)
    resumed_closure = make_closure(resumed_params, resumed_stream)
    for _ in range(5):
        resumed.step(resumed_closure)
    assert torch.equal(flat(resumed_params), flat(params))
    assert_same_state(resumed.state_dict(), opt.state_dict())


def test_state_dict_from_another_method_is_rejected() -> None:
    params = fresh_params()
    mgda_state = MGDA(params, 3).state_dict()
    with pytest.raises(ValueError, match="saved by MGDA, not by MoCo"):
        MoCo(params, 3).load_state_dict(copy.deepcopy(mgda_state))


# ------------------------------------------------------------------------------- registry
@pytest.mark.parametrize("name", BASELINES)
def test_create_and_presets(name: str) -> None:
    assert name in available()
    cls = available()[name]
    for preset in cls.PRESETS:
        params = fresh_params()
        opt = create(name, params, 3, **cls.preset(preset))
        assert isinstance(opt, cls)
        opt.step(make_closure(params, Stream(3)))
        assert bool(torch.isfinite(opt.stats["balanced_grad_norm"]))
    assert "multimnist" in cls.PRESETS
    with pytest.raises(ValueError, match="no preset"):
        cls.preset("imagenet")


def test_constructor_validation() -> None:
    params = fresh_params()
    with pytest.raises(ValueError, match="solver"):
        MGDA(params, 2, solver="exact")
    with pytest.raises(ValueError, match="ema"):
        MoCo(params, 2, ema=1.0)
    with pytest.raises(ValueError, match="inner_steps"):
        SDMGrad(params, 2, inner_steps=0)
    with pytest.raises(ValueError, match="update_every"):
        NashMTL(params, 2, update_every=0)
    with pytest.raises(ValueError, match="loss_floor"):
        FAMO(params, 3, loss_floor=[0.0, 1.0])
    with pytest.raises(ValueError, match="lr"):
        MoDo(params, 2, lr=-1.0)


def test_float32_parameters_track_the_float64_run() -> None:
    """The usual float32 model: same trajectory as float64 up to float32 rounding."""
    for name in BASELINES:
        runs = []
        for dtype in (torch.float32, torch.float64):
            params, stream = fresh_params(dtype), Stream(3)
            opt = create(name, params, 3, **small_hparams(name))
            closure = make_closure(params, stream)
            for _ in range(5):
                opt.step(closure)
            runs.append(flat(params).double())
        torch.testing.assert_close(runs[0], runs[1], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["famo", "nashmtl"])
def test_one_backward_through_the_shared_part(name: str) -> None:
    """FAMO and Nash-MTL's reuse steps: one backward through the backbone; the heads' pass stops above it."""
    theta = fresh_params()
    heads = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    stream = Stream(3)
    backbone_backwards = {"n": 0}

    def closure(same_batch: bool = False) -> Tensor:
        rows = stream.rows if same_batch else stream.next_rows()
        features = stream.inputs[rows] @ theta[0] + theta[1]
        if features.requires_grad:
            features.register_hook(lambda grad: backbone_backwards.__setitem__("n", backbone_backwards["n"] + 1))
        return (features[:, None] * heads - stream.targets[rows]) ** 2

    extra = {"update_every": 2} if name == "nashmtl" else {}
    opt = create(name, theta, 3, **small_hparams(name), **extra)
    # Nash-MTL's weight-update step takes m backward passes; FAMO's first step takes m for the
    # heads-as-shared check (it forms no Jacobian to read it from), and its later steps none.
    opt.step(closure)
    assert backbone_backwards["n"] == 3 + (name == "famo")
    backbone_backwards["n"] = 0
    opt.step(closure)
    assert backbone_backwards["n"] == 1
    assert heads.grad is not None
