"""Nash-MTL (Navon et al., ICML 2022) on the DR dual, with an on-device Newton solver for the weights."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._base import configure_jacobian
from ._features_rate import warn_unless_rate_chosen
from ._guards import finite_entries
from ._hyperparameters import check_flag, check_positive
from ._joint import TINY, JointBaseline, check_count, common_defaults, joint_gram, joint_norm
from ._state_dict import STATE_KEY
from .types import Closure, ParamsT

# Ridge on the unit-diagonal (Jacobi-scaled) Gram matrix.  When the joint gradients are linearly
# dependent with conflicting signs (e.g. g_2 = -g_1), F below is unbounded and no alpha solves the
# system; the ridge makes the problem well posed (alpha then grows like 1/sqrt(ridge), while the
# direction keeps norm sqrt(m) and is clipped).  Elsewhere it perturbs alpha by ~1e-12 relative.
NASH_RIDGE = 1e-12
# A diagonal entry below this fraction of the largest one counts as a vanished task gradient.
VANISHED = 1e-20


def nash_weights(gram: Tensor, *, iters: int = 100) -> Tensor:
    r"""alpha >= 0 with K alpha = 1/alpha on the tasks whose gradient is nonzero; float64, no host sync.

    alpha is the minimizer of F(a) = 1/2 a^T K a - sum_i log a_i, which is strictly convex (the log
    barrier) even for singular K, and self-concordant.  The problem is equivariant under diagonal
    scaling: with S = diag(K)^(-1/2), alpha = S a where a solves the same system for the
    unit-diagonal S K S -- so the solver works on S K S (plus a 1e-12 ridge), whatever the spread
    of the task gradients' norms.  A task whose joint gradient vanishes (K_ii <= 1e-20 max_j K_jj)
    has no finite bargaining weight (its utility is -inf for every direction): it is left out,
    alpha_i = 0 (it contributes nothing to the direction either way).
    Damped Newton:  a <- a - Delta / (1 + lambda), with Delta the Newton step (Cholesky of
    K + diag(1/a^2)) and lambda = sqrt(grad^T Delta) the Newton decrement: every iterate stays
    positive, F decreases, and the convergence is quadratic once lambda < 1/4 (well-conditioned
    problems converge to 1e-12 in <= 20 iterations).  Start: a = 1 (exact for orthogonal
    gradients); ``iters`` iterations (a fixed count: a convergence test would need a host sync;
    converged iterations do not move).

    m = 2 needs no iterations: the scaled matrix is [[d_1, c], [c, d_2]] with c = 0 unless both
    tasks are active, and then d_1 = d_2 = 1 + ridge; either way a_i = 1/sqrt(d_i + c) solves
    a_i (K a)_i = 1 (with d_1 = d_2 the unique minimizer is symmetric, a^2 (d + c) = 1), exactly,
    in about 20 tensor ops instead of the iterations' ~2,000 (``iters`` = 100 x ~20 ops, each a
    kernel launch on a GPU: milliseconds per step, more than the optimizer's other work).
    """
    K = gram.double()
    m = K.shape[0]
    diagonal = torch.diagonal(K)
    active = diagonal > torch.clamp(VANISHED * diagonal.max(), min=TINY)
    ones = torch.ones(m, dtype=K.dtype, device=K.device)
    inv_sqrt = torch.where(active, torch.rsqrt(torch.where(active, diagonal, ones)), 0.0 * ones)
    # Vanished tasks become decoupled unit rows (their a stays at the start value 1, then is zeroed).
    K = inv_sqrt[:, None] * K * inv_sqrt[None, :] + torch.diag(torch.where(active, NASH_RIDGE * ones, ones))
    if m == 2:  # closed form (see above); d + c >= ridge > 0 up to rounding, clamped like the iterates
        return inv_sqrt * torch.rsqrt(torch.clamp(torch.diagonal(K) + K[0, 1], min=TINY))
    return inv_sqrt * _damped_newton(K, iters)


def _damped_newton(K: Tensor, iters: int) -> Tensor:
    """``iters`` damped Newton steps on F(a) = 1/2 a^T K a - sum_i log a_i from a = 1 (see nash_weights)."""
    a = torch.ones(K.shape[0], dtype=K.dtype, device=K.device)
    for _ in range(iters):
        gradient = K @ a - 1.0 / a
        factor, _ = torch.linalg.cholesky_ex(K + torch.diag(1.0 / (a * a)))
        newton_step = torch.cholesky_solve(gradient[:, None], factor)[:, 0]
        decrement = torch.sqrt(torch.clamp(gradient @ newton_step, min=0.0))
        a = torch.clamp(a - newton_step / (1.0 + decrement), min=TINY)
    return a


class NashMTL(JointBaseline):
    r"""Nash-MTL -- multi-task learning as a bargaining game -- with (theta, eta) joint.

    Joint per-task gradients g_i = [grad_theta L^i ; z^i e_i], K = J J^T + diag(z^2).  One call of
    :meth:`step`:

    .. code-block:: text

        input: lr (theta and eta), max_norm (1), update_every (k), solver_iters, lambda (lam), f
        state: theta, eta (0), alpha (1 at start), w = alpha / sum(alpha)

        batch xi (closure call 1) at (theta_t, eta_t); z = dL/deta
        if t % k == 0:                                                   # weight update step
            J[i] = grad_theta L^i  (m backward passes);  K = J J^T + diag(z^2)
            alpha = the solution of K alpha = 1/alpha, alpha > 0      (:func:`nash_weights`;
                    alpha_i = 0 for a task whose joint gradient vanishes)
            d = [J^T alpha ; z (.) alpha]
        else:                                                            # reuse step
            d = [grad_theta sum_i alpha_i L^i ; z (.) alpha]     (ONE backward pass, alpha kept)
        clip = min(1, max_norm / ||d||)             (||d|| = sqrt(alpha^T K alpha) = sqrt(m) exactly
                                                      on update steps; a zero d is left as it is)
        theta_{t+1} = theta_t - lr * clip * d_theta;   eta_{t+1} = eta_t - lr * clip * d_eta

    Differences from the authors' implementation (AvivNavon/nash-mtl, ``NashMTL`` in
    ``methods/weight_methods.py``), each decided:

    * The solver (kept).  The official code approximates alpha by a sequential convex programme on
      the CPU: up to 20 cvxpy/ECOS solves, each linearising the concave part around the previous
      alpha, stopped once ||K/||K|| alpha - 1/alpha|| < 1e-3 or alpha moves by < 1e-6.  Here damped
      Newton in float64 on the device solves K alpha = 1/alpha to rounding, without a host sync.
      Same fixed point, reached exactly.
    * The normalisation (no difference).  Both solve for the *unnormalised* K.  The official code
      hands cvxpy K/||K||_F but multiplies the factor back inside the log constraint,
      log(alpha_i ||K||_F) + log((K/||K||_F alpha)_i) >= 0, i.e. alpha_i (K alpha)_i >= 1: the
      factor cancels and alpha solves K alpha = 1/alpha as here (so ||d|| = sqrt(m) in both).
    * The clip (deliberate).  The official code clips the shared parameters' gradient of
      sum_i alpha_i L^i to norm ``max_norm``; here the clip acts on the joint (theta, eta)
      direction, since both are the optimised variables of the DR dual.
    * Vanished tasks (deliberate).  A task whose joint gradient vanishes gets alpha_i = 0 here; the
      official problem is then infeasible (alpha_i (K alpha)_i = 0 < 1).

    Cost per step: 1 closure call (one batch); m backward passes on weight-update steps, one
    backward pass (plus a backward through the heads only, to give them their raw gradient) on
    reuse steps.

    ``stats``: ``w`` = alpha / sum(alpha) (on the simplex), ``alpha``, ``eta``, ``dual_objective``,
    ``balanced_grad_norm`` = ||[J^T w ; z (.) w]|| with the normalized w, ``theta_grad_norm`` =
    ||J^T w||, ``clip``, ``weights_updated``, ``z``, ``step_weights`` (= clip * alpha), ``batches``.

    Learning-rate scale.  On a weight-update step ||d|| = sqrt(m) whatever the gradients' size (the
    Nash weights alpha scale inversely with them), and ``max_norm`` clips it further: ``lr`` is
    close to a step length, as with Double-Clip's clipped step, but with another constant; between updates the kept
    alpha multiplies the new gradients.

    Presets: ``multimnist`` (defaults: lr 1e-4), ``celeba`` (lr 1e-4).  The paper gives no
    synthetic settings for Nash-MTL.

    Feature space (``jacobian="features"``).  On weight-update steps
    J's rows are the gradients w.r.t. the representation z, so the bargaining system K alpha =
    1/alpha is solved for the z-space Gram K = J_z J_z^T + diag(z^2), and the clip min(1, max_norm /
    ||d||) reads the z-space norm (still sqrt(m) on update steps); on reuse steps ||d|| is the norm
    of grad_z sum_i alpha_i L^i.  theta moves along clip * (dz/dtheta)^T d_z (ONE backward through
    the trunk).  ``theta_grad_norm`` and ``balanced_grad_norm`` are z-space.  alpha scales as
    1/||g_i||, and gradients w.r.t. z are smaller than w.r.t. theta, so the rate must be chosen again:
    on the 2-digit small benchmark the validation sweep chose 0.03 in features mode against 0.3 in
    parameters mode, and at 0.3 features mode did not train (results/multimnist2-small/features/).
    The bound ||J_theta^T c|| <= ||dz/dtheta|| * ||J_z^T c|| (dz/dtheta: the trunk's Jacobian on
    the batch, operator norm) relates every norm taken in z to the true one; inner products (the
    Gram's off-diagonal) have no such bound.  The per-sample ``f*'`` weights and eta are exact.

    Args:
        params: the shared parameters.
        num_tasks: m.
        lr: step of theta and eta.
        max_norm: bound on the joint direction's norm.
        update_every: k >= 1, steps between weight solves.
        solver_iters: Newton iterations (the paper ran 100 solver iterations per step).
        lam: lambda > 0.
        divergence: f.
        capturable: no host read in :meth:`step` (see :mod:`drmoo.optim`, "Capturable steps").
        backend: kernel backend (see :mod:`drmoo_kernels.dispatch`).
        jacobian: ``"parameters"`` (the paper's: per-task gradients w.r.t. the shared parameters, m
            backward passes through the trunk) or ``"features"`` (w.r.t. the representation z: m
            passes through the heads, one through the trunk; see "Feature space" above).
            Its weights (1/alpha ~ ||g_i||) and clip read norms taken in z, so ``lr`` must be chosen for
            features mode: built in features mode it warns once
            (:class:`~drmoo.optim.FeaturesRateWarning`) unless ``features_rate_chosen=True``.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`): ``"auto"``
            (default: the fewest kernel launches on a GPU, the least memory traffic on the CPU),
            ``"loop"`` (one backward per task) or ``"batched"`` (one vmapped backward); the same gradients
            up to rounding.  Also the ``jacobian_strategy`` attribute, which may be set later.
        features_rate_chosen: say that ``lr`` was chosen for ``jacobian="features"`` (silences the
            warning).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 1e-4, "lam": 0.8},
        "celeba": {"lr": 1e-4, "lam": 0.8},
    }

    def __init__(
        self,
        params: ParamsT,
        num_tasks: int,
        *,
        lr: float = 1e-4,
        max_norm: float = 1.0,
        update_every: int = 1,
        solver_iters: int = 100,
        lam: float = 0.8,
        divergence: str = "chi2",
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
        features_rate_chosen: bool = False,
    ) -> None:
        defaults = {
            **common_defaults(lam, divergence, lr=lr),
            "max_norm": check_positive("max_norm", max_norm),
            "update_every": check_count("update_every", update_every),
            "solver_iters": check_count("solver_iters", solver_iters),
            "capturable": check_flag("capturable", capturable),
        }
        super().__init__(params, num_tasks, defaults, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)
        warn_unless_rate_chosen(self, jacobian, "its weights scale as 1/||g_i|| of the gradients w.r.t. z and "
                                "its clip reads their norm", features_rate_chosen)

    def extra_state(self) -> dict[str, Any]:
        return {"alpha": torch.ones(self.num_tasks, device=self.device, dtype=torch.float64)}

    def validate_state_dict(self, state_dict: Any) -> None:
        """The base checks, and ``alpha`` as the solver writes it: >= 0 with an entry > 0 (a forged negative
        alpha would send the reuse steps, which apply it as it is, uphill).

        Args:
            state_dict: what was handed to :meth:`load_state_dict`.
        """
        super().validate_state_dict(state_dict)
        alpha = state_dict["state"][STATE_KEY]["alpha"].double()
        if bool((alpha < 0).any()) or not bool((alpha > 0).any()):
            raise ValueError(f"state_dict's alpha must be >= 0 with at least one entry > 0 (Nash-MTL's task "
                             f"weights), got {alpha.tolist()}")

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One Nash-MTL iteration; calls ``closure`` once.  Nothing changes if a check fails.

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` -- or an iterable of micro-batches that make the batch, for the
                whole batch's step without its whole graph in memory (the closure protocol of
                :mod:`drmoo.optim`, :data:`drmoo.optim.Closure`); required (None raises ValueError).
        """
        h = self.param_groups[0]
        state = self.state[STATE_KEY]
        self.begin_step()
        update = self.steps_taken % h["update_every"] == 0
        if update:
            batch = self.task_gradients(closure, "J", feed_heads=True)
            assert batch.jacobian is not None
            gram = self.task_gram(batch.jacobian)
            self.raise_unless_finite([("J", finite_entries(torch.diagonal(gram)))])
            alpha = nash_weights(joint_gram(gram, batch.z), iters=h["solver_iters"])
            direction, theta_norm = batch.jacobian, joint_norm(gram, alpha)
            theta_weights = alpha
        else:
            batch = self.draw_batch(closure)
            alpha = state["alpha"]
            combined = self.combined_gradient(batch, alpha, "d")
            theta_norm = self.combined_norm(combined)
            finite = self.combined_finite(combined, theta_norm).expand(self.num_tasks)
            self.raise_unless_finite([("sum_i alpha_i grad L^i", finite)])
            direction = combined[None, :]
            theta_weights = torch.ones(1, dtype=torch.float64, device=alpha.device)

        eta_part = batch.z.double() * alpha
        joint = torch.sqrt(theta_norm**2 + torch.sum(eta_part**2))
        clip = torch.where(joint > h["max_norm"], h["max_norm"] / torch.where(joint > 0, joint, 1.0), 1.0)
        self.apply_direction(direction, theta_weights, clip)
        self.step_eta(batch.z, clip * alpha, h["lr"])

        total = alpha.sum()
        # every task gradient vanished (alpha = 0): report uniform weights, the direction is 0 anyway
        normalized = torch.where(total > 0, alpha / torch.where(total > 0, total, 1.0), 1.0 / self.num_tasks)
        self.commit_(state["alpha"], alpha)
        self.set_w(normalized)
        safe_total = torch.where(total > 0, total, 1.0)
        return self.finish_step(
            batch, clip * alpha, theta_norm / safe_total, eta_part / safe_total,
            alpha=alpha.clone(), clip=clip.float(), weights_updated=torch.tensor(update),
        )
