"""One whole training step -- forward, per-sample losses, the method's step, the heads' step -- as one CUDA graph.

:class:`GraphedStep` wraps a ``capturable=True`` optimizer of :mod:`drmoo.optim` and its
``step(closure)`` API (the :class:`drmoo.Balancer` API is not supported: see below).  Its first
``warmup_steps`` calls run ordinary eager steps on a side stream (torch's rule: kernels, cuBLAS
workspaces and the optimizers' lazily created state are set up before capture); the next call
captures the step once and replays it, and every later call copies the batch into the graph's
static buffers and replays.  Every call is one real training step on the batch(es) it is given.

What capture needs, and what this class does for it:

* Static memory.  The batches live in static buffers (one slot per fresh draw of the closure in a
  step: Double-Clip with ``resample=True`` draws two, MoDo and SDMGrad three); the heads' ``.grad``
  stay allocated and are zeroed in place inside the graph (``zero_grad(set_to_none=False)``); the
  optimizers' state exists after the warm-up.  The objective returned, ``optimizer.stats`` and
  whatever ``loss_fn`` keeps from its last call are the graph's static outputs: read them after a
  call (a host read there synchronises, as the eager step's logging does anyway).
* No host decisions that change between steps.  A capturable step makes no host read, but a few
  methods decide on the host from a counter: Nash-MTL with ``update_every > 1`` (two branches, one
  graph) and Double-Loop (its inner indices are drawn on the host and would repeat on every replay)
  are refused.  The host counter ``state["drmoo"]["step"]`` is advanced by one per replay here, so
  checkpoints count steps as the eager loop does.
* Same shapes.  A batch whose shape, dtype differs from the captured one (an epoch's smaller last
  batch) is refused with a ``ValueError``: drop it (``DataLoader(drop_last=True)``) or build a
  second :class:`GraphedStep` for it.

Not yet validated on a GPU: the test that compares graphed steps with eager ones from the same start is
part of scripts/gpu_check.sh, which has not run it on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .optim import DoubleLoopMGDA, MultiObjectiveOptimizer, NashMTL
from .optim._features import OneBatchPerStep

__all__ = ["GraphedStep", "check_graphable"]

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Any]  # (inputs, targets) on the device -> what a closure returns


def check_graphable(optimizer: Any) -> None:
    """Refuse (ValueError) an optimizer whose step cannot be captured once and replayed; see the module docstring.

    Args:
        optimizer: the optimizer whose ``step(closure)`` would be captured.
    """
    if not isinstance(optimizer, MultiObjectiveOptimizer):
        raise ValueError(f"GraphedStep captures a drmoo.optim optimizer's step(closure); got "
                         f"{type(optimizer).__name__} (a drmoo.Balancer is not supported: capture the "
                         "step(closure) of its method's optimizer, drmoo.optim.create, instead)")
    if isinstance(optimizer, DoubleLoopMGDA):
        raise ValueError("Double-Loop cannot be captured: its inner-loop indices are drawn on the host, so a graph "
                         "would replay the same indices every step; train it eagerly")
    update_every = optimizer.param_groups[0].get("update_every", 1)
    if isinstance(optimizer, NashMTL) and update_every != 1:
        raise ValueError(f"Nash-MTL with update_every={update_every} takes a host-side branch per step (solve or "
                         "reuse the weights), which one graph cannot replay; use update_every=1 or train eagerly")
    if not optimizer.capturable:
        raise ValueError("CUDA graph capture needs an optimizer built with capturable=True (its eager step reads "
                         "values on the host, which capture forbids)")
    if optimizer.device.type != "cuda":
        raise ValueError(f"CUDA graphs need the parameters on a CUDA device; this optimizer's are on "
                         f"{optimizer.device}")

class GraphedStep:
    """``step(draw)`` / ``step_on(inputs, targets)``: one training step, captured on first use, replayed after.

    Args:
        optimizer: a ``drmoo.optim`` optimizer on CUDA with ``capturable=True`` (see :func:`check_graphable`).
        loss_fn: ``loss_fn(inputs, targets)`` on the device returns what the step's closure returns
            (per-sample losses ``[B, m]``, or ``(losses, features)`` / ``(losses, weights)``).
        heads: the task-specific parameters' torch optimizer (stepped after the method's, in the graph), or None.
        warmup_steps: eager steps (on a side stream) before the capture; at least 1.
    """

    def __init__(self, optimizer: MultiObjectiveOptimizer, loss_fn: LossFn, *,
                 heads: torch.optim.Optimizer | None = None, warmup_steps: int = 3) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1 (capture follows eager steps), got "
                             f"{warmup_steps!r}")
        check_graphable(optimizer)
        self.optimizer, self.loss_fn, self.heads, self.warmup_steps = optimizer, loss_fn, heads, warmup_steps
        self.device = optimizer.device
        self.steps = 0  # calls so far
        self.draws_per_step: int | None = None  # fresh closure draws per step, counted in the warm-up
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self.static: list[Batch] = []  # the graph's input slots
        self.objective: Tensor | None = None  # the graph's output
        self._side: Any = None

    # ------------------------------------------------------------------ the public calls
    def step_on(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One step on one batch; for methods that draw one batch per step (else use :meth:`step`).

        Args:
            inputs: the batch's inputs, of the captured shape and dtype.
            targets: the batch's targets, of the captured shape and dtype.
        """
        given = [(inputs, targets)]

        def draw() -> Batch:
            if not given:
                raise ValueError("this optimizer draws more than one batch per step (Double-Clip with resample, "
                                 "MoDo, SDMGrad): use GraphedStep.step(draw) with a function that returns a fresh "
                                 "(inputs, targets) batch per call")
            return given.pop()

        return self.step(draw)

    def step(self, draw: Callable[[], Batch]) -> Tensor:
        """One step; ``draw()`` returns a fresh ``(inputs, targets)`` batch each time the step needs one.

        Args:
            draw: called once per batch the method's step draws (one, or two for Double-Clip with resample,
                three for MoDo and SDMGrad); each batch must have the captured shape and dtype.
        """
        if self.steps < self.warmup_steps:
            objective = self._eager_step(draw)
        else:
            if self.graph is None:
                self._capture(draw)
            else:
                self._fill(draw)
            self.graph.replay()
            self.optimizer.state["drmoo"]["step"] += 1  # the host counter a replay does not advance
            assert self.objective is not None
            objective = self.objective
        self.steps += 1
        return objective

    # ------------------------------------------------------------------ internals
    def _closure(self, source: Callable[[], Batch], counter: list[int]) -> OneBatchPerStep[Any]:
        """The step's closure over ``source``'s batches (``counter`` counts the fresh ones); made per step."""
        last: list[Batch] = []

        def draw(same_batch: bool) -> Any:
            if not same_batch or not last:
                last[:] = [source()]
                counter[0] += 1
            return self.loss_fn(*last[0])

        # features mode: one batch per step, by the rule drmoo train's eager closure applies too
        return OneBatchPerStep(draw, lambda: getattr(self.optimizer, "features_engine", None) is not None)

    def _on_device(self, draw: Callable[[], Batch]) -> Callable[[], Batch]:
        def source() -> Batch:
            x, y = draw()
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

        return source

    def _step_body(self, closure: Callable[..., Any]) -> Tensor:
        if self.heads is not None:
            self.heads.zero_grad(set_to_none=False)  # in place: graph memory stays static
        objective = self.optimizer.step(closure)
        if self.heads is not None:
            self.heads.step()
        return objective

    def _eager_step(self, draw: Callable[[], Batch]) -> Tensor:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        counter = [0]
        closure = self._closure(self._on_device(draw), counter)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            if self.heads is not None:  # allocate every head gradient now, as the graph needs them to exist
                for group in self.heads.param_groups:
                    for param in group["params"]:
                        if param.grad is None:
                            param.grad = torch.zeros_like(param)
            objective = self._step_body(closure)
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        if self.draws_per_step is not None and counter[0] != self.draws_per_step:
            raise RuntimeError(f"the step drew {counter[0]} batches after {self.draws_per_step} in an earlier step: "
                               "a step whose draws vary cannot be captured")
        self.draws_per_step = counter[0]
        return objective

    def _fill(self, draw: Callable[[], Batch]) -> None:
        for slot, (static_x, static_y) in enumerate(self.static):
            x, y = draw()
            for name, got, want in (("inputs", x, static_x), ("targets", y, static_y)):
                if got.shape != want.shape or got.dtype != want.dtype:
                    raise ValueError(
                        f"draw {slot + 1} of the step: {name} of shape {tuple(got.shape)} ({got.dtype}) differ from "
                        f"the captured {tuple(want.shape)} ({want.dtype}); a graph replays fixed shapes: drop "
                        "the smaller last batch of an epoch (DataLoader(drop_last=True)) or step it eagerly")
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)

    def _capture(self, draw: Callable[[], Batch]) -> None:
        assert self.draws_per_step is not None  # counted in the warm-up
        source = self._on_device(draw)
        batches = [source() for _ in range(self.draws_per_step)]
        self.static = [(x.clone(), y.clone()) for x, y in batches]
        slots = iter(self.static)
        counter = [0]
        closure = self._closure(lambda: next(slots), counter)
        state = self.optimizer.state["drmoo"]
        steps_before = state["step"]
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        linalg = torch.backends.cuda.preferred_linalg_library()
        torch.backends.cuda.preferred_linalg_library("cusolver")  # MAGMA's small solves synchronise
        try:
            with torch.cuda.graph(graph):  # records the kernels; nothing runs until replay
                self.objective = self._step_body(closure)
        finally:
            torch.backends.cuda.preferred_linalg_library(linalg)
            state["step"] = steps_before  # the capture's Python pass counted a step that has not run
        self.graph = graph

