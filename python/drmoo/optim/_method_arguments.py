"""What a registered method's constructor accepts, asked before a command writes anything: its keyword names
and whether it takes given values (the commands' and settings files' checks, on the registry of :mod:`drmoo.optim`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from drmoo.optim import available, create

__all__ = ["accepted_hyperparameters", "check_hyperparameter_values"]


def accepted_hyperparameters(method: str) -> frozenset[str] | None:
    """The keyword arguments registered method ``method``'s constructor takes besides ``params`` and
    ``num_tasks`` (None: any, it takes ``**kwargs``): what a command line or a settings file may give it."""
    parameters = inspect.signature(available()[method].__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters) - {"self", "params", "num_tasks"}


def check_hyperparameter_values(method: str, hparams: dict[str, Any], num_tasks: int) -> None:
    """Build ``method``'s optimizer on a stand-in parameter for ``num_tasks`` tasks: every value it would refuse
    (``lr=abc``, a negative lam, an unknown divergence, an unusable backend) is refused now, before a command
    writes anything, as a ValueError of one line prefixed with the method."""
    try:
        create(method, [torch.nn.Parameter(torch.zeros(2))], num_tasks, **hparams)
    except (ValueError, TypeError) as error:
        text = str(error).strip()
        raise ValueError(f"{method}: {text.splitlines()[0] if text else repr(error)}") from None
