"""MoDo (Chen et al., NeurIPS 2023) on the DR dual: double-sampled preference update, third batch steps."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._base import configure_jacobian
from ._hyperparameters import check_flag
from ._joint import JointBaseline, all_finite, common_defaults, joint_norm, simplex_step
from .types import Closure, ParamsT


class MoDo(JointBaseline):
    r"""MoDo -- multi-objective gradient with double sampling -- with (theta, eta) joint.

    Joint per-task gradients g_i = [grad_theta L^i ; z^i e_i] on three independent batches.  One
    call of :meth:`step`:

    .. code-block:: text

        input: lr (theta and eta), pref_lr (beta), rho, lambda (lam), f (divergence)
        state: theta, eta (0 at start), w in simplex (uniform at start)

        batches xi_1, xi_2, xi_3 (closure calls 1-3), each at (theta_t, eta_t):
           z_k = dL/deta on xi_k,  J_k[i] = grad_theta L^i on xi_k          # 3m backward passes
        cross = J_1 (J_2^T w_t) + z_1 (.) z_2 (.) w_t      # = G_1 G_2^T w_t, never an n x n matrix
        w_{t+1}     = Pi(w_t - beta * (cross + rho * w_t))
        theta_{t+1} = theta_t - lr * J_3^T w_{t+1}          # the NEW weights, on the third batch
        eta_{t+1}   = eta_t   - lr * z_3 (.) w_{t+1}

    The two weight batches make G_1 G_2^T w an unbiased estimate of the true product (a single
    batch would be biased by the gradient covariance); beta acts on squared-gradient-scaled
    quantities (LibMTL's 1e-3 vs the official code's 0.1 on different losses is the same method).

    Differences from the authors' implementation (heshandevaka/Trade-Off-MOL), each decided:

    * Their three-sample form (``grad_modo`` with ``num_samples = 3`` in the toy scripts) is this
      update exactly: w <- Pi(w - gamma (G_1 (G_2^T w) + rho w)), step along G_3^T w_{t+1}.
    * Their LibMTL ``MoDo`` (and the two-sample toy mode) draws only two batches and steps along
      (G_1 + G_2)^T w_{t+1} (or half of it), re-using the weight batches for the step: not
      reproduced -- the paper's algorithm and its analysis use a third, independent batch.
    * Their commented-out gradient normalization (``modo_gn``) is not offered.

    Cost per step: 3 closure calls (3 independent batches, 3B samples), 3m backward passes; the
    heads are fed from batch 3 only.

    ``stats``: ``w`` (= w_{t+1}), ``eta``, ``dual_objective`` (on xi_3), ``balanced_grad_norm`` =
    ||[J_3^T w_{t+1} ; z_3 (.) w_{t+1}]||, ``theta_grad_norm`` = ||J_3^T w_{t+1}||, ``z`` (xi_3),
    ``step_weights``, ``batches``.

    Learning-rate scale.  ``lr`` multiplies the unnormalised direction J_3^T w (a weighted mean of
    the task gradients), as in SGD; it does not transfer to Double-Clip's clipped step.

    Presets: ``multimnist`` (defaults), ``celeba``, ``linear`` (App. E.1: lr = pref_lr = 1e-5,
    rho = 1e-5), ``wine`` (App. E.2: lr 1e-3, pref_lr 6e-4, rho = 1e-6).

    Feature space (``jacobian="features"``).  Rows w.r.t. the
    representation z are one batch's per-sample coordinates, so products of two independent batches'
    rows (G_1 G_2^T w) estimate nothing: features mode runs the single-batch form only (the three
    draws are one batch: ``Balancer.backward(losses, features=z)``, or a closure returning the same
    batch), where cross = J_z J_z^T w (the z-space Gram, biased by the gradient covariance like any
    one-batch estimate); fresh batches are refused at the second draw.  theta moves along
    (dz/dtheta)^T J_z^T w_{t+1} (ONE backward through the trunk).  Norms in ``stats`` are z-space.
    The bound ||J_theta^T c|| <= ||dz/dtheta|| * ||J_z^T c|| (dz/dtheta: the trunk's Jacobian on
    the batch, operator norm) relates every norm taken in z to the true one; inner products (the
    Gram's off-diagonal) have no such bound.  The per-sample ``f*'`` weights and eta are exact.

    Args:
        params: the shared parameters.
        num_tasks: m.
        lr: step of theta and eta.
        pref_lr: beta.
        rho: regularization of the w update.
        lam: lambda > 0.
        divergence: f.
        capturable: no host read in :meth:`step` (see :mod:`drmoo.optim`, "Capturable steps").
        backend: kernel backend (see :mod:`drmoo_kernels.dispatch`).
        jacobian: ``"parameters"`` (the paper's: per-task gradients w.r.t. the shared parameters, m
            backward passes through the trunk) or ``"features"`` (w.r.t. the representation z: m
            passes through the heads, one through the trunk; see "Feature space" above).  Its theta
            step is the exact gradient of sum_i c_i L^i either way (only the weights are taken in z),
            so its rates carry over.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`): ``"auto"``
            (default: the fewest kernel launches on a GPU, the least memory traffic on the CPU),
            ``"loop"`` (one backward per task) or ``"batched"`` (one vmapped backward); the same gradients
            up to rounding.  Also the ``jacobian_strategy`` attribute, which may be set later.
    """

    DRAWS_SHARE_ONE_POINT: ClassVar[bool] = True  # its three batches are all taken at (theta_t, eta_t)
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 1e-4, "pref_lr": 1e-6, "rho": 1e-5, "lam": 0.8},
        "celeba": {"lr": 1e-4, "pref_lr": 5e-5, "rho": 5e-5, "lam": 0.8},
        "linear": {"lr": 1e-5, "pref_lr": 1e-5, "rho": 1e-5},
        "wine": {"lr": 1e-3, "pref_lr": 6e-4, "rho": 1e-6},
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
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
    ) -> None:
        defaults = common_defaults(lam, divergence, lr=lr, pref_lr=pref_lr, rho=rho)
        super().__init__(params, num_tasks, {**defaults, "capturable": check_flag("capturable", capturable)}, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One MoDo iteration; calls ``closure`` three times.  Nothing changes if a check fails.

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` -- or an iterable of micro-batches that make the batch, for the
                whole batch's step without its whole graph in memory (the closure protocol of
                :mod:`drmoo.optim`, :data:`drmoo.optim.Closure`); required (None raises ValueError).
        """
        h = self.param_groups[0]
        self.begin_step()
        first = self.task_gradients(closure, "G1", feed_heads=False)
        second = self.task_gradients(closure, "G2", feed_heads=False)
        third = self.task_gradients(closure, "G3", feed_heads=True)
        assert first.jacobian is not None and second.jacobian is not None and third.jacobian is not None

        w = self.w.double()
        gram = self.task_gram(third.jacobian)
        if first.jacobian is second.jacobian is third.jacobian or self.features_engine is not None:
            # drmoo.Balancer's single-batch form: the three draws are one batch at one eta, hence one
            # Jacobian G, and G_1 (G_2^T w) = (G G^T) w comes from the Gram the step needs anyway
            # (two passes over [m, n] fewer).  A non-finite entry of G reaches its diagonal.
            # jacobian="features" draws one batch too (others are refused): the same G, in z's coordinates.
            cross = gram.double() @ w + first.z.double() * second.z.double() * w
            self.raise_unless_finite([("G1", torch.isfinite(cross)), ("G3", torch.isfinite(torch.diagonal(gram)))])
        else:
            # G_1 (G_2^T w) in two passes over n, in the Jacobians' accumulation precision.
            acc = torch.float64 if first.jacobian.dtype == torch.float64 else torch.float32
            combined_second = w.to(acc) @ second.jacobian.to(acc)
            # (FSDP2-sharded rows hold this rank's columns: the product is summed over ranks, an m-vector)
            product = self.jacobian_engine.products_over_ranks((first.jacobian.to(acc) @ combined_second).double())
            cross = product + first.z.double() * second.z.double() * w
            # A non-finite entry of J_2 reaches every entry of J_2^T w, one of J_1 its row of the product.
            self.raise_unless_finite([
                ("G1", torch.isfinite(cross)),
                ("G2", all_finite(combined_second).expand(self.num_tasks)),
                ("G3", torch.isfinite(torch.diagonal(gram))),
            ])

        w_next = simplex_step(w, cross + h["rho"] * w, h["pref_lr"])
        self.step_joint(third.jacobian, third.z, w_next)
        self.set_w(w_next)
        return self.finish_step(third, w_next, joint_norm(gram, w_next), third.z.double() * w_next)
