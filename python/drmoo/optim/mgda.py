"""MGDA on the DR dual: the stochastic one-step preference update, or the exact min-norm weights."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from drmoo_kernels.reference import clip_factor

from ._base import configure_jacobian
from ._features_rate import warn_unless_rate_chosen
from ._guards import NonFiniteStepError
from ._hyperparameters import SOLVERS, check_flag, check_pairs, check_positive
from ._joint import (
    JointBaseline,
    check_count,
    common_defaults,
    finite_entries,
    joint_gram,
    joint_norm,
    simplex_step,
)
from .types import Closure, ParamsT

# Exact enumeration of the faces of the simplex up to this many tasks (2^m - 1 tiny systems, one
# batched solve); above it the active-set method (one small system per iteration).
EXACT_MAX_TASKS = 10
# With ``early_exit``, the active set reads its "done" flag on the host once per this many steps.
EARLY_EXIT_EVERY = 8
# Unit roundoff of float64: the KKT tests below never demand more than a small multiple of it.
_EPS = 2.0**-53


def min_norm_weights(
    gram: Tensor, start: Tensor, *, max_iter: int = 500, tol: float = 1e-12, early_exit: bool = False
) -> Tensor:
    r"""w* = argmin_{w in simplex} w^T K w, in float64 on K's device, with no host synchronisation
    (unless ``early_exit``).

    * m = 1: [1].
    * m = 2: the closed form w^1 = clip((K22 - K12) / (K11 + K22 - 2 K12), 0, 1), computed as
      (K22 - K12)_+ / ((K22 - K12)_+ + (K11 - K12)_+) and w^2 likewise (not 1 - w^1), exactly 0 or
      1 at the ends, 0.5 when the denominator is at the rounding level of K (g1 = g2: every w is
      optimal).
    * m >= 3: exact, in scale-invariant coordinates.  With d_i = ||g_i|| = sqrt(K_ii) and the
      correlations C = D^-1 K D^-1 (unit diagonal), the minimizer on the face S of the simplex
      (w = 0 off S) solves the face's KKT system in the scaled unknowns u_i = w_i d_i / s,
      s = min_{i in S} d_i, and nu = -f / s^2:

          [ C_SS   a_S ] [ u_S ]   [ 0 ]          a_i = s / d_i  (in (0, 1], max 1),
          [ a_S^T   0  ] [ nu  ] = [ 1 ],         w_i = a_i u_i,  f = w^T K w = -s^2 nu.

      Its entries are all O(1) whatever the spread of the gradient norms, so a backward-stable
      solve is accurate to the problem's geometric conditioning (the angles between gradients),
      not to the ratio of their norms -- no ridge, nothing absolute.  A face's point is THE
      minimizer iff it satisfies the KKT conditions of the simplex problem: u_S >= 0 and
      r_j = (C u)_j + a_j nu = ((K w)_j - f) / (s d_j) >= 0 for every j.  Both are tested
      relative to their own rounding scale (|u|_inf; (|C| |u|)_j + a_j |nu|), with the relative
      tolerance max(``tol``, 16 m eps) -- never an absolute threshold.
      - m <= 10 (``EXACT_MAX_TASKS``): all 2^m - 1 faces in one batched solve; the faces that
        satisfy the KKT conditions are all optimal (several only when the minimizer is not unique,
        e.g. duplicated gradients): the one nearest ``start`` wins.  Should rounding leave no face
        within tolerance, the least violating one is taken.
      - m > 10: Wolfe's active-set method for the minimum-norm point of the convex hull of the
        g_i (Wolfe 1976), on the same scaled face systems: start at the vertex of least norm;
        a major step adds the task with the most negative relative r_j (stop when none is below
        -tol); a minor step, when the new face's minimizer leaves the simplex, moves towards it
        until a weight reaches 0 and drops that task.  It terminates after finitely many steps
        in exact arithmetic (the objective strictly decreases and no face repeats); here it runs
        ``max_iter`` steps (a fixed count: stopping early needs a host read), frozen once the KKT
        conditions hold; with ``early_exit`` it reads its "done" flag on the host every
        ``EARLY_EXIT_EVERY`` steps and stops there (m = 40 typically needs 25-50 steps, not 500).
        Every iterate is feasible and no worse than the one before.
    * A task with a zero gradient (K_ii = 0) is a minimizer by itself (w = e_i, value 0).
    """
    m = gram.shape[0]
    K = gram.double()
    if m == 1:
        return torch.ones(1, dtype=torch.float64, device=K.device)
    if m == 2:
        # Each weight from its own numerator (never 1 - the other: next to 1 that loses every digit
        # of a weight of 1e-8), both >= 0 and exactly 0 at the ends.
        first = torch.clamp(K[1, 1] - K[0, 1], min=0.0)
        second = torch.clamp(K[0, 0] - K[0, 1], min=0.0)
        denominator = first + second  # = ||g1 - g2||^2 unless an end is the minimizer
        # g1 = g2 up to the rounding of K: every w is optimal (within rounding), take 0.5 each.
        degenerate = denominator <= 4.0 * _EPS * (K[0, 0] + K[1, 1] + 2.0 * K[0, 1].abs())
        safe = torch.where(degenerate, torch.ones_like(denominator), denominator)
        weights = torch.stack([first, second]) / safe
        return torch.where(degenerate, torch.full_like(weights, 0.5), weights)
    if m <= EXACT_MAX_TASKS:
        return _min_norm_by_faces(K, start.double(), tol)
    return _min_norm_by_active_set(K, start.double(), max_iter, tol, early_exit)


def _correlations(K: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(C, d, zero): d_i = sqrt(K_ii), C = D^-1 K D^-1 with unit diagonal, zero_i = (d_i == 0)."""
    diagonal = torch.diagonal(K).clamp(min=0.0)
    d = torch.sqrt(diagonal)
    zero = diagonal == 0
    safe = torch.where(zero, torch.ones_like(d), d)
    # Divide by one factor at a time: |K_ij| <= d_i d_j, so neither quotient overflows, and no
    # product d_i d_j can underflow.
    C = (K / safe[:, None]) / safe[None, :]
    C = torch.where(zero[:, None] | zero[None, :], torch.zeros_like(C), C)
    C.diagonal().fill_(1.0)
    return C, d, zero


