"""``Balancer(..., optimizer=...)``: eta's step size follows the torch optimizer's learning rate.

The rate of the optimizer's group that holds the shared parameters is copied into the method's ``lr`` before
each backward (so a scheduler on the optimizer reaches eta too); Double-Loop's ``dual_lr`` keeps its ratio to
that rate.  A rate is checked before it is copied: a refused backward leaves the balancer's rates valid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from drmoo.optim._base import MultiObjectiveOptimizer
from drmoo.optim._hyperparameters import check_hyperparameter

# The methods whose dual_lr (eta's inner step) scales with the coupled rate.
DUAL_LR_METHODS = frozenset({"double-loop"})


class RateCoupling:
    """The coupling of one balancer's method (``algorithm``) to ``optimizer``'s learning rate."""

    def __init__(self, method: str, algorithm: MultiObjectiveOptimizer, optimizer: torch.optim.Optimizer) -> None:
        self.algorithm, self.optimizer = algorithm, optimizer
        group = self.lr_group()  # refuse an optimizer that does not hold the shared parameters now
        # Double-Loop: dual_lr / lr, kept as the optimizer's rate moves (None: no dual_lr to scale)
        self.dual_lr_ratio: float | None = None
        if method in DUAL_LR_METHODS:
            start = float(group.get("initial_lr", group["lr"]))
            if not start > 0.0:
                raise ValueError(
                    f"drmoo.Balancer({method!r}, optimizer=...): eta's step dual_lr follows the optimizer's "
                    f"learning rate in ratio to its starting rate, which is {start!r}; build the balancer while "
                    "the rate is > 0, or leave optimizer= out (dual_lr is then fixed)")
            self.dual_lr_ratio = float(algorithm.hyper("dual_lr")) / start
        self.follow()  # a state saved before the first backward holds the coupled rates

    def lr_group(self) -> dict[str, Any]:
        """The optimizer's parameter group that holds the shared parameters (one lr for all of them)."""
        shared = {id(param) for param in self.algorithm._shared_params()}
        groups = [group for group in self.optimizer.param_groups if any(id(p) in shared for p in group["params"])]
        if not groups:
            raise ValueError(
                "optimizer= holds none of the balancer's shared parameters: pass the torch optimizer that steps "
                "them (eta's step size follows that optimizer's learning rate)"
            )
        rates = {float(group["lr"]) for group in groups}
        if len(rates) > 1:
            raise ValueError(
                f"the shared parameters are in parameter groups with different learning rates {sorted(rates)}, "
                "but eta has one step size: build the balancer with lr=<eta's step size> instead of optimizer="
            )
        return groups[0]

    def follow(self) -> None:
        """eta's step size = the current lr of the optimizer's group of the shared parameters (checked with the
        other hyperparameters by the step; checked here first so that an invalid one is never copied)."""
        lr = self.lr_group()["lr"]
        if not (isinstance(lr, Tensor) and self.algorithm.capturable):  # (a capturable step reads no tensor)
            try:
                check_hyperparameter("lr", lr)
            except (TypeError, ValueError) as error:
                raise ValueError(f"the optimizer passed as optimizer= has an invalid rate for the shared parameters: "
                                 f"{error} (eta's step size follows it; nothing was updated)") from None
        for group in self.algorithm.param_groups:
            group["lr"] = lr
        if self.dual_lr_ratio is not None:  # Double-Loop: eta steps with dual_lr, scaled as theta's lr is
            for group in self.algorithm.param_groups:
                group["dual_lr"] = self.dual_lr_ratio * float(lr)

    def loaded(self) -> None:
        """After ``load_state_dict``: the saved dual_lr went with the saved lr (both followed the optimizer's), so
        their ratio is kept, not the constructor's dual_lr over the rate the optimizer had when this balancer was
        built (a resumed run builds it at the decayed rate, and the next backward would undo the decay)."""
        group = self.algorithm.param_groups[0]
        if self.dual_lr_ratio is not None and self.algorithm.steps_taken > 0 and float(group["lr"]) > 0.0:
            self.dual_lr_ratio = float(group["dual_lr"]) / float(group["lr"])
