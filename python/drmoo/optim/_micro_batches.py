"""A closure that returns its batch in micro-batches: ``step(closure)`` takes the full-batch step.

``optimizer.step(closure)`` with a closure that returns an iterable of micro-batches (a generator, say)
instead of one batch's losses::

    def closure():
        for x, y in zip(inputs.split(16), targets.split(16)):
            yield per_sample_losses(model(x), y)          # [B_k, m], with its graph

takes the method's step on the batch they make together: the same theta, eta, w and state, and the
same heads' ``.grad``, as a closure returning the concatenated losses, to the rounding of another
summation order, for micro-batches of any sizes.  Each call of the closure is one batch, so a method
that draws several (MoDo's and SDMGrad's three, MoCo's one, FAMO's re-evaluation of its batch) keeps
its algorithm: every draw is one accumulated batch.

How.  It is :mod:`drmoo.optim._accumulate`'s machinery, which ``Balancer.backward(losses,
accumulate=True)`` runs, driven by the step: every micro-batch but the last is reduced as it comes
(:func:`~drmoo.optim._accumulate.reduce_micro_batch`: its dual means, its m per-task gradients, its
heads' gradients, all at the step's starting point, its graph freed), and the last is handed to the
method's step as its batch, with the accumulation, which the step closes as the Balancer's last
micro-batch does.  Which one is the last is known only once the iterable is asked for the next: a
micro-batch given as its losses has its graph alive while the next one's forward pass runs (two
micro-batches' graphs at the peak); one given as a zero-argument callable that computes them is called
only then (one graph at a time).  A draw without a graph (FAMO's re-evaluation) needs no accumulation:
its micro-batches' losses are joined.

Refused, with one line naming the reason and the alternative: the methods that cannot accumulate
exactly (Double-Clip, Double-Loop: their gradients are taken at an eta the whole batch decides),
FSDP-sharded shared parameters (as the Balancer refuses them), an iterable that yields nothing.  Each
micro-batch's checks join the step's own (one host read per step, none with ``capturable=True``: a
non-finite micro-batch then leaves the step undone on the device, as a non-finite whole batch does).
In features mode a step's per-task gradients must come from one batch: a later draw of MoDo's or
SDMGrad's step may return the very iterable the step's first draw returned (that batch again, as a
closure returning the same batch does), and any other is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from drmoo_kernels._checks import untrusted_arguments

from ._accumulate import Accumulation, AccumulationHost, accumulate_refusal, reduce_micro_batch, shared_versions
from ._losses import check_losses

__all__ = ["DrawnMicroBatches", "draw_micro_batches", "forget_micro_batches", "is_micro_batches"]

_END = object()  # what an exhausted iterable gives (next(iterator, _END))


@dataclass
class DrawnMicroBatches:
    """The step's latest draw that came in micro-batches."""

    source: object  # the iterable the closure returned (the same object again is the same batch: features mode)
    last: Any  # what the last micro-batch returned: its losses, with their graph (the step's batch)
    accumulation: Accumulation | None  # the earlier micro-batches, reduced (None: there was only one)


class MicroBatchesHost(AccumulationHost, Protocol):
    """What a micro-batched draw reads from, and sets on, the optimizer whose step draws it."""

    drawn_micro_batches: DrawnMicroBatches | None
    num_tasks: int
    losses_origin: str  # how messages name where the losses came from

    @property
    def capturable(self) -> bool: ...


def is_micro_batches(result: object) -> bool:
    """Whether a closure returned its batch in parts: an iterable that is not one batch's losses (a tensor, a
    tuple) -- a generator, or a list of micro-batches (tensors, tuples or callables; a list of anything else is
    a malformed batch, for the step's own checks to name).  A tensor iterates over its rows and a tuple is a
    batch's parts."""
    if isinstance(result, list):
        return all(isinstance(item, (Tensor, tuple)) or callable(item) for item in result)
    return isinstance(result, Iterable) and not isinstance(result, (Tensor, tuple, str, bytes, Mapping))


def forget_micro_batches(host: MicroBatchesHost) -> None:
    """The step's latest micro-batched draw is done with (a new draw begins, or the step ends): its
    accumulation leaves the step, which reads it only while it uses that draw.  An accumulation the step did
    not draw (the Balancer's, set before its step) is left alone."""
    drawn = host.drawn_micro_batches
    if drawn is None:
        return
    if host.accumulation is drawn.accumulation:
        host.accumulation = None
    host.drawn_micro_batches = None


