"""MGDA on the DR dual: the stochastic one-step preference update, or the exact min-norm weights."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._base import Closure, ParamsT, check_positive
from ._joint import (
    TINY,
    JointBaseline,
    check_count,
    common_defaults,
    joint_gram,
    joint_norm,
    project_simplex,
    simplex_step,
)

SOLVERS = ("one_step", "min_norm")


# Exact enumeration of the faces of the simplex up to this many tasks (2^m - 1 tiny systems).
EXACT_MAX_TASKS = 10
# Relative ridge that makes every face's equality-constrained problem uniquely solvable.
FACE_RIDGE = 1e-12


def min_norm_weights(gram: Tensor, start: Tensor, *, max_iter: int = 500, tol: float = 1e-12) -> Tensor:
    r"""w* = argmin_{w in simplex} w^T K w, in float64 on K's device, with no host synchronisation.

    * m = 1: [1].
    * m = 2: the closed form w^1 = clip((K22 - K12) / (K11 + K22 - 2 K12), 0, 1), exactly 0 or 1 at
      the ends, 0.5 when the denominator vanishes (g1 = g2: every w is optimal).
    * 3 <= m <= 10: exact.  The minimizer lies in the relative interior of some face of the simplex,
      where it is the minimizer of w^T K w on that face's affine hull -- an equality-constrained
      quadratic problem, one small KKT system.  All 2^m - 1 faces are solved in one batched call
      (K scaled by its largest diagonal entry, plus a 1e-12 ridge so that every system is
      nonsingular), every solution is projected onto the simplex (so every candidate is feasible)
      and the candidate of least w^T K w wins; among ties (within 1e-12, e.g. identical gradients)
      the one nearest ``start``.
    * m > 10: accelerated projected gradient (FISTA with the gradient-based momentum restart) from
      ``start``, step 1/L with L = 2 min(trace K, largest absolute row sum) >= the gradient's
      Lipschitz constant; an iterate whose Frank-Wolfe gap 2 (w^T K w - min_i (K w)_i) -- an upper
      bound on its suboptimality -- is at most ``tol`` (relative to the largest diagonal entry) is
      frozen; ``max_iter`` iterations run (a fixed count: stopping early would need a host sync).
      Rank-deficient K can leave a visible gap at the cap.
    """
    m = gram.shape[0]
    K = gram.double()
    if m == 1:
        return torch.ones(1, dtype=torch.float64, device=K.device)
    if m == 2:
        denominator = K[0, 0] + K[1, 1] - 2.0 * K[0, 1]
        degenerate = denominator <= 1e-12 * torch.clamp(K[0, 0] + K[1, 1], min=TINY)
        safe = torch.where(degenerate, torch.ones_like(denominator), denominator)
        exact = torch.clamp((K[1, 1] - K[0, 1]) / safe, 0.0, 1.0)
        first = torch.where(degenerate, torch.full_like(denominator, 0.5), exact)
        return torch.stack([first, 1.0 - first])
    K = K / torch.clamp(torch.diagonal(K).max(), min=TINY)
    if m <= EXACT_MAX_TASKS:
        return _min_norm_by_faces(K, start.double())
    return _min_norm_by_projected_gradient(K, start.double(), max_iter, tol)


def _min_norm_by_faces(K: Tensor, start: Tensor) -> Tensor:
    m, device = K.shape[0], K.device
    bits = torch.arange(m, device=device)
    faces = ((torch.arange(1, 2**m, device=device)[:, None] >> bits) & 1).bool()  # [F, m] supports
    on_face = faces.double()
    ridged = K + FACE_RIDGE * torch.eye(m, dtype=K.dtype, device=device)
    # KKT of min w^T K w s.t. sum w = 1, w_j = 0 off the face:  [K_SS 1; 1^T 0] [w; nu] = [0; 1],
    # with identity rows/columns pinning the off-face coordinates to 0.
    system = torch.zeros(faces.shape[0], m + 1, m + 1, dtype=K.dtype, device=device)
    system[:, :m, :m] = ridged * (on_face[:, :, None] * on_face[:, None, :]) + torch.diag_embed(1.0 - on_face)
    system[:, :m, m] = on_face
    system[:, m, :m] = on_face
    rhs = torch.zeros(faces.shape[0], m + 1, dtype=K.dtype, device=device)
    rhs[:, m] = 1.0
    solution, _ = torch.linalg.solve_ex(system, rhs)
    candidates = solution[:, :m]
    solved = torch.isfinite(candidates).all(dim=1, keepdim=True)  # a failed solve: the face's centre
    candidates = torch.where(solved, candidates, on_face / on_face.sum(dim=1, keepdim=True))
    candidates = project_simplex(candidates)
    values = torch.einsum("fi,ij,fj->f", candidates, K, candidates)
    near_best = values <= values.min() + 1e-12
    distance = torch.where(near_best, ((candidates - start) ** 2).sum(dim=1), torch.full_like(values, float("inf")))
    # index_select, not candidates[argmin]: a 0-d index tensor would be read on the host (a sync)
    return candidates.index_select(0, torch.argmin(distance).reshape(1))[0]


def _min_norm_by_projected_gradient(K: Tensor, start: Tensor, max_iter: int, tol: float) -> Tensor:
    lipschitz = 2.0 * torch.minimum(torch.trace(K), K.abs().sum(dim=1).max())
    step = 1.0 / torch.clamp(lipschitz, min=TINY)
    w = project_simplex(start)
    y, momentum = w, torch.ones((), dtype=torch.float64, device=K.device)
    done = torch.zeros((), dtype=torch.bool, device=K.device)
    for _ in range(max_iter):
        w_next = project_simplex(y - step * 2.0 * (K @ y))
        momentum_next = 0.5 * (1.0 + torch.sqrt(1.0 + 4.0 * momentum * momentum))
        y_next = w_next + ((momentum - 1.0) / momentum_next) * (w_next - w)
        # Restart when the momentum points uphill (O'Donoghue & Candes): keeps the linear rate.
        restart = torch.dot(y - w_next, w_next - w) > 0
        y_next = torch.where(restart, w_next, y_next)
        momentum_next = torch.where(restart, torch.ones_like(momentum_next), momentum_next)
        w = torch.where(done, w, w_next)
        y = torch.where(done, y, y_next)
        momentum = torch.where(done, momentum, momentum_next)
        gradient_half = K @ w
        done = done | (2.0 * (w @ gradient_half - gradient_half.min()) <= tol)
    return w


class MGDA(JointBaseline):
    r"""Stochastic MGDA on the dual of DR-MOO, (theta, eta) updated jointly.

    The per-task joint gradient is g_i = [grad_theta L^i ; z^i e_i], so K = J J^T + diag(z^2).  One
    call of :meth:`step` is one iteration on ONE batch:

    .. code-block:: text

        input: lr (theta and eta), pref_lr (beta), rho, lambda (lam), f (divergence), solver
        state: theta, eta (0 at start), w in simplex (uniform at start)

        batch xi (closure call 1): l = losses [B, m];  at (theta_t, eta_t):
           z = dL/deta = 1 - mean_b f*'((l - eta_t) / lambda)
           J[i] = grad_theta L^i                                   # m backward passes
           K = J J^T + diag(z^2)                                   # joint Gram, float64
        solver "one_step" (the paper's baseline):  w_{t+1} = Pi(w_t - beta * (K w_t + rho * w_t))
        solver "min_norm" (exact):                 w_{t+1} = argmin_{w in simplex} w^T K w
                                                   (see :func:`min_norm_weights`; warm start w_t)
        theta_{t+1} = theta_t - lr * J^T w_{t+1}
        eta_{t+1}   = eta_t   - lr * z (.) w_{t+1}

    Cost per step: 1 closure call (one batch of B samples), m backward passes; ``min_norm`` adds at
    most ``max_iter`` tiny m x m iterations for m > 10 (one batched solve of 2^m - 1 KKT systems
    for 3 <= m <= 10).  ``pref_lr`` and ``rho`` only enter the
    one-step solver.

    ``stats``: ``w`` (= w_{t+1}), ``eta`` (new), ``dual_objective`` (L^i(theta_t, eta_t) on xi),
    ``balanced_grad_norm`` = ||[J^T w_{t+1} ; z (.) w_{t+1}]|| (for ``min_norm`` the minimal joint
    norm over the simplex), ``theta_grad_norm`` = ||J^T w_{t+1}||, ``z``, ``step_weights``,
    ``batches``.

    Presets (``MGDA.preset(name)``): ``multimnist`` / ``celeba`` (paper Tables 4-5),
    ``linear`` (App. E.1: lr = pref_lr = 1e-5, rho = 0), ``wine`` (App. E.2: lr 1e-3, pref_lr 6e-4,
    rho = 0).  The defaults are the Multi-MNIST values.

    Args:
        params: the shared parameters.  num_tasks: m.  lr: step of theta and eta.  pref_lr: beta.
        rho: regularization of the one-step w update.  lam: lambda > 0.  divergence: f.
        solver: ``"one_step"`` or ``"min_norm"``.  max_iter, tol: cap and tolerance of the min-norm
            solver for m > 10.  backend: kernel backend (see :mod:`drmoo_kernels.dispatch`).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 1e-4, "pref_lr": 1e-6, "rho": 1e-5, "lam": 0.6},
        "celeba": {"lr": 1e-4, "pref_lr": 5e-5, "rho": 5e-5, "lam": 0.8},
        "linear": {"lr": 1e-5, "pref_lr": 1e-5, "rho": 0.0},
        "wine": {"lr": 1e-3, "pref_lr": 6e-4, "rho": 0.0},
    }

    def __init__(
        self,
        params: ParamsT,
        num_tasks: int,
        *,
        lr: float = 1e-4,
        pref_lr: float = 1e-6,
        rho: float = 1e-5,
        lam: float = 0.6,
        divergence: str = "chi2",
        solver: str = "one_step",
        max_iter: int = 500,
        tol: float = 1e-12,
        backend: str | None = None,
    ) -> None:
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {', '.join(SOLVERS)}; got {solver!r}")
        defaults = {
            **common_defaults(lam, divergence, lr=lr, pref_lr=pref_lr, rho=rho),
            "solver": solver,
            "max_iter": check_count("max_iter", max_iter),
            "tol": check_positive("tol", tol),
        }
        super().__init__(params, num_tasks, defaults, backend)

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One MGDA iteration; calls ``closure`` once.  Nothing changes if a check fails."""
        h = self.param_groups[0]
        self.begin_step()
        batch = self.task_gradients(closure, "J", feed_heads=True)
        assert batch.jacobian is not None
        gram = self._ops.gram(batch.jacobian)
        self.raise_unless_finite([("J", torch.isfinite(torch.diagonal(gram)))])

        K = joint_gram(gram, batch.z)
        w = self.w.double()
        if h["solver"] == "one_step":
            w_next = simplex_step(w, K @ w + h["rho"] * w, h["pref_lr"])
        else:
            w_next = min_norm_weights(K, w, max_iter=h["max_iter"], tol=h["tol"])

        self.step_joint(batch.jacobian, batch.z, w_next, h["lr"])
        self.set_w(w_next)
        return self.finish_step(batch, w_next, joint_norm(gram, w_next), batch.z.double() * w_next)
