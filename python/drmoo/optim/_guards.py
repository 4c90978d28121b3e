"""The NaN/Inf guards of a step, and the writes they gate: one host read per eager step, at most.

Each guard computes its flags on the device ("this part is finite", "these weights are valid").
Eagerly (``capturable=False``) a step whose guards failed raises -- :class:`NonFiniteStepError` naming
the first failing quantity, or the guard's own error -- before anything is written; but the guards
are not read one by one: they are OR-ed into one device-side flag, read ONCE, at the step's first
write that cannot be undone (:meth:`StepGuard.settle`: the theta write, a state write) or at its end.
Only a failing step reads the guards' own flags, to name the first that failed (the one the step met
first, as if each had been read at once).  Most guards are "these tensors are finite" (:class:`FiniteValues`):
an eager step does not test them one by one either, but all at once at the read, in one fused pass over
their values (a handful of ops however many guards, where each test was four or five); their per-part
flags are computed only when that pass failed.  A write the caller undoes itself on failure (FAMO steps
theta before re-evaluating the batch) may run under :meth:`StepGuard.deferred_writes` without a read.

Capturable, a step holds a device-side ``found_inf`` (a 0-d bool, as in ``torch.amp.GradScaler``): the
guards OR into it instead of raising, and every write of the step is masked by it
(:meth:`StepGuard.commit_`), so that a non-finite step is skipped on the device and writes nothing,
with no host read at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

# A guard's error, from the indices of its False flags.
ErrorOf = Callable[[list[int]], BaseException]


class NonFiniteStepError(ValueError):
    """A step met a NaN/Inf (losses, dual quantities or gradients) and was abandoned: nothing changed.

    A ``ValueError``, so callers that treat it as bad input keep working; mixed-precision training
    catches it to skip an overflowing step, as a gradient scaler would.
    """


@dataclass(frozen=True)
class FiniteValues:
    """A guard's flags by their source: ``values`` must hold finite entries only, and ``flags()`` gives the
    guard's per-part flags (True: finite), for the one that failed, or for a step that tests at once.

    ``flags()`` must be False somewhere exactly when a value is not finite.
    """

    values: tuple[Tensor, ...]
    flags: Callable[[], Tensor]


def finite_each(*tensors: Tensor) -> FiniteValues:
    """One flag per tensor: "every entry of tensor k is finite"."""
    values = tuple(tensor.detach() for tensor in tensors)
    return FiniteValues(values, lambda: torch.stack([torch.isfinite(value).all() for value in values]))


def finite_entries(tensor: Tensor) -> FiniteValues:
    """One flag per entry of ``tensor`` (e.g. a Gram matrix's diagonal: one per task)."""
    value = tensor.detach()
    return FiniteValues((value,), lambda: torch.isfinite(value))


def finite_columns(matrix: Tensor) -> FiniteValues:
    """One flag per column of ``matrix`` (per-sample losses [B, m]: one per task)."""
    value = matrix.detach()
    return FiniteValues((value,), lambda: torch.isfinite(value).all(dim=0))


def finite_scalars(scalars: Sequence[Tensor]) -> FiniteValues:
    """One flag per 0-d tensor of ``scalars`` (e.g. one norm per gradient)."""
    values = tuple(scalar.detach() for scalar in scalars)
    return FiniteValues(values, lambda: torch.isfinite(torch.stack(values)))


def finite_together(tensors: Sequence[Tensor]) -> FiniteValues:
    """One flag for all of ``tensors`` (e.g. the norms of a list of gradients)."""
    values = tuple(tensor.detach() for tensor in tensors)
    return FiniteValues(values, lambda: finite_each(*values).flags().all().reshape(1))


def all_pass(flags: Sequence[Tensor | FiniteValues]) -> Tensor:
    """0-d bool: every flag True and every value finite, in one pass over all of them (a concatenation and a
    reduction each for the flags and the values: x - x is 0 for a finite x, NaN for NaN and +-Inf)."""
    values = [value.reshape(-1) for flag in flags if isinstance(flag, FiniteValues) for value in flag.values]
    bools = [flag.reshape(-1) for flag in flags if not isinstance(flag, FiniteValues)]
    verdicts = []
    if values:
        joined = values[0] if len(values) == 1 else torch.cat(values)
        verdicts.append(((joined - joined) == 0).all())
    if bools:
        verdicts.append((bools[0] if len(bools) == 1 else torch.cat(bools)).all())
    if not verdicts:
        return torch.ones((), dtype=torch.bool)
    return verdicts[0] if len(verdicts) == 1 else verdicts[0] & verdicts[1]


def flags_of(flags: Tensor | FiniteValues) -> Tensor:
    """A guard's flags: ``flags`` itself, or a :class:`FiniteValues`' computed."""
    return flags.flags() if isinstance(flags, FiniteValues) else flags


def _identity(tensor: Tensor) -> tuple[Any, ...]:
    """A tensor's values' identity: its memory, its in-place version (shared by its detached views) and its layout."""
    return tensor.data_ptr(), tensor._version, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device


class StepGuard:
    """The guards of one running step (see the module docstring).

    Args:
        capturable: the step reads nothing on the host: its guards OR into ``found_inf``.
        device: the step's device (``found_inf``'s).
        steps_before: the steps completed before this one (how a failing step's messages name it).
        immediate: an eager guard that reads each check at once (outside a step: nothing would settle it).
    """

    def __init__(self, capturable: bool, device: torch.device, steps_before: int = 0, immediate: bool = False) -> None:
        # Capturable: "this step met a NaN/Inf" so far, on the device; None for an eager step.
        self.found_inf: Tensor | None = torch.zeros((), dtype=torch.bool, device=device) if capturable else None
        self.steps_before = steps_before
        self._immediate = immediate
        self._pending: list[tuple[Tensor | FiniteValues, ErrorOf]] = []  # eager: the guards not read yet, in order
        self._undone_by_caller = 0  # > 0: inside deferred_writes
        self._vouched: set[tuple[Any, ...]] = set()  # eager: tensors checked finite on the host (vouch_finite)

    def require(self, flags: Tensor | FiniteValues, describe: Callable[[list[int]], str]) -> None:
        """Stop the step unless every flag is True: :class:`NonFiniteStepError` with ``describe(indices of
        the False flags)`` (eager, at the next :meth:`settle`), or ``found_inf`` (capturable)."""
        self.check(flags, lambda bad: NonFiniteStepError(describe(bad)))

    def invalid(self, valid: Tensor, message: str) -> None:
        """Stop the step unless the 0-d bool ``valid`` holds: eagerly a ValueError with ``message`` (bad input,
        not an overflow); capturable, the step is skipped."""
        self.check(valid.reshape(1), lambda _: ValueError(message))

    def check(self, flags: Tensor | FiniteValues, error: ErrorOf) -> None:
        """The general guard: unless every flag is True (every value finite), eagerly raise ``error(indices of
        the False flags)`` at the next :meth:`settle` (at once for an ``immediate`` guard); capturable, skip
        the step.  Eager guards are only recorded here: :meth:`settle` tests them all in one pass."""
        if self.found_inf is not None:
            self.found_inf.logical_or_(~flags_of(flags).all())
            return
        if isinstance(flags, FiniteValues) and all(_identity(value) in self._vouched for value in flags.values):
            return  # checked finite on the host already: no read
        self._pending.append((flags, error))
        if self._immediate:
            self.settle()

    @property
    def failure_so_far(self) -> Tensor | None:
        """A 0-d bool on the device, True when the step is abandoned for what its guards found so far:
        capturable, ``found_inf``; eager, a guard not read yet failed (None when none is pending)."""
        if self.found_inf is not None:
            return self.found_inf
        return ~all_pass([flags for flags, _ in self._pending]) if self._pending else None

    def settle(self) -> None:
        """Eager: test the pending guards in one pass and read the verdict -- ONE host read for all of them --
        and raise the first failing one's error.  Nothing to do when none is pending (or in a capturable step)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if bool(all_pass([flags for flags, _ in pending])):
            return
        self._raise_first_failing(pending)

    def vouch_finite(self, tensor: Tensor) -> None:
        """Eager: ``tensor`` was made on the host from values checked there (finite): a later "finite" guard of
        it alone is met without a read (as long as it is not written in place)."""
        self._vouched.add(_identity(tensor))

    def settle_reading(self, payload: Tensor) -> list[float]:
        """Eager: :meth:`settle` and read ``payload``'s values (as float64) in the same host read -- one transfer
        for both -- for a step that needs values on the host anyway.  Inside :meth:`deferred_writes` the guards
        stay pending and only ``payload`` is read."""
        pending: list[tuple[Tensor | FiniteValues, ErrorOf]] = []
        if not self._undone_by_caller:
            pending, self._pending = self._pending, []
        values = payload.detach().reshape(-1).to(torch.float64)
        if not pending:
            return values.tolist()
        verdict = all_pass([flags for flags, _ in pending]).to(device=values.device, dtype=torch.float64)
        read = torch.cat([verdict.reshape(1), values]).tolist()
        if not read[0]:
            self._raise_first_failing(pending)
        return read[1:]

    @staticmethod
    def _raise_first_failing(pending: list[tuple[Tensor | FiniteValues, ErrorOf]]) -> NoReturn:
        """A failing step only: read which guard failed, to name it, and raise its error."""
        for flags, error in pending:
            values = flags_of(flags).reshape(-1).tolist()
            if not all(values):
                raise error([index for index, ok in enumerate(values) if not ok])
        raise pending[0][1]([])  # unreachable while each FiniteValues' flags agree with its values

    def settle_before_write(self) -> None:
        """Before a write that cannot be undone: :meth:`settle`, unless the caller undoes the writes itself."""
        if not self._undone_by_caller:
            self.settle()

    @contextmanager
    def deferred_writes(self) -> Iterator[None]:
        """Writes in this block are undone by the caller if the step fails: they do not settle the guards."""
        self._undone_by_caller += 1
        try:
            yield
        finally:
            self._undone_by_caller -= 1

    def commit_(self, target: Tensor, value: Tensor) -> None:
        """``target <- value`` in place -- eagerly once the guards pass, capturable unless the step is skipped."""
        with torch.no_grad():
            if self.found_inf is None:
                self.settle_before_write()
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