def draw_micro_batches(host: MicroBatchesHost, source: Iterable[Any], *, need_graph: bool) -> Any:
    """The batch the micro-batches of ``source`` make, as one closure call would return it after the engine
    unpacked it (``losses`` or ``(losses, sample_weight)``; features mode: z recorded).

    With a graph: every micro-batch but the last reduced into an :class:`Accumulation`, which becomes the
    host's ``accumulation``, closed for the last one's rows; the last one's losses are returned, for the
    step's own passes.  Without (FAMO's re-evaluation): the micro-batches' losses, joined."""
    refusal = micro_batches_refusal(host)
    if refusal is not None:
        raise ValueError(refusal)
    engine = host.jacobian_engine
    drawn = host.drawn_micro_batches
    if drawn is not None and drawn.source is source:
        if not need_graph or host.features_engine is None:
            raise ValueError(
                "the closure returned the micro-batches of an earlier draw of this step again: each call must "
                "draw a fresh batch (a new iterable), whose graphs the step's backward passes can still cross"
            )
        # Features mode's one batch per step (MoDo's, SDMGrad's later draws): that batch again, the same rows.
        host.accumulation = drawn.accumulation
        return engine.unpack(drawn.last, need_graph=True)
    forget_micro_batches(host)
    if not need_graph:
        return _joined(host, source)
    features = host.features_engine
    if features is not None and features.features is not None:
        raise ValueError(
            f"{type(host).__name__} takes per-task gradients on several independent batches in one step, and with "
            "jacobian='features' their columns are different samples: return the very iterable of micro-batches "
            "the step's first draw returned at every call (the same batch), or use jacobian='parameters'"
        )
    accumulation, last = _reduce_all_but_last(host, source)
    if accumulation is not None:
        accumulation.close_with(_rows(last))
    host.drawn_micro_batches = DrawnMicroBatches(source, last, accumulation)
    host.accumulation = accumulation
    return engine.unpack(last, need_graph=True)


def micro_batches_refusal(host: MicroBatchesHost) -> str | None:
    """Why this optimizer's step cannot take a closure's micro-batches exactly (one line), or None."""
    # capturable=True is not refused: each micro-batch's checks join the step's own guard (no host read of
    # their own), so a capturable step over micro-batches reads nothing, as over one batch.
    return accumulate_refusal(host, whole_batch="return the whole batch's losses from the closure")


def _reduce_all_but_last(host: MicroBatchesHost, source: Iterable[Any]) -> tuple[Accumulation | None, Any]:
    """Every micro-batch of ``source`` but the last reduced (its graph freed before the next is evaluated, for a
    callable one); returns the accumulation (None for a single micro-batch) and the last one, evaluated."""
    iterator = _iterate(source)
    try:
        current = _pull(iterator)
        if current is _END:
            raise ValueError(_EMPTY)
        accumulation: Accumulation | None = None
        count = 1
        while True:
            # The next one first: only then is it known whether this one is the last (the step's batch).
            following = _pull(iterator)
            batch = _evaluated(current)
            if following is _END:
                return accumulation, batch
            if accumulation is None:
                accumulation = Accumulation(shared_versions(host._shared_params()))
            origin, host.losses_origin = host.losses_origin, f"the closure's micro-batch {count} gave"
            try:
                reduce_micro_batch(host, batch, accumulation)
            finally:
                host.losses_origin = origin
            del batch  # its graph, crossed by the reduction's last backward pass, goes with it
            current, count = following, count + 1
    except BaseException:
        _close(iterator)  # a generator's own clean-up (its finally blocks) runs now, not at garbage collection
        raise


def _joined(host: MicroBatchesHost, source: Iterable[Any]) -> Any:
    """A draw without a graph: the micro-batches' losses (and sample weights, 1 where a micro-batch has none)
    concatenated, as one closure call would return them after unpacking."""
    parts: list[tuple[Tensor, Tensor | None]] = []
    iterator = _iterate(source)
    try:
        while (item := _pull(iterator)) is not _END:
            unpacked = host.jacobian_engine.unpack(_evaluated(item), need_graph=False)
            parts.append(check_losses(unpacked, num_tasks=host.num_tasks, device=host.device,
                                      origin=f"the closure's micro-batch {len(parts) + 1} gave", need_graph=False))
    except BaseException:
        _close(iterator)
        raise
    if not parts:
        raise ValueError(_EMPTY)
    losses = torch.cat([part[0] for part in parts])
    if all(weight is None for _, weight in parts):
        return losses
    return losses, torch.cat([torch.ones_like(part) if weight is None else weight for part, weight in parts])


_EMPTY = ("the closure returned no micro-batches (an empty iterable): return the batch's per-sample losses "
          "[B, m], or an iterable that yields at least one micro-batch")


def _iterate(source: Iterable[Any]) -> Iterator[Any]:
    with untrusted_arguments():  # the user's code: the ops it calls check their arguments
        return iter(source)


def _pull(iterator: Iterator[Any]) -> Any:
    """The next micro-batch, or _END (a generator runs the user's code up to its next yield)."""
    with untrusted_arguments():
        return next(iterator, _END)


def _evaluated(item: Any) -> Any:
    """A micro-batch's losses: the item itself, or what a callable one returns when called now."""
    if callable(item):
        with untrusted_arguments():
            return item()
    return item


def _rows(given: Any) -> int:
    """The rows of a micro-batch's losses (0 for what is no batch: the step's own checks then refuse it)."""
    losses = given[0] if isinstance(given, tuple) and given else given
    return int(losses.shape[0]) if isinstance(losses, Tensor) and losses.dim() > 0 else 0


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if callable(close):
        close()