def _solve_faces(C: Tensor, d: Tensor, faces: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The minimizer on each face's affine hull, in the scaled form of :func:`min_norm_weights`.

    faces: [F, m] bool supports.  Returns (w [F, m] with sum 1 and zeros off the face,
    primal [F] = -min_{i in S} u_i / max|u| (> 0: the point leaves the simplex), dual [F, m] =
    r_j / ((|C| |u|)_j + a_j |nu|) (< 0: adding j would lower w^T K w), solved [F] (finite)).
    """
    F, m = faces.shape
    on = faces.to(C.dtype)
    s = torch.where(faces, d, torch.full_like(on, float("inf"))).amin(dim=1)  # [F]
    a = s[:, None] / d.clamp(min=torch.finfo(C.dtype).tiny)[None, :]  # [F, m]; <= 1 on the face
    system = torch.zeros(F, m + 1, m + 1, dtype=C.dtype, device=C.device)
    system[:, :m, :m] = C * (on[:, :, None] * on[:, None, :]) + torch.diag_embed(1.0 - on)
    system[:, :m, m] = a * on
    system[:, m, :m] = a * on
    rhs = torch.zeros(F, m + 1, dtype=C.dtype, device=C.device)
    rhs[:, m] = 1.0
    solution, _ = torch.linalg.solve_ex(system, rhs)
    solved = torch.isfinite(solution).all(dim=1)
    solution = torch.where(solved[:, None], solution, torch.zeros_like(solution))
    u, nu = solution[:, :m] * on, solution[:, m]
    largest = u.abs().amax(dim=1).clamp(min=torch.finfo(C.dtype).tiny)
    primal = -torch.where(faces, u, torch.full_like(u, float("inf"))).amin(dim=1) / largest
    residual = u @ C + a * nu[:, None]
    magnitude = u.abs() @ C.abs() + a * nu.abs()[:, None]
    dual = residual / magnitude.clamp(min=torch.finfo(C.dtype).tiny)
    w = (a * u).clamp(min=0.0)
    w = w / w.sum(dim=1, keepdim=True).clamp(min=torch.finfo(C.dtype).tiny)
    return w, primal, dual, solved


def _zero_gradient_vertex(zero: Tensor, start: Tensor) -> Tensor:
    """e_i for the zero-gradient task i with the largest start weight (the vertex nearest start)."""
    i = torch.argmax(torch.where(zero, start, torch.full_like(start, -1.0)))
    return (torch.arange(zero.shape[0], device=start.device) == i).to(start.dtype)


def _kkt_threshold(m: int, tol: float) -> float:
    return max(tol, 16.0 * m * _EPS)


def _min_norm_by_faces(K: Tensor, start: Tensor, tol: float = 1e-12) -> Tensor:
    m, device = K.shape[0], K.device
    C, d, zero = _correlations(K)
    bits = torch.arange(m, device=device)
    faces = ((torch.arange(1, 2**m, device=device)[:, None] >> bits) & 1).bool()  # [F, m] supports
    w, primal, dual, solved = _solve_faces(C, d, faces)
    dual_off_face = torch.where(faces, torch.zeros_like(dual), dual)
    violation = torch.maximum(primal, -dual_off_face.amin(dim=1)).clamp(min=0.0)
    violation = torch.where(solved, violation, torch.full_like(violation, float("inf")))
    # Every face within tolerance is optimal (up to rounding); should none be, the least violating.
    admissible = violation <= torch.clamp(violation.min(), min=_kkt_threshold(m, tol))
    distance = torch.where(admissible, ((w - start) ** 2).sum(dim=1), torch.full_like(violation, float("inf")))
    # index_select, not w[argmin]: a 0-d index tensor would be read on the host (a sync)
    best = w.index_select(0, torch.argmin(distance).reshape(1))[0]
    return torch.where(zero.any(), _zero_gradient_vertex(zero, start), best)


def _min_norm_by_active_set(
    K: Tensor, start: Tensor, max_iter: int = 500, tol: float = 1e-12, early_exit: bool = False
) -> Tensor:
    m, dtype, device = K.shape[0], K.dtype, K.device
    tiny = torch.finfo(dtype).tiny
    C, d, zero = _correlations(K)
    threshold = _kkt_threshold(m, tol)
    inverse_d = 1.0 / d.clamp(min=tiny)
    # [C 1/d; 1/d^T 0]: the face system of :func:`_solve_faces` is this matrix scaled by
    # diag(on_S, s) on both sides, plus the identity on the rows and columns off the face.
    bordered = torch.zeros(m + 1, m + 1, dtype=dtype, device=device)
    bordered[:m, :m] = C
    bordered[:m, m] = inverse_d
    bordered[m, :m] = inverse_d
    rhs = torch.zeros(m + 1, dtype=dtype, device=device)
    rhs[m:].fill_(1.0)  # not rhs[m] = 1.0: a 0-d CUDA target is filled by a synchronising host copy
    magnitude_matrix = C.abs()
    no_weight = torch.zeros(1, dtype=dtype, device=device)
    w = (torch.arange(m, device=device) == torch.argmin(d)).to(dtype)  # the vertex of least norm
    support = w > 0
    done = zero.any()
    for taken in range(max_iter):
        if early_exit and taken % EARLY_EXIT_EVERY == 0 and taken > 0 and bool(done):  # a host read
            break
        on = support.to(dtype)
        s = torch.where(support, d, torch.full_like(d, float("inf"))).amin()
        scaling = torch.cat([on, s.reshape(1)])
        system = bordered * (scaling[:, None] * scaling[None, :])
        system.diagonal()[:m].add_(1.0 - on)
        solution, _ = torch.linalg.solve_ex(system, rhs)
        solved = torch.isfinite(solution).all()
        solution = torch.where(solved, solution, torch.zeros_like(solution))
        u, scaled_nu = solution[:m] * on, s * solution[m]
        # The face's minimizer y (weights on the simplex) and the KKT tests of :func:`_solve_faces`.
        y = s * inverse_d * u
        y = y / y.sum().clamp(min=tiny)
        interior = solved & (torch.where(support, u, torch.full_like(u, float("inf"))).amin() > 0)
        residual = u @ C + scaled_nu * inverse_d
        magnitude = u.abs() @ magnitude_matrix + scaled_nu.abs() * inverse_d
        dual = torch.where(support, torch.full_like(u, float("inf")), residual / magnitude.clamp(min=tiny))
        # Major step (y interior): add the task with the most negative relative margin, if any.
        improvable = dual.min() < -threshold
        grow = (torch.arange(m, device=device) == torch.argmin(dual)) & improvable
        # Minor step: walk from w towards y until the first weight reaches 0; drop that task.
        leaving = support & (y <= 0.0)
        ratios = torch.where(leaving, w / (w - y).clamp(min=tiny), torch.ones_like(w))
        theta = ratios.min().clamp(0.0, 1.0)
        blocking = leaving & (ratios <= theta)
        walked = torch.where(blocking, no_weight, (w + theta * (y - w)).clamp(min=0.0))
        walked = walked / walked.sum().clamp(min=tiny)
        w_next = torch.where(interior, y, walked)
        support_next = torch.where(interior, support | grow, support & (walked > 0))
        w = torch.where(done, w, w_next)
        support = torch.where(done, support, support_next)
        done = done | ~solved | (interior & ~improvable)
    return torch.where(zero.any(), _zero_gradient_vertex(zero, start), w)


def min_norm_weights_on_host(K: np.ndarray, start: np.ndarray, *, max_iter: int = 500,
                             tol: float = 1e-12) -> np.ndarray:
    """:func:`min_norm_weights`' active set (m > ``EXACT_MAX_TASKS``) on the host, in numpy float64, stopping as
    soon as the KKT conditions hold (the device version runs ``max_iter`` steps, frozen once done, since
    stopping there needs a host read per test).  An eager step reads K once -- with its guards, in the step's
    one host read -- and solves here.  Same iterates as the device version, to the rounding of another LAPACK;
    a face system that cannot be solved ends the walk at the last iterate.
    """
    m = K.shape[0]
    tiny = float(np.finfo(np.float64).tiny)
    diagonal = np.clip(np.diagonal(K), 0.0, None)
    zero = diagonal == 0
    if zero.any():  # a zero gradient is a minimizer by itself: the vertex nearest start
        vertex = np.zeros(m)
        vertex[int(np.argmax(np.where(zero, start, -1.0)))] = 1.0
        return vertex
    d = np.sqrt(diagonal)
    C = (K / d[:, None]) / d[None, :]  # one factor at a time, as in _correlations
    np.fill_diagonal(C, 1.0)
    threshold = _kkt_threshold(m, tol)
    inverse_d = 1.0 / np.maximum(d, tiny)
    bordered = np.zeros((m + 1, m + 1))
    bordered[:m, :m], bordered[:m, m], bordered[m, :m] = C, inverse_d, inverse_d
    rhs = np.zeros(m + 1)
    rhs[m] = 1.0
    magnitude_matrix = np.abs(C)
    w = np.zeros(m)
    w[int(np.argmin(d))] = 1.0  # the vertex of least norm
    support = w > 0
    for _ in range(max_iter):
        on = support.astype(np.float64)
        s = float(d[support].min())
        scaling = np.append(on, s)
        system = bordered * np.outer(scaling, scaling)
        system[np.arange(m), np.arange(m)] += 1.0 - on
        try:
            solution = np.linalg.solve(system, rhs)
        except np.linalg.LinAlgError:
            break
        if not np.isfinite(solution).all():
            break
        u, scaled_nu = solution[:m] * on, s * solution[m]
        y = s * inverse_d * u
        y = y / max(float(y.sum()), tiny)
        interior = float(u[support].min()) > 0
        residual = u @ C + scaled_nu * inverse_d
        magnitude = np.abs(u) @ magnitude_matrix + abs(scaled_nu) * inverse_d
        dual = np.where(support, np.inf, residual / np.maximum(magnitude, tiny))
        improvable = float(dual.min()) < -threshold
        if interior:  # a major step: y, and the task with the most negative margin joins, if any
            w = y
            if not improvable:
                break
            support = support.copy()
            support[int(np.argmin(dual))] = True
            continue
        # a minor step: from w towards y until the first weight reaches 0; that task leaves
        leaving = support & (y <= 0.0)
        ratios = np.where(leaving, w / np.maximum(w - y, tiny), 1.0)
        theta = min(max(float(ratios.min()), 0.0), 1.0)
        walked = np.where(leaving & (ratios <= theta), 0.0, np.maximum(w + theta * (y - w), 0.0))
        w = walked / max(float(walked.sum()), tiny)
        support = support & (walked > 0)
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
        with clip_c1, clip_c2 set (off by default), both steps are scaled by Double-Clip's theta clip
        (paper Alg. 2, line 7 and its clipping rule, with d = J^T w_{t+1}):
           alpha = min(clip_c1, clip_c2 / ||d||)   (clip_c1 where d = 0)
           theta_{t+1} = theta_t - lr * alpha * J^T w_{t+1};  eta_{t+1} = eta_t - lr * alpha * z (.) w_{t+1}

    Differences from the authors' implementation (Sener & Koltun's MGDA-UB, isl-org/
    MultiObjectiveOptimization ``multi_task/min_norm_solvers.py``; the MoDo/MoCo authors ship
    the same solver), each decided:

    * The solver (deliberate).  Theirs: the best pair of tasks, then projected-gradient (or
      Frank-Wolfe) steps until the weights move by < 1e-5 in l1 (its cap of 250 iterations is
      never counted), on the CPU; the pair's ends are 0.999 / 0.001, never 0 / 1.  Here
      ``min_norm`` is exact (to ~1e-12 relative, whatever the spread of the gradient norms) and
      on the device; ``one_step`` is the DR paper's stochastic baseline.
    * No gradient normalization (their ``l2`` / ``loss`` / ``loss+`` options; ``none`` here).
    * The full shared gradient by default; MGDA-UB's upper bound through the shared representation
      is ``jacobian="features"`` (below).

    Cost per step: 1 closure call (one batch of B samples), m backward passes; ``min_norm`` adds
    one batched solve of 2^m - 1 tiny KKT systems for 3 <= m <= 10, and for m > 10 active-set
    steps (one (m+1) x (m+1) solve each): eagerly on the host until exact (typically < 2m; the Gram
    travels there in the step's one host read, with its NaN/Inf guards, and with the clip the clip's
    factor is taken there too), with ``capturable`` all ``max_iter`` of them on the device (no host read).
    In features mode that eager path reads the host twice: the trunk's gradients are lifted with the
    weights found on the host, and checked finite before theta (or ``.grad``) is written.  ``pref_lr``
    and ``rho`` only enter the one-step solver.

    ``stats``: ``w`` (= w_{t+1}), ``eta`` (new), ``dual_objective`` (L^i(theta_t, eta_t) on xi),
    ``balanced_grad_norm`` = ||[J^T w_{t+1} ; z (.) w_{t+1}]|| (for ``min_norm`` the minimal joint
    norm over the simplex), ``theta_grad_norm`` = ||J^T w_{t+1}||, ``z``, ``step_weights``,
    ``batches``.

    Presets (``MGDA.preset(name)``): ``multimnist`` / ``celeba`` (paper Tables 4-5),
    ``linear`` (App. E.1: lr = pref_lr = 1e-5, rho = 0), ``wine`` (App. E.2: lr 1e-3, pref_lr 6e-4,
    rho = 0).  The defaults are the Multi-MNIST values.

    Learning-rate scale.  ``lr`` multiplies the unnormalised direction J^T w (w on the simplex, so a
    weighted mean of the task gradients): the step grows with the gradients, as in SGD on the
    weighted mean loss.  It does not transfer to Double-Clip's clipped step (see
    :class:`~drmoo.optim.DoubleClipMGDA`).

    Feature space (``jacobian="features"``, MGDA-UB).  J's rows are
    the gradients w.r.t. the representation z (m x B*d, m backward passes through the heads only),
    so the Gram K = J_z J_z^T + diag(z^2) -- and the weights of both solvers -- are taken in z's
    coordinates; theta moves along (dz/dtheta)^T J_z^T w_{t+1} = grad_theta sum_i w_i L^i (ONE
    backward through the trunk).  ``balanced_grad_norm`` and ``theta_grad_norm`` are z-space norms.
    With ``pref_lr = 0`` (w stays uniform) the direction is the parameter-space one, to rounding.
    The bound ||J_theta^T c|| <= ||dz/dtheta|| * ||J_z^T c|| (dz/dtheta: the trunk's Jacobian on
    the batch, operator norm) relates every norm taken in z to the true one; inner products (the
    Gram's off-diagonal) have no such bound.  The per-sample ``f*'`` weights and eta are exact.

    Args:
        params: the shared parameters.
        num_tasks: m.
        lr: step of theta and eta.
        pref_lr: beta.
        rho: regularization of the one-step w update.
        lam: lambda > 0.
        divergence: f.
        solver: ``"one_step"`` or ``"min_norm"``.
        max_iter: cap on the active-set steps of the min-norm solver for m > 10 (it typically needs
            fewer than 2m; all are run when ``capturable``, eagerly it stops once exact).
        tol: relative tolerance of its KKT tests (m >= 3).
        clip_c1: with ``clip_c2``, clip the step as Double-Clip clips theta's: the joint step keeps
            MGDA's direction and is scaled by alpha = min(clip_c1, clip_c2 / ||J^T w||), so the theta
            step's length is lr * min(clip_c1 ||J^T w||, clip_c2) (Double-Clip's at the same lr, c1,
            c2: the ``mgda[lr=1.0,clip_c1=1.0,clip_c2=0.5]`` ablation row).  None (default): no clip.
        clip_c2: see ``clip_c1``; give both or neither.
        capturable: no host read in :meth:`step` (see :mod:`drmoo.optim`, "Capturable steps").
        backend: kernel backend (see :mod:`drmoo_kernels.dispatch`).
        jacobian: ``"parameters"`` (the paper's: per-task gradients w.r.t. the shared parameters, m
            backward passes through the trunk) or ``"features"`` (w.r.t. the representation z: m
            passes through the heads, one through the trunk; see "Feature space" above).
            With ``clip_c1``/``clip_c2`` its clip alpha = min(clip_c1, clip_c2 / ||J^T w||) reads a norm
            taken in z, so ``lr`` must be chosen for features mode: built in features mode it warns once
            (:class:`~drmoo.optim.FeaturesRateWarning`) unless ``features_rate_chosen=True``.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`): ``"auto"``
            (default: the fewest kernel launches on a GPU, the least memory traffic on the CPU),
            ``"loop"`` (one backward per task) or ``"batched"`` (one vmapped backward); the same gradients
            up to rounding.  Also the ``jacobian_strategy`` attribute, which may be set later.
        features_rate_chosen: say that ``lr`` was chosen for ``jacobian="features"`` (silences the
            warning).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 1e-4, "pref_lr": 1e-6, "rho": 1e-5, "lam": 0.8},
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
        lam: float = 0.8,
        divergence: str = "chi2",
        solver: str = "one_step",
        max_iter: int = 500,
        tol: float = 1e-12,
        clip_c1: float | None = None,
        clip_c2: float | None = None,
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
        features_rate_chosen: bool = False,
    ) -> None:
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {', '.join(SOLVERS)}; got {solver!r}")
        check_pairs({"clip_c1": clip_c1, "clip_c2": clip_c2})
        defaults = {
            **common_defaults(lam, divergence, lr=lr, pref_lr=pref_lr, rho=rho),
            "solver": solver,
            "max_iter": check_count("max_iter", max_iter),
            "tol": check_positive("tol", tol),
            "clip_c1": None if clip_c1 is None else check_positive("clip_c1", clip_c1),
            "clip_c2": None if clip_c2 is None else check_positive("clip_c2", clip_c2),
            "capturable": check_flag("capturable", capturable),
        }
        super().__init__(params, num_tasks, defaults, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)
        clip_reads_z = "its clip alpha = min(clip_c1, clip_c2 / ||J_z^T w||) reads a norm taken in z"
        warn_unless_rate_chosen(self, jacobian, None if clip_c1 is None else clip_reads_z, features_rate_chosen)

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One MGDA iteration; calls ``closure`` once.  Nothing changes if a check fails.

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` -- or an iterable of micro-batches that make the batch, for the
                whole batch's step without its whole graph in memory (the closure protocol of
                :mod:`drmoo.optim`, :data:`drmoo.optim.Closure`); required (None raises ValueError).
        """
        h = self.param_groups[0]
        self.begin_step()
        batch = self.task_gradients(closure, "J", feed_heads=True)
        assert batch.jacobian is not None
        gram = self.task_gram(batch.jacobian)
        self.raise_unless_finite([("J", finite_entries(torch.diagonal(gram)))])

        # float64 once: the Gram and z are read in float64 by joint_gram, joint_norm and the eta step
        gram, z64 = gram.double(), batch.z.double()
        K = joint_gram(gram, z64)
        w = self.w.double()
        host_alpha: float | None = None  # the clip's factor, when the weights were found on the host
        if h["solver"] == "one_step":
            w_next = simplex_step(w, K @ w + h["rho"] * w, h["pref_lr"])
        elif K.shape[0] > EXACT_MAX_TASKS and not self.capturable:
            w_next, host_alpha = self._min_norm_on_host(K, gram, w)
        else:  # m <= EXACT_MAX_TASKS (every face in one solve), or capturable (a fixed count of steps)
            w_next = min_norm_weights(K, w, max_iter=h["max_iter"], tol=h["tol"])

        if h.get("clip_c1") is None:
            self.step_joint(batch.jacobian, z64, w_next)
        else:  # Double-Clip's theta clip on MGDA's direction (see clip_c1)
            alpha: Tensor | float = (clip_factor(h["clip_c1"], h["clip_c2"], joint_norm(gram, w_next))
                                     if host_alpha is None else host_alpha)
            self.apply_direction(batch.jacobian, w_next, alpha)
            self.step_eta(z64, w_next, h["lr"] * alpha)
        self.set_w(w_next)
        return self.finish_step(batch, w_next, joint_norm(gram, w_next), z64 * w_next)

    def _min_norm_on_host(self, K: Tensor, gram: Tensor, w: Tensor) -> tuple[Tensor, float | None]:
        """The exact weights for m > ``EXACT_MAX_TASKS`` in an eager step, and with ``clip_c1`` the clip's factor.

        The active set stops once exact, which only the host can see: K and w reach it in the step's one host
        read (with the guards' verdict), and the walk runs there.  With the clip, the theta Gram rides in the
        same read and the factor min(clip_c1, clip_c2 / sqrt(w^T G w)) is taken there too: taken on the device
        from the host's weights, it would be one more guard to read before theta is written (a second host
        read).  Both are checked finite on the host, so the direction's guard of them reads nothing.
        """
        h = self.param_groups[0]
        m = K.shape[0]
        clipped = h.get("clip_c1") is not None
        payload = torch.cat([K.reshape(-1), w, *([gram.reshape(-1)] if clipped else [])])
        host = np.asarray(self.read_with_guards(payload), dtype=np.float64)
        w_host = min_norm_weights_on_host(host[: m * m].reshape(m, m), host[m * m: m * m + m],
                                          max_iter=h["max_iter"], tol=h["tol"])
        alpha = None
        if clipped:  # clip_factor and joint_norm's formulas, in float64 on the host
            G = host[m * m + m:].reshape(m, m)
            norm = float(np.sqrt(max(float(w_host @ (G @ w_host)), 0.0)))
            alpha = min(h["clip_c2"] / norm, h["clip_c1"]) if norm > 0 else float(h["clip_c1"])
        if not (np.isfinite(w_host).all() and (alpha is None or np.isfinite(alpha))):
            raise NonFiniteStepError(f"the min-norm weights of a finite Gram came out non-finite in "
                                     f"{self.failing_iteration}: {w_host.tolist()} (clip factor {alpha}); "
                                     "nothing was updated")
        w_next = torch.from_numpy(w_host).to(w.device, non_blocking=True)
        self.vouch_finite(w_next)  # checked here, on the host: the direction's guard of w reads nothing
        return w_next, alpha
