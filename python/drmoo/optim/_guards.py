"""The NaN/Inf guards of a step, and the writes they gate.

Eagerly (``capturable=False``) a guard whose flags are not all True raises
:class:`NonFiniteStepError` before anything is written.  Capturable, a step holds a device-side
``found_inf`` (a 0-d bool, as in ``torch.amp.GradScaler``): the guards OR into it instead of
raising, and every write of the step is masked by it (:meth:`StepGuard.commit_`), so that a
non-finite step is skipped on the device and writes nothing, with no host read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class NonFiniteStepError(ValueError):
    """A step met a NaN/Inf (losses, dual quantities or gradients) and was abandoned: nothing changed.

    A ``ValueError``, so callers that treat it as bad input keep working; mixed-precision training
    catches it to skip an overflowing step, as a gradient scaler would.
    """


class StepGuard:
    """The guards of one running step: eager (raise at once) or capturable (``found_inf``)."""

    def __init__(self, capturable: bool, device: torch.device) -> None:
        # Capturable: "this step met a NaN/Inf" so far, on the device; None for an eager step.
        self.found_inf: Tensor | None = torch.zeros((), dtype=torch.bool, device=device) if capturable else None

    def require(self, flags: Tensor, describe: Callable[[list[int]], str]) -> None:
        """Stop the step unless every flag is True (see :func:`require_finite`)."""
        require_finite(self.found_inf, flags, describe)

    def invalid(self, valid: Tensor, message: str) -> None:
        """Stop the step unless the 0-d bool ``valid`` holds: eagerly a ValueError with ``message`` (bad input,
        not an overflow); capturable, the step is skipped."""
        if self.found_inf is not None:
            self.found_inf.logical_or_(~valid)
        elif not bool(valid):
            raise ValueError(message)

    def commit_(self, target: Tensor, value: Tensor) -> None:
        """``target <- value`` in place -- unless this capturable step is being skipped."""
        with torch.no_grad():
            if self.found_inf is None:
                target.copy_(value)
            else:
                target.copy_(torch.where(self.found_inf, target, value.to(target.dtype)))

    def count(self, state: dict[str, Any], stats: dict[str, Tensor], device: torch.device) -> None:
        """The step returned: count it in ``state["skipped_steps"]`` if it was skipped, and report both in
        ``stats`` (``found_inf``: 1.0 if skipped; ``skipped_steps``: the running count) when it has any."""
        if "skipped_steps" not in state:  # a state loaded from before the counter existed
            state["skipped_steps"] = torch.zeros((), dtype=torch.int64, device=device)
        found_inf = self.found_inf
        if found_inf is not None:
            state["skipped_steps"].add_(found_inf.to(torch.int64))
        if stats:
            stats["found_inf"] = (found_inf.float() if found_inf is not None
                                  else torch.zeros((), dtype=torch.float32, device=device))
            stats["skipped_steps"] = state["skipped_steps"].clone()


def require_finite(found_inf: Tensor | None, flags: Tensor, describe: Callable[[list[int]], str]) -> None:
    """Stop the step unless every flag is True (bool tensor: "this part is finite").

    Eager (``found_inf`` None): one host read; a False flag raises :class:`NonFiniteStepError` with
    ``describe(indices of the False flags)`` before anything is written.  Capturable: no host read; the
    flags are OR-ed, negated, into ``found_inf`` and every later write is masked by it.
    """
    if found_inf is not None:
        found_inf.logical_or_(~flags.all())
        return
    if not bool(flags.all()):
        bad = [i for i, ok in enumerate(flags.reshape(-1).tolist()) if not ok]
        raise NonFiniteStepError(describe(bad))
