"""Double-Clip MGDA (paper Algorithm 2): the single-loop method for the dual of DR-MOO."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from drmoo import distributed
from drmoo_kernels.reference import clip_factor, gram_step_small, project_simplex

from ._base import MultiObjectiveOptimizer, configure_jacobian
from ._features_rate import warn_unless_rate_chosen
from ._fsdp import is_sharded
from ._hyperparameters import check_flag, check_positive
from .types import Closure, ParamsT


class DoubleClipMGDA(MultiObjectiveOptimizer):
    r"""Single-loop Double-Clip MGDA for distributionally robust multi-objective optimization.

    Optimizes the rescaled dual objectives :math:`\hat L^i(\theta, \eta) = L^i(\theta, s\eta)` with
    :math:`L^i(\theta,\eta) = \lambda\,\mathbb{E}[f^*((\ell^i(\theta;\xi) - \eta)/\lambda)] + \eta`
    (the dual of DR-MOO, paper eq. (3)-(4); the rescaling of Lemma 5.1 uses :math:`s = G\sqrt{m}`,
    exposed as ``dual_scale``).  One call of :meth:`step` is one iteration of Algorithm 2:

    .. code-block:: text

        input: gamma (lr), beta (pref_lr), rho, c1, c2, f1, f2, lambda (lam), f (divergence), s
        state: theta (the shared parameters), eta in R^m (0 at start), w in simplex (uniform at start)

        1. batch xi (closure call 1, forward only):  l = losses [B, m]
           z   = dL^/deta = s * (1 - mean_b f*'((l - s*eta_t) / lambda))      # Z_t w_t = z (.) w_t
        2. mu  = min(f1, f2 / ||z (.) w_t||)                                  # clipping rule, line 2
           eta_{t+1} = eta_t - gamma * mu * (z (.) w_t)                        # line 5
        3. batch xi_bar (closure call 2; the same batch when resample=False):
           v_b^i = f*'((l_b^i - s*eta^i_{t+1}) / lambda)                      # worst-case weights
           J[i]  = grad_theta mean_b(v_b^i * l_b^i) = grad_theta L^i(theta_t, eta_{t+1})  # X_t
        4. G = J J^T;  ||d|| = sqrt(w_t^T G w_t);  alpha = min(c1, c2 / ||d||)  # clipping rule
           theta_{t+1} = theta_t - gamma * alpha * J^T w_t                     # line 7
        5. w_{t+1} = Pi(w_t - beta * (alpha * G w_t + mu * z^2 (.) w_t + rho * w_t))   # line 8
        (a vanishing norm makes its clip factor fall back to c1 / f1)

    Samples per iteration: 2 batches (``resample=True``, the paper's independent draws xi and
    xi_bar) or 1 batch reused with its graph (``resample=False``: half the forward cost, at the
    price of z and J being correlated, which the analysis does not cover).

    Driven by :class:`drmoo.Balancer`, the iteration is the same except line 7: the clipped
    direction alpha * J^T w_t is added to the shared parameters' ``.grad`` (``torch.optim.SGD`` with
    lr = gamma then takes exactly line 7's step), while eta's step (line 5) still uses gamma = ``lr``.

    ``stats`` after a step: ``w``, ``eta`` (new values), ``alpha``, ``mu``, ``dual_objective``
    (L^i at eta_{t+1} on xi_bar), ``balanced_grad_norm`` = ||grad_{theta,eta} L^(theta_t, eta_{t+1}) w_t||
    on xi_bar (the measure of Theorem 5.2, eq. (9)) and ``theta_grad_norm`` = ||J^T w_t||.

    Feature space (``jacobian="features"``).  J's rows are the
    gradients w.r.t. the representation z (m backward passes through the heads only): the Gram G of
    step 4 and w's update (step 5) use z's coordinates, and so does the theta clip: alpha = min(c1,
    c2 / ||J_z^T w||), ||d|| being a z-space norm, so the step's length is bounded by gamma * c2 *
    ||dz/dtheta|| rather than gamma * c2.  theta moves along alpha * (dz/dtheta)^T J_z^T w_t (ONE
    backward through the trunk of sum_i alpha w_i L^_i; not the fused ``gram_step`` write).  The eta
    step and its clip mu (steps 1-2) are unchanged: they use the dual gradients z = dL/deta only.
    ``theta_grad_norm`` and ``balanced_grad_norm`` are z-space.
    The bound ||J_theta^T c|| <= ||dz/dtheta|| * ||J_z^T c|| (dz/dtheta: the trunk's Jacobian on
    the batch, operator norm) relates every norm taken in z to the true one; inner products (the
    Gram's off-diagonal) have no such bound.  The per-sample ``f*'`` weights and eta are exact.

    Args:
        params: the shared parameters (or parameter groups with identical hyperparameters).
        num_tasks: m, the number of columns of the per-sample losses.
        lr: gamma, step size of theta and eta.
        pref_lr: beta, step size of w.
        rho: the regularization of the w update.
        c1: theta clip: alpha = min(c1, c2 / ||d||).
        c2: theta clip (see c1).
        f1: eta clip: mu = min(f1, f2 / ||z (.) w||).
        f2: eta clip (see f1).
        lam: lambda > 0, the divergence regularization.
        divergence: a name from :data:`drmoo_kernels.DIVERGENCE_NAMES` (``"cvar_smooth(0.2)"`` style for a
            parameter).
        dual_scale: s in L^(theta, eta) = L(theta, s*eta).
        resample: draw a second batch for step 3.
        capturable: no host read in :meth:`step` (see :mod:`drmoo.optim`, "Capturable steps").
        backend: kernel backend for the Gram/update (see :mod:`drmoo_kernels.dispatch`).
        jacobian: ``"parameters"`` (the paper's: per-task gradients w.r.t. the shared parameters, m
            backward passes through the trunk) or ``"features"`` (w.r.t. the representation z: m
            passes through the heads, one through the trunk; see "Feature space" above).
            Its theta clip alpha = min(c1, c2 / ||J^T w||) reads a norm taken in z, so ``lr`` must be
            chosen for features mode: built in features mode it warns once
            (:class:`~drmoo.optim.FeaturesRateWarning`) unless ``features_rate_chosen=True``.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`): ``"auto"``
            (default: the fewest kernel launches on a GPU, the least memory traffic on the CPU),
            ``"loop"`` (one backward per task) or ``"batched"`` (one vmapped backward); the same gradients
            up to rounding.  Also the ``jacobian_strategy`` attribute, which may be set later.
        features_rate_chosen: say that ``lr`` was chosen for ``jacobian="features"`` (silences the
            warning).

    Defaults and presets.  The defaults are the paper's main Multi-MNIST setting (App. D.2; lambda =
    0.8 as App. F.1 says the main experiments used); ``DoubleClipMGDA.preset(name)`` gives the
    keyword arguments of ``multimnist``, ``celeba`` (App. D.2), ``linear`` and ``wine`` (App. E; the
    paper gives no beta or lambda there: beta 1e-2 as App. F.3, lambda left at its default).

    Learning-rate scale.  The theta step is clipped: its length is gamma * min(c1 ||d||, c2) <=
    gamma * c2, whatever the gradients' size, so gamma is a step *length* and does not transfer to
    the unclipped methods, whose steps are lr times the gradient.  On the MultiLeNet benchmark
    (``--preset small``) the two-stage validation sweep chose gamma = 1 here against 0.1-0.3 for the
    others on 2 digits (``SMALL_LR``).  Nor does gamma transfer between the two Jacobians: the clip's
    norm is taken in z under ``jacobian="features"``, and the same sweep run in features mode chose
    gamma = 0.1 (results/multimnist2-small/features/).
    """

    # Why accumulate mode (drmoo.optim._accumulate) refuses it: the gradients' per-sample weights are taken at
    # eta_{t+1}, which is known only once every micro-batch's losses are.
    ACCUMULATE_REFUSAL: ClassVar[str] = (
        "its gradients' per-sample weights are taken at eta_{t+1}, which depends on the whole batch's losses, "
        "so no micro-batch's part is known before the last one"
    )

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 5e-3, "pref_lr": 1e-2, "rho": 1e-5, "c1": 1.0, "c2": 0.5, "f1": 1.0, "f2": 0.5,
                       "lam": 0.8},
        "celeba": {"lr": 5e-3, "pref_lr": 2e-2, "rho": 5e-5, "c1": 1.0, "c2": 0.5, "f1": 1.0, "f2": 0.5,
                   "lam": 0.8},
        "linear": {"lr": 1e-2, "pref_lr": 1e-2, "rho": 1e-5, "c1": 0.5, "c2": 0.1, "f1": 0.5, "f2": 0.1},
        "wine": {"lr": 1e-2, "pref_lr": 1e-2, "rho": 1e-5, "c1": 0.5, "c2": 0.1, "f1": 0.5, "f2": 0.1},
    }

    def __init__(
        self,
        params: ParamsT,
        num_tasks: int,
        *,
        lr: float = 5e-3,
        pref_lr: float = 1e-2,
        rho: float = 1e-5,
        c1: float = 1.0,
        c2: float = 0.5,
        f1: float = 1.0,
        f2: float = 0.5,
        lam: float = 0.8,
        divergence: str = "chi2",
        dual_scale: float = 1.0,
        resample: bool = True,
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
        features_rate_chosen: bool = False,
    ) -> None:
        defaults = {
            "lr": check_positive("lr", lr, allow_zero=True),
            "pref_lr": check_positive("pref_lr", pref_lr, allow_zero=True),
            "rho": check_positive("rho", rho, allow_zero=True),
            "c1": check_positive("c1", c1),
            "c2": check_positive("c2", c2),
            "f1": check_positive("f1", f1),
            "f2": check_positive("f2", f2),
            "lam": check_positive("lam", lam),
            "divergence": divergence,
            "dual_scale": check_positive("dual_scale", dual_scale),
            "resample": check_flag("resample", resample),
            "capturable": check_flag("capturable", capturable),
        }
        super().__init__(params, num_tasks, defaults, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)
        warn_unless_rate_chosen(self, jacobian, "its theta clip alpha = min(c1, c2 / ||J_z^T w||) reads a norm "
                                "taken in z", features_rate_chosen)

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One iteration of Algorithm 2; calls ``closure`` twice (once if ``resample=False``).

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` (the closure protocol of :mod:`drmoo.optim`); required
                (None raises ValueError).

        Returns the per-task dual objectives at (theta_t, eta_{t+1}) on the gradient batch.
        Nothing (theta, eta, w) changes if any check fails.
        """
        h = self.param_groups[0]
        lam, scale, gamma = h["lam"], h["dual_scale"], h["lr"]
        divergence = self.divergence
        w, eta = self.w, self.eta
        ops = self._ops

        # Steps 1-2: dual step on batch xi (a forward pass is enough).  The op writes eta_{t+1}
        # into a copy: eta itself changes only once the whole iteration has succeeded.
        if h["resample"]:
            with torch.no_grad():
                losses = self.draw_losses(closure, need_graph=False)
        else:
            losses = self.draw_losses(closure, need_graph=True)
        eta_next = eta.clone()
        if distributed.is_distributed():  # z must be the global batch's before eta moves
            _, z, _ = self.dual_forward(losses.detach(), eta, lam, scale)
            direction = z * w.to(z.dtype)
            mu = clip_factor(h["f1"], h["f2"], torch.linalg.vector_norm(direction))
            eta_next -= (gamma * mu * direction).to(eta.dtype)
        else:
            z, mu, _ = ops.dual_step(
                losses.detach(), eta_next, w, lam, scale, divergence, gamma, h["f1"], h["f2"], self.batch_weight
            )

        # Step 3: per-task gradients of the shared parameters at eta_{t+1}, into the flat buffer J.
        grad_losses = self.draw_losses(closure, need_graph=True) if h["resample"] else losses
        objective, z_next, cotangent = self.dual_forward(grad_losses.detach(), eta_next, lam, scale)
        self.check_dual(z, eta_next, z_next, objective)
        jacobian = self.task_jacobian(grad_losses, cotangent, "X", feed_heads=True)

        if self.direction_mode or self.features_engine is not None or is_sharded(self._shared_params()):
            # drmoo.Balancer: the same Gram, alpha and w update (the m x m part every backend's
            # gram_step shares), checked before anything is written; the clipped direction
            # alpha * J^T w_t goes into .grad, so that SGD(lr=gamma) takes line 7's step.
            # jacobian="features" too: J's rows are w.r.t. z, and apply_direction lifts alpha * J^T w_t
            # through the trunk (one backward), so the fused theta write of gram_step cannot be used.
            # FSDP2-sharded parameters too: J holds this rank's columns, the Gram is summed over ranks
            # (||J^T w||^2 = w^T G w, so the clip is exact), and each shard is written from its own columns.
            # w is written last: w_t is read in place (no copy).
            with torch.no_grad():
                gram = self.task_gram(jacobian)
                small = gram_step_small if self.capturable else gram_step_unmasked
                _, alpha64, d_norm, w_next = small(gram, w, h["c1"], h["c2"], h["pref_lr"], h["rho"], mu, z)
            self.check_jacobian(gram, "X")
            self.apply_direction(jacobian, w, alpha64)
            alpha = alpha64.float()
            balanced = balanced_norm(d_norm, z_next, w)
            self.commit_(w, w_next)
        else:
            # Steps 4-5 in one fused op: Gram, clipped theta step through the parameters, w update.
            # The op writes nothing when J is not finite, so raising afterwards leaves theta and w intact.
            # A step that is already failing (a NaN in the losses or dual quantities: capturable, found_inf;
            # eager, a guard not read yet) plants a NaN in J's first entry, so that the op's own guard skips
            # its writes: no host read here (an eager step reads its guards once, at its next write).
            failing = self.failure_so_far
            if failing is not None:
                first = jacobian.view(-1)[:1]
                first.copy_(torch.where(failing, torch.full_like(first, float("nan")), first))
            w_before = w.clone()
            with torch.no_grad():
                gram, d_norm, alpha = ops.gram_step(
                    jacobian, w, self._shared_params(), gamma, h["c1"], h["c2"], h["pref_lr"], h["rho"], mu, z
                )
            self.check_jacobian(gram, "X")
            balanced = balanced_norm(d_norm, z_next, w_before)

        self.commit_(eta, eta_next)
        self.state["drmoo"]["step"] += 1
        self.stats = self._common_stats(objective, balanced, d_norm)
        self.stats.update(alpha=alpha.float(), mu=mu.float(), z=z.detach())
        return objective.detach()


def balanced_norm(d_norm: Tensor, z: Tensor, w: Tensor) -> Tensor:
    """||[alpha J^T w ; z (.) w]||'s report: sqrt(||d||^2 + ||z (.) w||^2), float64."""
    return torch.sqrt(d_norm.double() ** 2 + torch.sum((z.double() * w.double()) ** 2))


def gram_step_unmasked(
    gram_matrix: Tensor, w: Tensor, c1: float, c2: float, beta: float, rho: float, mu: Tensor | float, z: Tensor
) -> tuple[None, Tensor, Tensor, Tensor]:
    """:func:`~drmoo_kernels.reference.gram_step_small`'s arithmetic without its masks, for an eager step.

    The masks (``torch.where`` on "the Gram is finite") keep a capturable step's outputs clean; an eager
    step whose Gram is not finite raises before anything is written (``check_jacobian``), so its outputs
    are never used.  Wherever the Gram is finite the results are the same, bit for bit: the same ops on
    the same values, and ``min(c1, c2 / ||d||)`` is ``clamp(c2 / ||d||, max=c1)`` at ||d|| = 0 too
    (c2 / 0 = +Inf, clamped to c1).  Half the ops (the m x m part is launch-bound).
    """
    gram64 = gram_matrix.double()
    w64 = w.double()
    gram_w = gram64 @ w64
    d_norm = torch.sqrt(torch.clamp(w64 @ gram_w, min=0.0))
    alpha = torch.clamp(c2 / d_norm, max=c1)
    mu64 = torch.as_tensor(mu, dtype=torch.float64, device=w.device)
    pref_grad = alpha * gram_w + mu64 * z.double() ** 2 * w64 + rho * w64
    w_next = project_simplex(w64 - beta * pref_grad).to(w.dtype)
    return None, alpha, d_norm.float(), w_next
