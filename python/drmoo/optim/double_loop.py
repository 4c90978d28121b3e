"""Double-Loop MGDA (paper Algorithm 1): inner SGD on the duals, double-sampled MGDA outside."""

from __future__ import annotations

import hashlib
import random
from typing import Any, ClassVar

import torch
from torch import Tensor

from drmoo_kernels.reference import project_simplex

from ._base import MultiObjectiveOptimizer, configure_jacobian
from ._hyperparameters import check_flag, check_positive
from ._loss_scale import divide_, times
from ._state_dict import STATE_KEY
from .types import Closure, ParamsT


class DoubleLoopMGDA(MultiObjectiveOptimizer):
    r"""Double-Loop MGDA for distributionally robust multi-objective optimization.

    Applies stochastic MGDA with double sampling (the one-step form, paper eq. (6)) to the dual of
    DR-MOO (eq. (4)), :math:`\phi^i(\theta) = \min_\eta L^i(\theta, \eta)`, estimating each
    :math:`\eta^{i,*}` with an inner loop of SGD.  One call of :meth:`step` is one outer iteration t:

    .. code-block:: text

        input: alpha (lr), gamma (dual_lr), beta (pref_lr), rho, D (inner_steps), lambda, f
        state: theta, eta_{t,0} (warm start, 0 at t = 0), w_t in simplex (uniform at t = 0)

        for d = 0 .. D-1:                                   # lines 3-6, closure calls 1..D
            batch xi_{t,d} (forward only); l = losses [B, m]
            V_d = dL/deta = 1 - mean_b f*'((l - eta_{t,d}) / lambda)
            eta_{t,d+1} = eta_{t,d} - gamma * V_d
        d, d_bar, d_tilde ~ Uniform{0 .. D-1} independently  # line 7
        three fresh batches xi, xi_bar, xi_tilde            # line 8, closure calls D+1..D+3
        Y       = grad_theta L(theta_t, eta_{t,d};       xi)        # rows = tasks   (line 9)
        Y_bar   = grad_theta L(theta_t, eta_{t,d_bar};   xi_bar)    #                (line 10)
        Y_tilde = grad_theta L(theta_t, eta_{t,d_tilde}; xi_tilde)  #                (line 11)
        theta_{t+1} = theta_t - alpha * Y^T w_t                                        # line 12
        w_{t+1} = Pi(w_t - beta * (Y_bar (Y_tilde^T w_t) + rho * w_t))                 # line 13
        eta_{t+1,0} = eta_{t,D}                              # warm start of the next inner loop

    Lines 12-13 are eq. (6)'s double-sampled MGDA step on the duals phi^i of eq. (4), with Pi the
    Euclidean projection onto the simplex.  Y_tilde enters line 13 only through the vector
    Y_tilde^T w_t, and Y_bar only through its product with it: no n x n or m x m product is formed.

    Each inner draw xi_{t,d} serves all m tasks at once (one multi-task batch gives every task's
    losses); the three outer batches are independent of each other and of the inner ones.  Samples
    per iteration: (D + 3) batches.  The indices d, d_bar, d_tilde come from the optimizer's own
    host-side generator, ``random.Random(seed)`` (three ``randrange(D)`` per step; its state is
    saved in ``state_dict``), so that a resumed run is identical and drawing them never reads a
    tensor.  Under CUDA-graph replay the captured indices repeat: do not capture this step.

    ``stats`` after a step: ``w``, ``eta`` (= eta_{t,D}), ``dual_objective`` (L at eta_{t,d} on xi),
    ``balanced_grad_norm`` = ||[Y^T w_t ; z (.) w_t]|| on xi (the joint (theta, eta) measure used for
    every method) and ``theta_grad_norm`` = ||Y^T w_t||, ``inner_indices`` = (d, d_bar, d_tilde).

    Feature space (``jacobian="features"``).  Y, Y_bar and Y_tilde
    are taken w.r.t. the representation z, which belongs to one batch: features mode runs the
    single-batch form (xi = xi_bar = xi_tilde, each at its own inner iterate of eta:
    ``Balancer.backward(losses, features=z)`` or a closure returning the same batch; fresh batches
    are refused at the second outer draw).  Y_bar Y_tilde^T w is then in z's coordinates and theta
    moves along (dz/dtheta)^T Y^T w_t (ONE backward through the trunk).  The inner loop on eta is
    unchanged.  Norms in ``stats`` are z-space.
    Cost of a features step: Y and Y_bar take m backward passes above z each, and Y_tilde is never
    formed: Y_tilde^T w_t = d (sum_b,i w_i c~[b, i] L[b, i]) / dz (c~ the cotangents at
    eta_{t,d_tilde}) is ONE pass above z -- 2m + 1 passes above z (was 3m), plus the one through
    the trunk.  (With ``jacobian_strategy = "batched"``, each Jacobian is one vmapped pass: 2 vmapped
    passes + 1 plain pass + 1 pass feeding the heads, was 3 + 1; with ``"auto"`` and separate heads,
    each is one ordinary pass that also feeds the heads.)  The
    same is not done in parameters mode, where it would save m - 1 passes through the trunk: the
    sum over tasks would then be autograd's, not the matrix product's, and change the paper's
    reference results in their last bits.  A NaN/Inf that Y_tilde's rows would hold still stops the
    step: Y's rows, on the same batch and heads, are checked task by task (through Y Y^T's diagonal);
    the one pass propagates it too (0 * Inf = NaN through a zero w_i); and Y_tilde^T w_t is checked.
    The bound ||J_theta^T c|| <= ||dz/dtheta|| * ||J_z^T c|| (dz/dtheta: the trunk's Jacobian on
    the batch, operator norm) relates every norm taken in z to the true one; inner products (the
    Gram's off-diagonal) have no such bound.  The per-sample ``f*'`` weights and eta are exact.

    Args:
        params: the shared parameters (or parameter groups with identical hyperparameters).
        num_tasks: m.
        lr: alpha, theta step.
        dual_lr: gamma, inner eta step.
        pref_lr: beta.
        rho: regularization of the w update.
        inner_steps: D >= 1.
        lam: lambda > 0.
        divergence: see :func:`drmoo_kernels.get_divergence`.
        seed: seed of the index generator (default: drawn from torch's global generator, so
            ``torch.manual_seed`` fixes it).
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

    Defaults and presets.  The defaults are the paper's main Multi-MNIST setting (App. D.2, with
    lambda = 0.8 as App. F.1 says); ``DoubleLoopMGDA.preset(name)`` gives ``multimnist``,
    ``celeba`` (App. D.2), ``linear`` (App. E.1) and ``wine`` (App. E.2).

    Learning-rate scale.  alpha (``lr``) multiplies the unnormalised direction Y^T w, so the step
    grows with the gradients, as in SGD; gamma (``dual_lr``) steps eta by the raw dual gradient.
    Neither transfers to Double-Clip's clipped, normalised step.
    """

    # Why accumulate mode (drmoo.optim._accumulate) refuses it: its gradients are taken at inner iterates of eta,
    # which depend on the whole batch's losses.
    ACCUMULATE_REFUSAL: ClassVar[str] = (
        "its gradients are taken at inner iterates of eta, which depend on the whole batch's losses, so no "
        "micro-batch's part is known before the last one"
    )

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 5e-4, "dual_lr": 3e-3, "pref_lr": 1e-5, "rho": 1e-5, "inner_steps": 5, "lam": 0.8},
        "celeba": {"lr": 5e-4, "dual_lr": 3e-4, "pref_lr": 5e-5, "rho": 5e-5, "inner_steps": 5, "lam": 0.8},
        "linear": {"lr": 5e-5, "dual_lr": 5e-3, "pref_lr": 5e-5, "rho": 1e-5, "inner_steps": 20},
        "wine": {"lr": 1e-3, "dual_lr": 5e-3, "pref_lr": 6e-4, "rho": 1e-6, "inner_steps": 15},
    }

    def __init__(
        self,
        params: ParamsT,
        num_tasks: int,
        *,
        lr: float = 5e-4,
        dual_lr: float = 3e-3,
        pref_lr: float = 1e-5,
        rho: float = 1e-5,
        inner_steps: int = 5,
        lam: float = 0.8,
        divergence: str = "chi2",
        seed: int | None = None,
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
    ) -> None:
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"inner_steps must be an int >= 1, got {inner_steps!r}")
        defaults = {
            "lr": check_positive("lr", lr, allow_zero=True),
            "dual_lr": check_positive("dual_lr", dual_lr, allow_zero=True),
            "pref_lr": check_positive("pref_lr", pref_lr, allow_zero=True),
            "rho": check_positive("rho", rho, allow_zero=True),
            "inner_steps": inner_steps,
            "lam": check_positive("lam", lam),
            "divergence": divergence,
            "capturable": check_flag("capturable", capturable),
        }
        super().__init__(params, num_tasks, defaults, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._index_rng = random.Random(seed)

    def state_entries(self) -> dict[str, Any]:
        return {**super().state_entries(), "index_rng_state": self._index_rng.getstate()}

    def state_dict(self) -> dict[str, Any]:
        self.state[STATE_KEY]["index_rng_state"] = self._index_rng.getstate()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a DoubleLoopMGDA state; one saved with the former torch index generator
        (``rng_state``) continues with a generator seeded from that state's bytes.

        Args:
            state_dict: a ``state_dict()`` of a DoubleLoopMGDA for the same problem.
        """
        saved = state_dict.get("state", {}).get(STATE_KEY) if isinstance(state_dict, dict) else None
        if isinstance(saved, dict) and "index_rng_state" not in saved and isinstance(saved.get("rng_state"), Tensor):
            legacy = saved["rng_state"].detach().cpu().contiguous().numpy().tobytes()
            upgraded = {key: value for key, value in saved.items() if key != "rng_state"}
            seed = int.from_bytes(hashlib.sha256(legacy).digest()[:8], "big")  # byteorder: required on Python 3.10
            upgraded["index_rng_state"] = random.Random(seed).getstate()
            state_dict = {**state_dict, "state": {**state_dict["state"], STATE_KEY: upgraded}}
        self.validate_state_dict(state_dict)
        generator = random.Random()
        try:
            generator.setstate(state_dict["state"][STATE_KEY]["index_rng_state"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"state_dict's index_rng_state is not a random.Random state ({error})") from None
        super().load_state_dict(state_dict)
        self._index_rng = generator

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One outer iteration of Algorithm 1; calls ``closure`` inner_steps + 3 times.

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` (the closure protocol of :mod:`drmoo.optim`); required
                (None raises ValueError).

        Returns the per-task dual objectives at (theta_t, eta_{t,d}) on batch xi.  Nothing (theta,
        eta, w) changes if any check fails.
        """
        h = self.param_groups[0]
        lam = h["lam"]
        w = self.w

        # Inner loop (lines 3-6): SGD on each task's one-dimensional convex dual problem.
        etas = [self.eta.clone()]
        with torch.no_grad():
            for _ in range(h["inner_steps"]):
                losses = self.draw_losses(closure, need_graph=False)
                _, grad_eta, _ = self.dual_forward(losses, etas[-1], lam, 1.0)
                etas.append(etas[-1] - h["dual_lr"] * grad_eta)
            self.check_dual(*etas)
        rng_before = self._index_rng.getstate()
        indices = [self._index_rng.randrange(h["inner_steps"]) for _ in range(3)]  # host-side: no tensor read
        try:  # (an eager step reads its guards once, at its first write below)
            jac, cross, objective, z_main, gram = self._outer_gradients(closure, etas, indices)
            w64 = w.double()
            theta_norm = torch.sqrt(torch.clamp(w64 @ (gram.double() @ w64), min=0.0))

            # Lines 12-13.  Y_bar (Y_tilde^T w) costs two passes and never forms an n x n or m x m product.
            self.apply_direction(jac, w)
            w_next = project_simplex(w64 - h["pref_lr"] * (cross + h["rho"] * w64)).to(w.dtype)

            balanced = torch.sqrt(theta_norm**2 + torch.sum((z_main.double() * w64) ** 2))
            self.commit_(self.eta, etas[-1])
            self.commit_(w, w_next)
        except BaseException:
            self._index_rng.setstate(rng_before)  # a failed step leaves no trace, its draws included
            raise
        self.state[STATE_KEY]["step"] += 1
        self.stats = self._common_stats(objective, balanced, theta_norm)
        self.stats["inner_indices"] = torch.tensor(indices)
        return objective.detach()

    def _outer_gradients(
        self, closure: Closure | None, etas: list[Tensor], indices: list[int]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Lines 8-11 on three independent batches, checked: Y, Y_bar (Y_tilde^T w), L, z on xi, Y Y^T.

        Parameters mode forms all three Jacobians (3m passes through the trunk, as the paper does).
        Features mode forms Y and Y_bar (m passes above z each) and only Y_tilde^T w of Y_tilde, the
        one thing of it line 13 uses, by ONE pass above z (:meth:`_tilde_times_w`).
        """
        h = self.param_groups[0]
        features = self.features_engine
        jacobians, objective, z_main, tilde_w = [], None, None, None
        for role, index in zip(("Y", "Y_bar", "Y_tilde"), indices):
            losses = self.draw_losses(closure, need_graph=True)
            obj, z, cotangent = self.dual_forward(losses.detach(), etas[index], h["lam"], 1.0)
            self.check_dual(obj, z)
            if role == "Y_tilde" and features is not None:
                tilde_w = self._tilde_times_w(losses, cotangent)
            else:
                jacobians.append(self.task_jacobian(losses, cotangent, role, feed_heads=role == "Y"))
            if role == "Y":
                objective, z_main = obj, z
        assert objective is not None and z_main is not None
        jac, jac_bar = jacobians[:2]
        gram = self.task_gram(jac)
        self.check_jacobian(gram, "Y")
        # Y_bar (Y_tilde^T w), in the Jacobians' accumulation precision, is all the w update uses of
        # them: a NaN/Inf anywhere in either reaches it (also through a zero weight: 0 * Inf = NaN).
        acc = torch.float64 if jac_bar.dtype == torch.float64 else torch.float32
        if tilde_w is None:  # parameters mode: the paper's three Jacobians
            cross = (jac_bar.to(acc) @ (self.w.to(acc) @ jacobians[2].to(acc))).double()
        else:
            tilde_w = tilde_w.to(acc)
            cross = (jac_bar.to(acc) @ tilde_w).double()
            # Y_tilde^T w itself is checked too, not only through the product (a non-finite entry
            # facing a zero column of Y_bar must not depend on how the matmul treats 0 * Inf): NaN on
            # this rank's cross, which the sum below carries to every rank.
            cross = cross.masked_fill(~torch.isfinite(tilde_w).all(), float("nan"))
        # Rows w.r.t. z (each rank holds its samples' columns) or FSDP2-sharded rows (its shard's): summed over ranks
        cross = self.jacobian_engine.products_over_ranks(cross)
        self.require_finite(torch.isfinite(cross), lambda bad: (
            f"non-finite gradients of the shared parameters (Y_bar, Y_tilde) in {self.failing_iteration}; "
            "the step was abandoned and nothing was updated"))
        return jac, cross, objective, z_main, gram

    def _tilde_times_w(self, losses: Tensor, cotangent: Tensor) -> Tensor:
        """Features mode: Y_tilde^T w_t [sum of z's numel] in ONE backward pass above z.

        Row i of Y_tilde is d (sum_b cotangent[b, i] losses[b, i]) / dz, so by linearity
        Y_tilde^T w = d (sum_b,i w_i cotangent[b, i] losses[b, i]) / dz: the pass of the combined
        cotangent ``cotangent * w`` (times ``loss_scale``, divided back afterwards, as
        :meth:`task_jacobian` does).  Like the roles other than Y, it feeds no head.  The graph
        check of :meth:`task_jacobian` (the losses read the trunk only through z) runs on these
        losses too; their graph above z is kept, as the Jacobians' passes keep it.

        The sum over tasks is autograd's accumulation at z, in z's dtype (float32 / float64 for a
        float32 / float64 z: the Jacobians' accumulation precision; a half-precision z sums in half,
        as the features lift and the combined gradients of FAMO and Nash-MTL do).  Each rank keeps its
        samples' entries (the cross product is summed over ranks).
        """
        features = self.features_engine
        assert features is not None
        features.heads(losses, self._shared_params())  # the same refusal as the Jacobians' (no head fed)
        scale = self.loss_scale
        weighted = times(cotangent * self.w.to(cotangent.dtype)[None, :], scale)
        flat = features.combined_gradient(self, losses, weighted.to(losses.dtype), "Y_tilde^T w", retain_graph=True)
        return divide_(flat, scale)
