"""MoCo (Fernando et al., ICLR 2023) on the DR dual: tracked gradients, projected preference update."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._base import configure_jacobian
from ._guards import finite_entries
from ._hyperparameters import check_flag
from ._joint import JointBaseline, check_fraction, common_defaults, joint_gram, joint_norm, simplex_step
from ._state_dict import STATE_KEY
from .types import Closure, ParamsT


class MoCo(JointBaseline):
    r"""MoCo -- multi-objective gradient correction by tracking -- with (theta, eta) joint.

    A tracking matrix Y estimates the joint per-task gradients across iterations; its theta block
    Y_theta (m x n) and its eta block (diagonal, kept as the vector y_eta) start at 0.  One call of
    :meth:`step` (the paper's projected form):

    .. code-block:: text

        input: lr (theta and eta), pref_lr (beta), rho, ema, lambda (lam), f (divergence)
        state: theta, eta (0), w in simplex (uniform), Y_theta = 0 (m x n), y_eta = 0 (m)

        batch xi (closure call 1): z = dL/deta, J[i] = grad_theta L^i at (theta_t, eta_t)   # m backward
        Y_theta <- ema * Y_theta + (1 - ema) * J         # ema weighs the OLD estimate (paper: 0.95)
        y_eta   <- ema * y_eta   + (1 - ema) * z
        w_{t+1}     = Pi(w_t - beta * ((Y_theta Y_theta^T + diag(y_eta^2) + rho I) w_t))
        theta_{t+1} = theta_t - lr * Y_theta^T w_{t+1}
        eta_{t+1}   = eta_t   - lr * y_eta (.) w_{t+1}

    This is the published projected update.  No bias correction of the zero start is applied
    (Y = 0.05 J after the first step with ema = 0.95), as in the authors' code.

    Differences from the authors' implementation, each decided:

    * Their MoCo in heshandevaka/Trade-Off-MOL (``LibMTL/weighting/MoCo.py``, and ``grad_moco`` of
      its toy scripts) is this update: y <- y - beta_y (y - G) (beta_y = 1 - ema), w <- Pi(w -
      gamma (Y Y^T w + rho w)), step along Y^T w_{t+1}.  No difference, except their optional
      normalization of Y by loss or norm (``moco_gn``, default none), not offered here.
    * Their first release (heshandevaka/MoCo, the "Tracking" weighting) decays both step sizes as
      beta / t^sigma, puts a factor 2 on the gradient of w and has no rho: not reproduced (the DR
      paper's constant rates, Tables 4-5).
    * LibMTL's MoCo (median-research-group/LibMTL) uses softmax(w - step) instead of Pi, rescales
      each g_i to loss_i g_i / ||g_i|| and decays its rates: not this method, not reproduced.
      (TorchJD has no MoCo.)

    Cost per step: 1 closure call (one batch), m backward passes, and m x n persistent memory for
    Y_theta (saved in ``state_dict``).

    ``stats``: ``w`` (= w_{t+1}), ``eta``, ``dual_objective`` (on xi), ``balanced_grad_norm`` =
    ||[J^T w_{t+1} ; z (.) w_{t+1}]|| on the batch (the raw stochastic gradients, comparable across
    methods), ``theta_grad_norm`` = ||J^T w_{t+1}||, ``tracked_grad_norm`` = ||[Y_theta^T w_{t+1} ;
    y_eta (.) w_{t+1}]|| (the direction actually stepped), ``z``, ``step_weights``, ``batches``.

    Learning-rate scale.  ``lr`` multiplies the tracked direction Y_theta^T w, an exponential moving
    average of the gradients (heavy momentum without bias correction): its size follows the
    gradients', as in SGD with momentum, and the first steps are (1 - ema) times smaller.  It does
    not transfer to Double-Clip's clipped step.

    Presets: ``multimnist`` (defaults: lr 5e-4, pref_lr 1e-4), ``celeba``, ``linear`` (App. E.1:
    lr = pref_lr = 1e-5, rho = 1e-5), ``wine`` (App. E.2: lr 1e-3, pref_lr 6e-4, rho = 1e-6);
    ema = 0.95 throughout.

    Feature space: refused (``jacobian="features"`` raises at construction).  The tracked Y
    averages per-task gradients across steps, i.e. across batches; a features Jacobian's columns are
    one batch's samples (sample b of one batch is not sample b of the next), so Y would average
    unrelated samples, and Y^T w could not be lifted through any one batch's trunk.  (Tracking the
    per-task gradients w.r.t. z would only be defined for a fixed batch of fixed samples.)

    Args:
        params: the shared parameters.
        num_tasks: m.
        lr: step of theta and eta.
        pref_lr: beta.
        rho: regularization of the w update.
        ema: in [0, 1), the weight of the old Y.
        lam: lambda > 0.
        divergence: f.
        capturable: no host read in :meth:`step` (see :mod:`drmoo.optim`, "Capturable steps").
        backend: kernel backend (see :mod:`drmoo_kernels.dispatch`).
        jacobian: ``"parameters"`` only (per-task gradients w.r.t. the shared parameters);
            ``"features"`` (w.r.t. the representation z) is refused: MoCo's tracked Jacobian averages
            rows across steps, i.e. across batches, whose z coordinates differ.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`): ``"auto"``
            (default: the fewest kernel launches on a GPU, the least memory traffic on the CPU),
            ``"loop"`` (one backward per task) or ``"batched"`` (one vmapped backward); the same gradients
            up to rounding.  Also the ``jacobian_strategy`` attribute, which may be set later.
    """

    # jacobian="features" (drmoo.optim._features) is refused at construction, for this reason:
    FEATURES_REFUSAL: ClassVar[str] = (
        "its tracked Jacobian Y averages per-task gradients over steps, and a features Jacobian's columns are "
        "one batch's samples (sample b of one batch is not sample b of the next), so Y would average unrelated "
        "samples and Y^T w could not be lifted through any one batch's trunk; use jacobian='parameters'"
    )
    # Parameters mode on FSDP2-sharded shared parameters (drmoo.optim._fsdp) is refused at construction, for this
    # reason: each rank could track its shard's columns, but the state would then be per rank.
    SHARDED_REFUSAL: ClassVar[str] = (
        "its tracked m x n Jacobian estimate Y would be held as each rank's shard of columns, so its state_dict would "
        "depend on the sharding and could not be resumed on another world size"
    )
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "multimnist": {"lr": 5e-4, "pref_lr": 1e-4, "rho": 1e-5, "lam": 0.8, "ema": 0.95},
        "celeba": {"lr": 5e-4, "pref_lr": 5e-5, "rho": 5e-5, "lam": 0.8, "ema": 0.95},
        "linear": {"lr": 1e-5, "pref_lr": 1e-5, "rho": 1e-5, "ema": 0.95},
        "wine": {"lr": 1e-3, "pref_lr": 6e-4, "rho": 1e-6, "ema": 0.95},
    }

    def __init__(
        self,
        params: ParamsT,
        num_tasks: int,
        *,
        lr: float = 5e-4,
        pref_lr: float = 1e-4,
        rho: float = 1e-5,
        ema: float = 0.95,
        lam: float = 0.8,
        divergence: str = "chi2",
        capturable: bool = False,
        backend: str | None = None,
        jacobian: str = "parameters",
        jacobian_strategy: str = "auto",
    ) -> None:
        defaults = {
            **common_defaults(lam, divergence, lr=lr, pref_lr=pref_lr, rho=rho),
            "ema": check_fraction("ema", ema, "the weight of the old tracking estimate"),
            "capturable": check_flag("capturable", capturable),
        }
        super().__init__(params, num_tasks, defaults, backend)
        self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)

    def extra_state(self) -> dict[str, Any]:
        dtype = self._shared_params()[0].dtype
        return {
            "tracking": torch.zeros(self.num_tasks, self.num_shared, device=self.device, dtype=dtype),
            "tracking_eta": torch.zeros(self.num_tasks, device=self.device, dtype=torch.float64),
        }

    def validate_state_dict(self, state_dict: Any) -> None:
        """As every drmoo optimizer's (the base class's), and refuse a tracked Jacobian whose Gram is not
        finite (rows too large to square in their dtype): every step from it would overflow.

        Args:
            state_dict: what was handed to ``load_state_dict``.
        """
        super().validate_state_dict(state_dict)
        tracking = state_dict["state"][STATE_KEY]["tracking"].detach()
        acc = torch.float64 if tracking.dtype == torch.float64 else torch.float32  # as the ``gram`` op
        squared_norms = (tracking.to(acc) * tracking.to(acc)).sum(dim=1)
        if not bool(torch.isfinite(squared_norms).all()):
            raise ValueError(
                "state_dict's tracking (MoCo's tracked Jacobian) has rows too large to square in "
                f"{tracking.dtype}: its Gram is not finite, so every step from it would overflow; it was "
                "not saved by a MoCo run that stepped normally (or is damaged)"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (see the base class); the tracked Jacobian grows by the new shared parameters'
        columns, started at zero as every column was at construction.

        Args:
            param_group: the new group, as for :meth:`torch.optim.Optimizer.add_param_group`: its
                ``"params"`` and any hyperparameters that differ from the defaults.
        """
        tracking = self.state[STATE_KEY].get("tracking") if STATE_KEY in self.state else None
        before = self.num_shared if tracking is not None else 0
        super().add_param_group(param_group)
        if tracking is not None and self.num_shared > before:  # (at construction there is no tracking yet)
            grown = tracking.new_zeros(tracking.shape[0], self.num_shared - before)
            self.state[STATE_KEY]["tracking"] = torch.cat([tracking, grown], dim=1)

    def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
        """One MoCo iteration; calls ``closure`` once.  Nothing changes if a check fails.

        Args:
            closure: draws a fresh batch and returns its per-sample losses ``[B, m]`` with their graph,
                or ``(losses, sample_weight)`` -- or an iterable of micro-batches that make the batch, for the
                whole batch's step without its whole graph in memory (the closure protocol of
                :mod:`drmoo.optim`, :data:`drmoo.optim.Closure`); required (None raises ValueError).
        """
        h = self.param_groups[0]
        state = self.state[STATE_KEY]
        tracked = state["tracking"].shape[1]
        if tracked != self.num_shared:
            raise ValueError(
                f"MoCo tracks the Jacobian of {tracked} shared entries, but the shared parameters that require "
                f"grad now hold {self.num_shared} (requires_grad was toggled since the optimizer was built); its "
                "tracked estimate cannot follow a change of the shared set: build a new MoCo for the new set"
            )
        self.begin_step()
        batch = self.task_gradients(closure, "J", feed_heads=True)
        assert batch.jacobian is not None
        gram = self._ops.gram(batch.jacobian)
        self.raise_unless_finite([("J", finite_entries(torch.diagonal(gram)))])

        # Y <- ema Y + (1 - ema) J, formed in J's buffer (the step's scratch; J's Gram is taken): the
        # tracked estimate is written only once every guard of the step -- w_{t+1} from the new Y's Gram
        # among them -- has passed, so that a step that overflows changes nothing.
        tracking: Tensor = state["tracking"]
        with torch.no_grad():
            new_tracking = torch.lerp(tracking, batch.jacobian, 1.0 - h["ema"], out=batch.jacobian)
        tracking_eta = h["ema"] * state["tracking_eta"] + (1.0 - h["ema"]) * batch.z.double()

        tracked_gram = joint_gram(self._ops.gram(new_tracking), tracking_eta)
        self.require_finite(finite_entries(torch.diagonal(tracked_gram)), lambda bad: (
            f"MoCo's tracked Jacobian overflowed (task(s) {bad}: its Gram is not finite) in "
            f"{self.failing_iteration}; the step was abandoned and nothing was updated"))
        w = self.w.double()
        w_next = simplex_step(w, tracked_gram @ w + h["rho"] * w, h["pref_lr"])
        self.step_joint(new_tracking, tracking_eta, w_next)  # its guards (w_{t+1} finite) are read first
        self.commit_(tracking, new_tracking)
        self.commit_(state["tracking_eta"], tracking_eta)
        self.set_w(w_next)
        return self.finish_step(
            batch, w_next, joint_norm(gram, w_next), batch.z.double() * w_next,
            tracked_grad_norm=joint_norm(tracked_gram, w_next).float(),
        )
