"""Shared parameters (and heads) sharded by FSDP2: the Balancer and the ``step(closure)`` optimizers run on them,
in features mode and in parameters mode (every method but MoCo); the rest is refused in one line.

FSDP2 (``torch.distributed.fsdp.fully_shard``) replaces a module's parameters by sharded ``DTensor``
parameters and runs the forward pass on all-gathered, unsharded copies: the losses' autograd graph
reaches the copies, never the sharded parameters an optimizer or a balancer holds.  FSDP1
(``FullyShardedDataParallel``) flattens them into ``FlatParameter`` shards the same way.

Features mode, on a trunk wrapped by ``fully_shard`` (the heads replicated, or sharded: see below), takes its m
per-task gradients above z, which FSDP does not touch, and crosses the trunk once, with the method's
combined cotangent: that pass is an ordinary backward (:func:`lift_into_shards`), which FSDP's own hooks
all-gather for and reduce-scatter into the shards' ``.grad`` -- each rank then holds its shard of the
global batch's direction, and neither J nor any n-sized vector is gathered.  Only m x m products and the
dual statistics cross ranks besides FSDP's own collectives.

Parameters mode: every method's step reads the per-task gradients through m x m products of them (the
Gram, MoDo's and SDMGrad's cross products, Double-Loop's Y_bar Y_tilde^T w), scalars derived from those
(Double-Clip's clip ||J^T w|| = sqrt(w^T G w), Nash-MTL's bargaining solve) and one direction c^T J -- or,
for FAMO and Nash-MTL between weight updates, one combined gradient.  Each is a sum over the shards'
columns.  One ordinary backward per task, restricted to FSDP's unsharded copies of the shared parameters
(found in FSDP2's own records, :func:`unsharded_copies`, and so never taken for heads), which FSDP
reduce-scatters into the shards' ``.grad`` (:func:`sharded_task_jacobian`; a combined gradient likewise,
:func:`sharded_combined_gradient`): each rank keeps its shard's columns of J [m, n_local], every m x m
product is the sum of the shards' local ones (one all-reduce), a norm one all-reduced scalar, and each
shard's part of the direction is its own columns' (:func:`add_sharded_direction`).  The m per-task
gradients are never gathered.  MoCo is refused: its tracked m x n estimate would be kept as each rank's
columns, a state_dict that depends on the sharding.

Writing theta: in direction mode (``drmoo.Balancer``) the direction goes into each shard's ``.grad`` for the
user's optimizer.  A ``step(closure)`` optimizer moves each shard itself, ``theta -= lr * d`` on its local
tensor (:func:`write_shards`, after the step's guards are read); the next forward all-gathers the moved shards.

Heads sharded by FSDP2 (``fully_shard`` on each head, or on a module that holds them, such as the root): a
step feeds a replicated head its gradient outside any ordinary backward (``autograd.grad`` and an add into
``.grad``), which FSDP would never reduce into a sharded head's shards -- worse, FSDP's next post-backward would
pick up whatever sat in the unsharded copy's ``.grad`` and average it into the shards mid-step.  So a sharded
head is never fed that way: the losses' graph leaves that are FSDP's unsharded copies are told apart from the
plain heads (:func:`split_sharded_heads`, from FSDP2's own records), and each pass that feeds the heads gives
the sharded ones the same gradient, d(sum_b,i cotangent[b, i] losses[b, i]) / d(head), through ONE ordinary
backward restricted to their copies (:func:`feed_sharded_heads`), which FSDP reduce-scatters into the heads'
shards' ``.grad`` -- times the world size against FSDP's mean, so that they hold the global batch's sum, as
one process on it would.  Those ``.grad`` are set aside before the pass and committed once the step succeeds,
like every other ``.grad`` a step writes, and are not summed over ranks again (they are already summed).
Features mode does not read linear heads' rows off their weights on them (FSDP frees the copies between
passes).  A closure's forward without a graph (FAMO's re-evaluation, a dual step) is followed by a reshard of
every FSDP module (:func:`reshard_after_forward_without_grad`): FSDP keeps a root's copies for a backward that
then never comes, and the heads' optimizer step would leave the next forward on stale copies.

What is refused, with one line naming FSDP and the alternative: MoCo in parameters mode; gradient accumulation
on a sharded trunk or with sharded heads; FSDP1's ``FlatParameter``; a GradScaler and capturable steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from drmoo import distributed

from ._engine import tests_trunk_gradients
from ._loss_scale import is_unit

if TYPE_CHECKING:
    from ._engine import EngineHost

__all__ = ["add_sharded_direction", "feed_sharded_heads", "is_sharded", "lift_into_shards", "local_views",
           "refuse_accumulating_sharded_heads", "refuse_sharded", "reshard_after_forward_without_grad",
           "sharded_combined_gradient", "sharded_task_jacobian", "sharding_of", "split_sharded_heads", "sum_over_ranks",
           "unsharded_copies"]

# A sharded head: (the parameter FSDP2 shards, a DTensor the user's optimizer holds; its unsharded copy, the leaf
# the losses' graph reaches)
ShardedHead = tuple[Tensor, Tensor]

ALTERNATIVE = ("keep the shared parameters replicated and use DistributedDataParallel (the balancer does its own "
               "all-reduce; gradient accumulation, backward(..., accumulate=True), bounds the activations' memory)")


def sharding_of(params: Sequence[Tensor]) -> str | None:
    """How ``params`` are sharded ("FSDP2 (fully_shard)", "FSDP (FullyShardedDataParallel)"), or None."""
    dtensor = _dtensor()
    for param in params:
        if isinstance(param, dtensor):
            return "sharded DTensors (FSDP2's fully_shard, or tensor parallelism)"
        if getattr(param, "_is_flat_param", False) or type(param).__name__ == "FlatParameter":
            return "FSDP's FlatParameter shards (FullyShardedDataParallel)"
    return None


def is_sharded(params: Sequence[Tensor]) -> bool:
    """Whether any of ``params`` is a sharded DTensor (FSDP2)."""
    dtensor = _dtensor()
    return any(isinstance(param, dtensor) for param in params)


def refuse_sharded(params: Sequence[Tensor], jacobian: str, method: str = "", refusal: str | None = None) -> None:
    """Raise ValueError, naming FSDP and the alternative, if ``params`` are sharded in a way the ``jacobian``
    mode cannot run on: FSDP1's ``FlatParameter`` always, FSDP2 in parameters mode for a method whose step
    cannot be written from the shards' columns (its class's ``SHARDED_REFUSAL``, given as ``refusal``)."""
    sharding = sharding_of(params)
    if sharding is None or (is_sharded(params) and (jacobian == "features" or not refusal)):
        return
    if is_sharded(params):
        raise ValueError(f"{method or 'this method'} cannot run in parameters mode on FSDP-sharded shared "
                         f"parameters: {refusal}; {ALTERNATIVE}")
    raise ValueError(
        f"the shared parameters are {sharding}: drmoo's parameters mode takes its per-task gradients with respect "
        "to the parameters it holds, which FSDP's forward never uses (it computes with all-gathered copies); "
        f"wrap the trunk with FSDP2's fully_shard instead, or {ALTERNATIVE}"
    )


def lift_into_shards(host: EngineHost, features: Sequence[Tensor], cotangents: Sequence[Tensor],
                     shared: Sequence[Tensor]) -> None:
    """Features mode's lift on FSDP2-sharded shared parameters: ONE ordinary backward of ``cotangents`` from z,
    which FSDP reduce-scatters into the shards' ``.grad`` (kept apart until the step succeeds, as every
    ``.grad`` a step writes), checked finite on every rank.  Direction mode leaves it there; ``step(closure)``
    moves each shard by it (:func:`write_shards`) and leaves ``.grad`` as it found it.

    The cotangents are the global batch's (divided by the world size, as every rank's share of the dual's
    mean); FSDP's default reduction averages over ranks, so they are multiplied by the world size first, to
    sum.  A gradient divide factor set on the module (``set_gradient_divide_factor``) would change that."""
    refuse_unsupported(host)
    world = distributed.world_size()
    host.set_aside_head_grads(shared)  # the step's .grad, committed once it succeeds
    torch.autograd.backward(list(features), grad_tensors=[c * world if world != 1 else c for c in cotangents])
    if any(param.grad is None for param in shared):
        raise ValueError("the backward pass from the features z reached none of the FSDP-sharded shared "
                         "parameters: z must be the output of the trunk they belong to")
    local = take_local_grads(shared, clear=not host.direction_mode)
    if tests_trunk_gradients(host):  # the same on every rank (the Balancer's setting): one collective or none
        with torch.no_grad():
            square = sum_over_ranks(torch.stack([torch.linalg.vector_norm(part).double() ** 2
                                                 for part in local]).sum())
        host.require_finite(torch.isfinite(square).reshape(1), lambda _: (
            f"non-finite gradient of the shared parameters from the backward pass through the trunk in "
            f"{host.failing_iteration}; the step was abandoned and nothing was updated"))
    if not host.direction_mode:
        write_shards(host, shared, local, host.hyper("lr"))


def refuse_unsupported(host: EngineHost) -> None:
    """What a step on FSDP-sharded parameters cannot do: scale its gradients (a GradScaler) or run capturable."""
    if not is_unit(host.loss_scale) or not is_unit(host.grad_scale) or host.found_inf is not None:
        raise ValueError("a GradScaler or capturable steps with FSDP-sharded shared parameters are not supported: "
                         "use FSDP's MixedPrecisionPolicy (bf16 needs no scaler), or " + ALTERNATIVE)


def local_views(params: Sequence[Tensor]) -> list[Tensor]:
    """Each parameter's part held by this rank: a sharded DTensor's local shard (a view: writing it moves the
    parameter FSDP all-gathers next), any other tensor itself."""
    dtensor = _dtensor()
    return [param.to_local() if isinstance(param, dtensor) else param for param in params]


def take_local_grads(shared: Sequence[Tensor], *, clear: bool) -> list[Tensor]:
    """The shards' ``.grad`` that FSDP's reduce-scatter left, as local tensors (zeros where none arrived);
    with ``clear`` the ``.grad`` are emptied (the next pass, or the step's commit, starts from None)."""
    dtensor = _dtensor()
    local = []
    for param, view in zip(shared, local_views(shared)):
        grad = param.grad
        local.append(torch.zeros_like(view) if grad is None else grad.to_local() if isinstance(grad, dtensor) else grad)
        if clear:
            param.grad = None
    return local


def sum_over_ranks(small: Tensor) -> Tensor:
    """A small product of the shards' columns (a squared norm, a Gram), as the whole parameters': summed over
    ranks (one all-reduce; unchanged on one process)."""
    return distributed.all_reduce_sum_(small) if distributed.is_distributed() else small


def write_shards(host: EngineHost, shared: Sequence[Tensor], direction: Sequence[Tensor], lr: Tensor | float) -> None:
    """``step(closure)`` on FSDP2-sharded parameters: each rank moves its shard, ``theta -= lr * d``, from its part
    of d (local tensors, one per parameter), once the step's guards are read (its only write that cannot be
    undone).  The next forward all-gathers the moved shards."""
    host.settle_guards()
    with torch.no_grad():
        for view, part in zip(local_views(shared), direction):
            view.sub_(lr * part.to(view.dtype))


def _fsdp_records() -> list[tuple[Tensor, Tensor]]:
    """(sharded parameter, its unsharded copy) of every FSDP2 parameter all-gathered so far in this process, read
    from FSDP2's own records (none without FSDP2)."""
    from torch.distributed import _composable_state

    pairs = []
    for entry in list(_composable_state._module_state_mapping.values()):
        state: Any = entry() if not hasattr(entry, "_fsdp_param_group") and callable(entry) else entry
        group = getattr(state, "_fsdp_param_group", None)
        for record in getattr(group, "fsdp_params", ()):
            if hasattr(record, "_unsharded_param"):
                pairs.append((record.sharded_param, record._unsharded_param))
    return pairs


def unsharded_copies(shared: Sequence[Tensor]) -> list[Tensor]:
    """The unsharded parameters FSDP2 all-gathered for the forward pass of ``shared`` (what the losses' graph
    reaches), read from FSDP2's own parameter records: never to be taken for the heads."""
    wanted = {id(param) for param in shared}
    copies = [copy for sharded, copy in _fsdp_records() if id(sharded) in wanted]
    if len(copies) != len(shared):
        raise ValueError(f"found the FSDP2 unsharded copies of {len(copies)} of the {len(shared)} sharded shared "
                         "parameters: the losses must come from a forward pass of the fully_shard modules that hold "
                         f"them (this torch's FSDP2 may also keep them elsewhere); use jacobian='features', or "
                         f"{ALTERNATIVE}")
    return copies


def split_sharded_heads(heads: Sequence[Tensor]) -> tuple[list[Tensor], list[ShardedHead]]:
    """The heads (task-specific leaves of the losses' graph) as (the plain ones, fed as usual; the FSDP2-sharded
    ones, each as its sharded parameter and the unsharded copy the graph reaches), told apart by FSDP2's own
    records.  Without FSDP2 in use, every head is plain (no record is read)."""
    if not heads or not _fsdp_in_use():
        return list(heads), []
    sharded_of = {id(copy): sharded for sharded, copy in _fsdp_records()}
    plain: list[Tensor] = []
    sharded: list[ShardedHead] = []
    for head in heads:
        param = sharded_of.get(id(head))
        if param is None:
            plain.append(head)
        else:
            sharded.append((param, head))
    return plain, sharded


def feed_sharded_heads(host: EngineHost, losses: Tensor, cotangent: Tensor, heads: Sequence[ShardedHead]) -> None:
    """The FSDP2-sharded heads' gradient of sum_b,i cotangent[b, i] losses[b, i] -- what a pass that feeds the
    heads gives each plain head -- by ONE ordinary backward restricted to their unsharded copies, which FSDP
    reduce-scatters into their shards' ``.grad`` (accumulating over the step's passes; set aside first, committed
    once the step succeeds).  Checked finite on every rank.  The graph is kept: the step's own passes follow.

    The cotangent is the global batch's (divided by the world size); FSDP's reduction averages over ranks, so it
    is multiplied by the world size first, to sum (see :func:`lift_into_shards`)."""
    refuse_unsupported(host)
    if host.accumulation is not None:
        raise ValueError(_ACCUMULATION_REFUSAL)
    shards = [param for param, _ in heads]
    copies = [copy for _, copy in heads]
    world = distributed.world_size()
    host.set_aside_head_grads(shards)  # the step's .grad, committed once it succeeds
    # An unsharded copy's .grad is None here: FSDP's post-backward moves it into the shard and clears it at the
    # end of every backward, and drmoo never writes it.
    weighted = cotangent.to(losses.dtype)
    torch.autograd.backward(losses, grad_tensors=weighted * world if world != 1 else weighted, inputs=copies,
                            retain_graph=True)
    local = take_local_grads(shards, clear=False)
    with torch.no_grad():
        square = sum_over_ranks(torch.stack([torch.linalg.vector_norm(part).double() ** 2 for part in local]).sum())
    host.require_finite(torch.isfinite(square).reshape(1), lambda _: (
        f"non-finite gradients of the task-specific parameters (the FSDP-sharded heads) in "
        f"{host.failing_iteration}; the step was abandoned and nothing was updated"))


_ACCUMULATION_REFUSAL = (
    "micro-batches cannot be accumulated with FSDP-sharded heads: each micro-batch's head gradients are kept "
    "outside FSDP's backward, which would never reduce them into the shards; pass the whole batch to one backward, "
    "or keep the heads replicated (apply fully_shard to the trunk, or its blocks, only)")


def refuse_accumulating_sharded_heads(heads: Sequence[Tensor]) -> None:
    """Raise ValueError if any of ``heads`` (a micro-batch's graph leaves) is FSDP2's unsharded copy of a sharded
    parameter: an accumulated micro-batch's head gradients are kept apart, never reduced by FSDP."""
    if split_sharded_heads(heads)[1]:
        raise ValueError(_ACCUMULATION_REFUSAL)


def reshard_after_forward_without_grad() -> None:
    """After a closure's forward pass under ``torch.no_grad()`` (FAMO's re-evaluation, a dual-variable step):
    reshard every FSDP2 module it left unsharded.  FSDP keeps a root module's all-gathered parameters after its
    forward, for the backward that follows in training, and all-gathers again only what is sharded; after a
    forward without a graph no backward follows, so a write to the shards before the next forward -- the
    heads' optimizer after ``step(closure)``, FAMO putting its shards back when the re-evaluation fails -- would
    leave that forward computing with the stale copies.  Nothing without FSDP2 (no record is read)."""
    if not _fsdp_in_use():
        return
    from torch.distributed import _composable_state
    from torch.distributed.fsdp import FSDPModule

    for module in list(_composable_state._module_state_mapping.keys()):
        if isinstance(module, FSDPModule):
            module.reshard()  # frees the copies; the next forward (or backward) all-gathers the shards as they are


def _fsdp_in_use() -> bool:
    """Whether FSDP2 (or another composable API) manages any module in this process: cheap, no record read."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed import _composable_state

    return bool(_composable_state._module_state_mapping)


def sharded_task_jacobian(host: EngineHost, losses: Tensor, cotangent: Tensor, shared: Sequence[Tensor]) -> Tensor:
    """Parameters mode on FSDP2-sharded shared parameters: this rank's columns of the global batch's J [m, n_local].

    One ordinary backward per task, restricted to FSDP's unsharded copies (the heads are not touched), which
    FSDP reduce-scatters into the shards' ``.grad``: row i's shard, read and cleared before the next task.
    The cotangents are times the world size against FSDP's mean, as in :func:`lift_into_shards`.  No per-task
    gradient crosses ranks whole: the Gram is the sum of the shards' local Grams (``products_over_ranks``)."""
    rows = [sharded_combined_gradient(host, losses, cotangent[:, task:task + 1], shared, retain_graph=True,
                                      columns=slice(task, task + 1))
            for task in range(host.num_tasks)]
    return torch.stack(rows)


def sharded_combined_gradient(host: EngineHost, losses: Tensor, weighted: Tensor, shared: Sequence[Tensor], *,
                              retain_graph: bool, columns: slice | None = None) -> Tensor:
    """This rank's columns [n_local] of grad_theta sum_b,i weighted[b, i] losses[b, i] (``columns``: of those
    loss columns only) on FSDP2-sharded shared parameters: ONE ordinary backward restricted to FSDP's
    unsharded copies, which FSDP reduce-scatters into the shards' ``.grad`` (read, then cleared).  The
    cotangent is times the world size against FSDP's mean reduction (see :func:`lift_into_shards`)."""
    refuse_unsupported(host)
    copies = unsharded_copies(shared)
    world = distributed.world_size()
    host.set_aside_head_grads(shared)  # the passes below write the shards' .grad; the step's own comes later
    picked = losses if columns is None else losses[:, columns]
    torch.autograd.backward(picked, grad_tensors=weighted.to(losses.dtype) * world, inputs=copies,
                            retain_graph=retain_graph)
    local = take_local_grads(shared, clear=True)
    return torch.cat([part.reshape(-1) for part in local])


def add_sharded_direction(host: EngineHost, rows: Tensor, coefficients: Tensor, factor: Tensor | float,
                          shared: Sequence[Tensor]) -> None:
    """The step along factor * J^T w on FSDP2-sharded parameters, from this rank's columns ``rows``: in direction
    mode each shard's ``.grad`` = its part (a sharded DTensor gradient, as FSDP's own backward leaves it);
    in ``step(closure)`` each shard moves by -lr times it (:func:`write_shards`)."""
    refuse_unsupported(host)
    dtensor = _dtensor()
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        direction = (coefficients.to(acc) @ rows.to(acc)) * factor
        parts, offset = [], 0
        for view in local_views(shared):
            parts.append(direction[offset: offset + view.numel()].view_as(view))
            offset += view.numel()
        if not host.direction_mode:
            write_shards(host, shared, parts, host.hyper("lr"))
            return
        host.set_aside_head_grads(shared)
        for param, part in zip(shared, parts):
            part = part.to(param.dtype)
            param.grad = (dtensor.from_local(part, param.device_mesh, param.placements, shape=param.shape,
                                             stride=param.stride()) if isinstance(param, dtensor) else part)


def _dtensor() -> Any:
    """The DTensor class (imported when needed: torch.distributed is not on every build's import path)."""
    from torch.distributed.tensor import DTensor

    return DTensor
