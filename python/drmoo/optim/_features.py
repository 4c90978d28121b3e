"""``jacobian="features"``: per-task gradients with respect to the shared representation z.

The paper takes every task's gradient with respect to the shared parameters theta: m backward passes
through the trunk and a Jacobian J_theta of m x n.  In features mode (Sener & Koltun's MGDA-UB,
LibMTL's ``rep_grad``) the per-task gradients are taken with respect to z, the trunk's output that
every head reads (a tensor or a tuple of tensors, batch included):

    J_z[i] = d L^i / d z          (m cheap backward passes through the heads only; m x (B*d))

and every method's m x m algebra -- the Gram through the same ``gram`` op, the clips, the solvers --
runs on J_z instead of J_theta.  A method combines its rows into one direction c^T J_z (c its
coefficients: MGDA's w, Double-Clip's alpha*w, Nash-MTL's clip*alpha, ...); theta then moves along

    d_theta = (dz/dtheta)^T (c^T J_z) = grad_theta sum_i c_i L^i          (ONE backward through the trunk)

by the chain rule.  The per-sample f*' weights and eta are exact (they come from the loss values);
what is approximated is the *geometry*: J_theta = J_z (dz/dtheta), so each Gram entry, norm and
inner product the method uses is taken in z's coordinates, and ||J_theta^T c|| <= ||dz/dtheta|| *
||J_z^T c|| (operator norm) bounds the true direction's norm by the one the method sees.

Design: one engine for every method.  The methods keep their math, written over "a Jacobian": rows
(``task_jacobian``), their Gram (``task_gram``), and ``apply_direction(rows, c, factor)``.  This
module supplies the features version of each: the rows w.r.t. z, the Gram summed over ranks (each
rank holds the columns of its own samples), and the lift of c^T J_z to theta by one backward pass,
after which the parameters-mode code path writes theta (or ``.grad``) exactly as it does for
J_theta^T c.

Batches.  A features Jacobian's columns are one batch's samples, so rows of *different* batches
live in different coordinates and their products estimate nothing: in features mode every per-task
gradient of a step must come from one batch (one z).  The single-batch forms (``Balancer.backward(
losses, features=z)``) of MoDo, SDMGrad and Double-Loop qualify; their multi-batch forms (fresh
batches per closure call) are refused at the second draw.  MoCo's tracked Jacobian averages rows
over steps, i.e. over batches: refused at construction.

The heads are the trainable leaves between the losses and z (found by walking the graph down to z,
which also refuses a graph that reaches the shared parameters other than through z); they keep their
own DR gradient, as in parameters mode.  A trainable leaf *below* z that is not among the shared
parameters receives nothing here (parameters mode would give it the gradient of sum_i L^i): give the
whole trunk as the shared parameters.

Under torch.distributed only m x m quantities (the Gram, the cross products, squared norms), the
dual statistics and the one n-sized direction (as DDP's own gradient all-reduce) cross ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Generic, TypeVar, cast

import torch
from torch import Tensor

from drmoo import distributed
from drmoo._head_split import TaskSplit, split_task_jacobian, task_split
from drmoo._linear_head import LinearHead, linear_head
from drmoo.jacobian import (
    accumulate_into_grad,
    copy_into_row,
    gradients_arriving_at,
    heads_above_features,
    require_reached,
    resolve_strategy,
    task_jacobian,
    without_vmap_over_compiled,
)
from drmoo_kernels.backends import cpp as cpp_backend

from ._direction import write_direction
from ._engine import EarlierMicroBatches, EngineHost, tests_trunk_gradients
from ._fsdp import is_sharded, lift_into_shards, split_sharded_heads
from ._guards import finite_together
from ._loss_scale import divide_, is_unit, times, with_scale
from ._overlap import views_overlap

FeaturesInput = Tensor | tuple[Tensor, ...] | list[Tensor]  # z: one tensor, or the pieces the heads read


def as_pieces(features: Any) -> tuple[Tensor, ...]:
    """z as a tuple of tensors (a tensor, or a tuple/list of them, each given once); TypeError otherwise.

    A piece given twice, or overlapping another's memory (a view of it), is refused (ValueError): each
    piece gets its own cotangent in the lift, and autograd sums them, so ``features=(z, z)`` would
    count z's gradient twice (a doubled step; x1.69 for Nash-MTL, x3 for three copies).
    """
    pieces = (features,) if isinstance(features, Tensor) else features
    if not isinstance(pieces, (tuple, list)) or not pieces or not all(isinstance(p, Tensor) for p in pieces):
        raise TypeError(
            "features z must be a Tensor (the trunk's output that every head reads) or a non-empty tuple of "
            f"Tensors; got {type(features).__name__}"
        )
    for index, piece in enumerate(pieces):
        for earlier in range(index):
            if views_overlap(piece, pieces[earlier]):  # from the layouts: no host read
                raise ValueError(
                    f"features[{index}] (shape {tuple(piece.shape)}) is features[{earlier}] again, or shares its "
                    "memory: each piece of z must be given once (its gradient would be counted once per copy); "
                    "pass z itself, or the distinct tensors the heads read"
                )
    return tuple(pieces)


def with_features(losses: Any, features: FeaturesInput | None, features_mode: bool) -> Any:
    """What a closure returns for ``Balancer.backward(losses, features=z)``: ``losses`` (or
    ``(losses, sample_weight)``) unchanged in parameters mode, ``(losses, z[, sample_weight])`` in
    features mode.  ``losses`` None: the closure form (z comes from the closure, not the keyword)."""
    if not features_mode:
        if features is not None:
            raise ValueError("features=z is for jacobian='features'; this balancer takes the Jacobian w.r.t. the "
                             "shared parameters (jacobian='parameters')")
        return losses
    if losses is None:
        if features is not None:
            raise ValueError("with a closure, jacobian='features' takes z from the closure, which returns "
                             "(losses, z) or (losses, z, sample_weight): do not pass features=")
        return None
    if features is None:
        raise ValueError("jacobian='features' needs the representation z: backward(losses, features=z), z being the "
                         "trunk's output that every head reads")
    pieces = as_pieces(features)
    z = pieces[0] if isinstance(features, Tensor) else pieces
    return (losses[0], z, losses[1]) if isinstance(losses, tuple) else (losses, z)


Drawn = TypeVar("Drawn")  # what a closure returns: losses, or (losses, z[, sample_weight])


class OneBatchPerStep(Generic[Drawn]):
    """A training closure with features mode's batch rule: a step's later draws with a graph return its first.

    A features Jacobian's columns are one batch's samples (see "Batches" above), so the multi-batch
    methods (MoDo's and SDMGrad's three batches, Double-Loop's Y, Y_bar and Y_tilde) run their
    single-batch form under a closure that draws fresh batches: every call that builds a graph
    (``torch.is_grad_enabled()``, ``same_batch=False``) after the step's first returns that first
    draw.  Calls without a graph (Double-Clip's and Double-Loop's dual-variable steps) and
    ``same_batch=True`` calls (FAMO's re-evaluation) pass through to ``draw`` unchanged, and in
    parameters mode (``features_mode()`` false) every call does.  ``drmoo train``'s closure and
    :class:`~drmoo.cuda_graph.GraphedStep`'s both apply the rule through this class, so it is
    written once.

    Args:
        draw: ``draw(same_batch)``: the closure's value for a fresh batch (False) or the last one (True).
        features_mode: whether the optimizer takes the Jacobian w.r.t. z; asked at each draw.
    """

    def __init__(self, draw: Callable[[bool], Drawn], features_mode: Callable[[], bool]) -> None:
        self.draw, self.features_mode = draw, features_mode
        self.first_with_graph: Drawn | None = None  # this step's first draw with a graph (features mode)

    def __call__(self, same_batch: bool = False) -> Drawn:
        with_graph = not same_batch and torch.is_grad_enabled()
        if with_graph and self.first_with_graph is not None:
            return self.first_with_graph
        drawn = self.draw(same_batch)
        if with_graph and self.features_mode():
            self.first_with_graph = drawn
        return drawn

    def end_step(self) -> None:
        """Close the step: the next draw with a graph is fresh, and the kept one (and its graph) is freed."""
        self.first_with_graph = None


def trunk_guard_values(grads: Sequence[Tensor], ops: ModuleType) -> list[Tensor]:
    """The lift's NaN/Inf guard on the trunk's gradients: values, from ONE op, that are all finite exactly when the
    gradients are (a NaN or Inf entry makes its gradient's value NaN or Inf; the op reads each gradient once,
    what any test of every entry costs).

    With the ``cpp`` backend (CPU tensors): each gradient's sum of squares, one compiled ``sum_squares`` call
    (a ``[k]`` tensor).  The CPU runs ``torch._foreach_norm`` as a loop of per-tensor norm reductions, where the
    op is one memory-bound pass that prefetches across the pages the hardware prefetchers stop at: inside a
    ResNet18 step (62 gradients, 11.7M floats, one thread) 4.6-5.2 ms against 5.6-6.3 ms, and 3-6x faster for
    float16/bfloat16 gradients.  A loop of ``torch.dot`` calls was about as fast (4.7-5.4 ms) but is one op
    per gradient: 62 launches' worth in the op counts that stand for GPU launches.  Elsewhere the L2 norms of
    ``torch._foreach_norm``: on a GPU that is already one fused launch.

    Either way half-precision gradients are accumulated in float32 (the op always does): in float16 the norm
    overflows at 65504 -- a million finite entries of 100 -- and a finite gradient would stop the step as
    non-finite.  A sum of squares overflows float32 where the norm exceeds ~1.8e19, as an unscaled norm
    computed in float32 would: a gradient that large is refused as non-finite."""
    grads = list(grads)
    if ops is cpp_backend:
        return [ops.sum_squares(grads)]
    if grads[0].dtype in (torch.float16, torch.bfloat16):
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    return list(torch._foreach_norm(grads))


class FeaturesJacobian:
    """The features-mode engine of one optimizer (see the module docstring; implements
    :class:`~drmoo.optim._engine.JacobianEngine`).

    Holds, during one step only, the z of the step's batch and what was learnt from walking the
    losses' graph down to it (the heads); :meth:`end_step` forgets both (the graph is not kept
    alive between steps, and a pickled / deep-copied optimizer carries none of it).
    """

    def __init__(self, method: str) -> None:
        self.method = method
        self._buffers: dict[str, Tensor] = {}
        self.end_step()

    def __getstate__(self) -> dict[str, Any]:
        return {"method": self.method}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.method = state["method"]
        self._buffers = {}
        self.end_step()

    def end_step(self) -> None:
        """Forget the step's z and graph walk (called when a step returns or raises)."""
        self.features: tuple[Tensor, ...] | None = None
        self._checked: tuple[Tensor, list[Tensor]] | None = None  # (losses, heads above z)
        self._sharded_heads = False  # whether any of them is FSDP2-sharded (drmoo.optim._fsdp)
        self._split: tuple[Tensor, TaskSplit | None] | None = None  # (losses, their per-task heads, if any)
        self._factored: tuple[Tensor, int, LinearHead] | None = None  # (rows, their version, the linear heads)
        self._earlier: EarlierMicroBatches | None = None  # closing an accumulation: the earlier micro-batches

    # ------------------------------------------------------------------------------ the closure
    def unpack(self, result: Any, *, need_graph: bool) -> Any:
        """A closure's ``(losses, z)`` or ``(losses, z, sample_weight)``: record z (for a draw with a
        graph) and return what the parameters-mode closure returns (``losses`` or ``(losses, weights)``)."""
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            raise TypeError(
                "with jacobian='features' the closure must return (losses, z) or (losses, z, sample_weight), z "
                f"being the trunk's output that every head reads; got {type(result).__name__}"
                + (f" of {len(result)} items" if isinstance(result, tuple) else "")
            )
        pieces = as_pieces(result[1])
        if need_graph:
            for index, piece in enumerate(pieces):
                if not piece.is_floating_point():  # first: an integer z cannot have a graph at all
                    raise TypeError(f"features[{index}] must be floating point, got {piece.dtype}")
                if not piece.requires_grad:
                    raise ValueError(
                        f"features[{index}] (shape {tuple(piece.shape)}) needs no grad (computed under "
                        "torch.no_grad(), detached, or from parameters that do not require grad): z must be the "
                        "trunk's output with its graph"
                    )
            if self.features is None:
                self.features = pieces
            elif len(pieces) != len(self.features) or any(a is not b for a, b in zip(pieces, self.features)):
                raise ValueError(
                    f"{self.method} takes per-task gradients on several independent batches in one step, and with "
                    "jacobian='features' their columns are different samples, so products of their Jacobians "
                    "estimate nothing: give it one batch (Balancer.backward(losses, features=z), or a closure "
                    "returning the same batch at every call) or use jacobian='parameters'"
                )
        return (result[0], result[2]) if len(result) == 3 else result[0]

    def heads(self, losses: Tensor, shared: Sequence[Tensor], *, feed_heads: bool = True) -> list[Tensor]:
        """The leaves above z (the heads; none unless ``feed_heads``), after checking that the losses read
        the trunk only through z (whether or not the heads are fed)."""
        if self.features is None:
            raise ValueError("jacobian='features': no features z were given with these losses")
        if self._checked is None or self._checked[0] is not losses:
            heads = heads_above_features(losses, self.features, shared)
            # FSDP2-sharded heads are among them, as their unsharded copies (the step feeds them through FSDP's own
            # backward, drmoo.optim._fsdp); their values are freed between passes, so the rows' linear-head
            # factoring, which reads the weights outside a backward, is not used on them (task_jacobian)
            self._sharded_heads = bool(split_sharded_heads(heads)[1])
            self._checked = (losses, heads)
        return self._checked[1] if feed_heads else []

    def task_split(self, losses: Tensor) -> TaskSplit | None:
        """The per-task heads of ``losses``' graph above z (:func:`drmoo._head_split.task_split`), read once
        per losses."""
        assert self.features is not None
        if self._split is None or self._split[0] is not losses:
            self._split = (losses, task_split(losses, self.features))
        return self._split[1]

    # ------------------------------------------------------------------------------ rows of J_z
    def _buffer(self, slot: str, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        assert self.features is not None
        width = sum(piece.numel() for piece in self.features)
        buf = self._buffers.get(slot)
        if buf is None or buf.shape != (rows, width) or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(rows, width, dtype=dtype, device=device)
            self._buffers[slot] = buf
        return buf

    def task_jacobian(self, host: EngineHost, losses: Tensor, cotangent: Tensor, slot: str, *,
                      heads: Sequence[Tensor], feed_heads: bool = True) -> Tensor:
        """J_z [m, sum of z's numel]: row i = d (sum_b cotangent[b, i] losses[b, i]) / dz, flattened; the
        heads accumulate their gradients in the same passes (above z only: the trunk is not traversed).
        Each rank keeps its samples' columns (:meth:`products_over_ranks` sums their products).

        The graph above z is always kept: it is small (the heads), the step's later draws of the same
        batch walk it again, and the trunk's graph below z -- the large one -- is freed by the lift."""
        assert self.features is not None
        shared = host._shared_params()
        self._earlier = host.accumulation  # their Gram is added to these rows' (gram)
        scale = host.loss_scale
        scaled = times(cotangent, scale)
        out = self._buffer(slot, host.num_tasks, shared[0].dtype, shared[0].device)
        strategy = host.jacobian_strategy
        linear = linear_head(losses, self.features) if strategy == "auto" and not self._sharded_heads else None
        split = self.task_split(losses) if strategy == "auto" and linear is None else None
        # Every strategy takes the rows as they arrive at z (partials, before z's own hooks): the lift adds
        # the paths between pieces and applies z's hooks, once.
        with gradients_arriving_at(self.features):
            if linear is not None:  # linear heads: each row an outer product, from one pass (drmoo._linear_head)
                head_grads = linear.rows_into(losses, scaled, out, inputs=list(heads), retain_graph=True)
                if heads:
                    accumulate_into_grad(heads, head_grads)
                jacobian = out
                self._factored = (out, out._version, linear)
            elif split is not None:  # other separate heads: every row from one ordinary pass (drmoo._head_split)
                head_grads = split_task_jacobian(losses, scaled, self.features, out, split, heads=heads,
                                                 retain_graph=True)
                accumulate_into_grad(heads, head_grads)
                jacobian = out
            else:
                resolved = resolve_strategy(strategy, out.device, host.num_tasks, features=True)
                strategy = without_vmap_over_compiled(strategy, resolved, losses, self.features)
                jacobian = task_jacobian(losses, scaled, self.features, out, strategy=strategy,
                                         feed_heads=bool(heads), retain_graph=True, heads=heads)
        return divide_(jacobian, scale)

    def combined_gradient(self, host: EngineHost, losses: Tensor, weighted: Tensor, slot: str, *,
                          retain_graph: bool) -> Tensor:
        """d (sum_b,i weighted[b, i] losses[b, i]) / dz, flattened (one pass above z), into buffer ``slot``."""
        assert self.features is not None
        shared = host._shared_params()
        flat = self._buffer(slot, 1, shared[0].dtype, shared[0].device)[0]
        with gradients_arriving_at(self.features):  # as in task_jacobian: the lift adds what lies below z
            grads = torch.autograd.grad(losses, self.features, grad_outputs=weighted, retain_graph=retain_graph,
                                        allow_unused=True)
        copy_into_row(self.features, flat, grads)
        return flat

    def gram(self, ops: Any, rows: Tensor) -> Tensor:
        """J J^T of this step's rows: from the linear heads' factors when the rows are theirs, as written
        (:meth:`drmoo._linear_head.LinearHead.gram`), else the backend's ``gram`` op; closing an accumulation,
        plus the earlier micro-batches' (their z coordinates are disjoint from these rows')."""
        factored = self._factored
        if factored is not None and factored[0] is rows and rows._version == factored[1]:
            gram = factored[2].gram()
        else:
            gram = cast(Tensor, ops.gram(rows))
        return gram if self._earlier is None else self._earlier.with_earlier_gram(gram)

    @staticmethod
    def products_over_ranks(small: Tensor) -> Tensor:
        """An m x m (or m) product of features rows, summed over ranks: each rank's rows hold the
        columns of its own samples, and the global batch's columns are their concatenation."""
        return distributed.all_reduce_sum_(small)

    # --------------------------------------------------------------------------------- the lift
    def apply(self, host: EngineHost, rows: Tensor, coefficients: Tensor, factor: Tensor | float) -> None:
        """The method's direction ``factor * coefficients^T rows`` (rows w.r.t. z) lifted to theta by ONE
        backward pass through the trunk: d_theta = (dz/dtheta)^T (factor * coefficients^T rows).

        Summed over ranks and checked finite (eagerly: raises before anything is written; capturable:
        into the step's found_inf).  Direction mode (``drmoo.Balancer``): the gradients autograd returns
        become the shared parameters' ``.grad`` contribution directly (times ``grad_scale``, added to an
        existing ``.grad`` once the step succeeds).  Otherwise the flat [n] direction writes theta as a
        parameters-mode direction does (:func:`~drmoo.optim._direction.write_direction`).
        """
        flat = self._lift(host, rows, coefficients, factor)
        if flat is not None:
            one = self._buffers.get("one")  # the one row's coefficient, kept: not rebuilt every step
            if one is None or one.dtype != coefficients.dtype or one.device != coefficients.device:
                one = self._buffers["one"] = torch.ones(1, dtype=coefficients.dtype, device=coefficients.device)
            write_direction(host, flat[None, :], one, 1.0, self._buffers)

    def _lift(self, host: EngineHost, rows: Tensor, coefficients: Tensor,
              factor: Tensor | float) -> Tensor | None:
        """:meth:`apply`'s lift: None when direction mode wrote ``.grad``, else the flat direction d_theta."""
        assert self.features is not None, "a features direction is applied within the step that made it"
        width = sum(piece.numel() for piece in self.features)
        if rows.shape[-1] != width:
            raise ValueError(f"features rows have {rows.shape[-1]} columns, but z has {width} entries")
        acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
        scale = host.loss_scale  # fp16: the trunk's backward runs on scaled cotangents
        with torch.no_grad():
            direction = torch.mv(rows.to(acc).T, coefficients.to(acc))  # [sum numel z], z's coordinates
            if not (isinstance(factor, float) and factor == 1.0):
                direction = direction * factor
            direction = times(direction, scale)
            found_inf = host.found_inf
            if found_inf is not None:  # a skipped capturable step: a zero cotangent, no NaN into the trunk
                direction = direction.masked_fill(found_inf, 0.0)
            cotangents, offset = [], 0
            for piece in self.features:
                cotangents.append(direction[offset: offset + piece.numel()].view_as(piece).to(piece.dtype))
                offset += piece.numel()
        shared = host._shared_params()
        if is_sharded(shared):  # FSDP2: one ordinary backward, FSDP reduces into the shards (drmoo.optim._fsdp)
            lift_into_shards(host, self.features, cotangents, shared)
            return None
        grads = list(torch.autograd.grad(self.features, shared, grad_outputs=cotangents, allow_unused=True))
        require_reached(grads)
        with torch.no_grad():
            grads = [torch.zeros_like(param) if grad is None else grad for param, grad in zip(shared, grads)]
            if host.accumulation is not None:  # the earlier micro-batches' part, from their lifted rows
                host.accumulation.add_lifted(grads, rows, coefficients, with_scale(factor, scale))
            if distributed.is_distributed():  # shard directions -> the global batch's (one flat all-reduce)
                joined = torch.cat([grad.reshape(-1) for grad in grads])
                distributed.all_reduce_sum_(joined)
                parts = torch.split(joined, [g.numel() for g in grads])
                grads = [part.view_as(grad) for part, grad in zip(parts, grads)]
            if tests_trunk_gradients(host):
                host.require_finite(finite_together(trunk_guard_values(grads, host._ops)), lambda _: (
                    f"non-finite gradient of the shared parameters from the backward pass through the trunk in "
                    f"{host.failing_iteration}; the step was abandoned and nothing was updated"))
            if host.direction_mode:
                if host.grad_scale is not scale:  # the Balancer's: one scale, the trunk's .grad kept scaled
                    gain = host.grad_scale / scale
                    if not is_unit(gain):
                        torch._foreach_mul_(grads, gain)
                if found_inf is not None:
                    for grad in grads:
                        grad.masked_fill_(found_inf, 0.0)
                host.set_aside_head_grads(shared)  # the step's .grad, committed once it succeeds
                for param, grad in zip(shared, grads):
                    param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
                return None
            n = sum(param.numel() for param in shared)
            flat = self._buffers.get("theta")
            if flat is None or flat.numel() != n or flat.dtype != shared[0].dtype or flat.device != shared[0].device:
                flat = self._buffers["theta"] = torch.empty(n, dtype=shared[0].dtype, device=shared[0].device)
            copy_into_row(shared, flat, grads)
            return divide_(flat, scale)
