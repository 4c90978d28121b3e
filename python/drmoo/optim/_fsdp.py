"""Shared parameters sharded by FSDP2: the Balancer runs on them (features mode; parameters mode for MGDA,
MoDo and SDMGrad); the rest is refused in one line.

FSDP2 (``torch.distributed.fsdp.fully_shard``) replaces a module's parameters by sharded ``DTensor``
parameters and runs the forward pass on all-gathered, unsharded copies: the losses' autograd graph
reaches the copies, never the sharded parameters an optimizer or a balancer holds.  FSDP1
(``FullyShardedDataParallel``) flattens them into ``FlatParameter`` shards the same way.

What works: ``drmoo.Balancer(..., jacobian="features")`` on a trunk wrapped by ``fully_shard`` (the
heads left unwrapped, replicated).  Features mode takes its m per-task gradients above z, which FSDP
does not touch, and crosses the trunk once, with the method's combined cotangent: that pass is an
ordinary backward (:func:`lift_into_shards`), which FSDP's own hooks all-gather for and reduce-scatter
into the shards' ``.grad`` -- each rank then holds its shard of the global batch's direction, and
neither J nor any n-sized vector is gathered.  Only m x m products and the dual statistics cross ranks
besides FSDP's own collectives.

Parameters mode, for the methods whose step reads J only through its Gram and one direction J^T w
(:data:`PARAMETERS_MODE_METHODS`: MGDA, MoDo, SDMGrad): one ordinary backward per task, restricted to FSDP's
unsharded copies of the shared parameters (found in FSDP2's own records, :func:`unsharded_copies`, and
so never taken for heads), which FSDP reduce-scatters into the shards' ``.grad``
(:func:`sharded_task_jacobian`).  Each rank keeps its shard's columns of J [m, n_local]; the Gram is
the sum of the shards' local Grams (one all-reduce of m x m), and each shard's ``.grad`` is its part
of J^T w (:func:`add_sharded_direction`).  The m per-task gradients are never gathered.

What is refused, with one line naming FSDP and the alternative: parameters mode for the other methods,
the ``step(closure)`` optimizers (they write theta themselves), gradient accumulation, FSDP1's
``FlatParameter``, a GradScaler and capturable steps on sharded parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from drmoo import distributed

from ._loss_scale import is_unit

if TYPE_CHECKING:
    from ._engine import EngineHost

__all__ = ["is_sharded", "lift_into_shards", "refuse_sharded", "sharding_of"]

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


# The methods whose parameters-mode step reads the per-task gradients only through their Gram and one
# direction J^T w: on sharded parameters both are sums over the shards (one m x m all-reduce; no gather).
PARAMETERS_MODE_METHODS = ("MGDA", "MoDo", "SDMGrad")


def refuse_sharded(params: Sequence[Tensor], jacobian: str, method: str = "") -> None:
    """Raise ValueError, naming FSDP and the alternative, if ``params`` are sharded in a way the ``jacobian``
    mode cannot run on (every way but FSDP2 in features mode, and FSDP2 in parameters mode for
    :data:`PARAMETERS_MODE_METHODS`)."""
    sharding = sharding_of(params)
    if sharding is None or (is_sharded(params) and (jacobian == "features" or method in PARAMETERS_MODE_METHODS)):
        return
    if is_sharded(params) and jacobian == "parameters":
        raise ValueError(
            f"{method or 'this method'} cannot run in parameters mode on FSDP-sharded shared parameters (its step "
            "reads more of the per-task gradients than their Gram and one direction); use "
            f"jacobian='features', a method among {', '.join(PARAMETERS_MODE_METHODS)}, or {ALTERNATIVE}")
    raise ValueError(
        f"the shared parameters are {sharding}: drmoo's parameters mode takes its per-task gradients with respect "
        "to the parameters it holds, which FSDP's forward never uses (it computes with all-gathered copies); "
        f"on a trunk wrapped by fully_shard use drmoo.Balancer(..., jacobian='features'), or {ALTERNATIVE}"
    )


def lift_into_shards(host: EngineHost, features: Sequence[Tensor], cotangents: Sequence[Tensor],
                     shared: Sequence[Tensor]) -> None:
    """Features mode's lift on FSDP2-sharded shared parameters, in direction mode: ONE ordinary backward of
    ``cotangents`` from z, which FSDP reduce-scatters into the shards' ``.grad`` (kept apart until the step
    succeeds, as every ``.grad`` a step writes), checked finite on every rank.

    The cotangents are the global batch's (divided by the world size, as every rank's share of the dual's
    mean); FSDP's default reduction averages over ranks, so they are multiplied by the world size first, to
    sum.  A gradient divide factor set on the module (``set_gradient_divide_factor``) would change that."""
    refuse_unsupported(host)
    world = distributed.world_size()
    host.set_aside_head_grads(shared)  # the step's .grad, committed once it succeeds
    torch.autograd.backward(list(features), grad_tensors=[c * world if world != 1 else c for c in cotangents])
    dtensor = _dtensor()
    local = [grad.to_local() if isinstance(grad, dtensor) else grad
             for grad in (param.grad for param in shared) if grad is not None]
    if len(local) != len(shared):
        raise ValueError("the backward pass from the features z reached none of the FSDP-sharded shared "
                         "parameters: z must be the output of the trunk they belong to")
    with torch.no_grad():
        finite = torch.isfinite(torch.stack([torch.linalg.vector_norm(part) for part in local]).sum()).reshape(1)
        if distributed.is_distributed():  # every rank abandons the step, or none
            finite = distributed.all_reduce_max((~finite).to(torch.int32)) == 0
    host.require_finite(finite, lambda _: (
        f"non-finite gradient of the shared parameters from the backward pass through the trunk in "
        f"{host.failing_iteration}; the step was abandoned and nothing was updated"))


def refuse_unsupported(host: EngineHost) -> None:
    """What a step on FSDP-sharded parameters cannot do: write theta itself, or scale its gradients."""
    if not host.direction_mode:
        raise ValueError("a drmoo optimizer's step(closure) writes theta itself and cannot run on FSDP-sharded "
                         "parameters: use drmoo.Balancer and a torch optimizer, or " + ALTERNATIVE)
    if not is_unit(host.loss_scale) or not is_unit(host.grad_scale) or host.found_inf is not None:
        raise ValueError("a GradScaler or capturable steps with FSDP-sharded shared parameters are not supported: "
                         "use FSDP's MixedPrecisionPolicy (bf16 needs no scaler), or " + ALTERNATIVE)


def unsharded_copies(shared: Sequence[Tensor]) -> list[Tensor]:
    """The unsharded parameters FSDP2 all-gathered for the forward pass of ``shared`` (what the losses' graph
    reaches), read from FSDP2's own parameter records: never to be taken for the heads."""
    from torch.distributed import _composable_state

    wanted = {id(param) for param in shared}
    copies = []
    for entry in list(_composable_state._module_state_mapping.values()):
        state: Any = entry() if not hasattr(entry, "_fsdp_param_group") and callable(entry) else entry
        group = getattr(state, "_fsdp_param_group", None)
        for record in getattr(group, "fsdp_params", ()):
            if id(record.sharded_param) in wanted and hasattr(record, "_unsharded_param"):
                copies.append(record._unsharded_param)
    if len(copies) != len(shared):
        raise ValueError(f"found the FSDP2 unsharded copies of {len(copies)} of the {len(shared)} sharded shared "
                         "parameters: the losses must come from a forward pass of the fully_shard modules that hold "
                         f"them (this torch's FSDP2 may also keep them elsewhere); use jacobian='features', or "
                         f"{ALTERNATIVE}")
    return copies


def sharded_task_jacobian(host: EngineHost, losses: Tensor, cotangent: Tensor, shared: Sequence[Tensor]) -> Tensor:
    """Parameters mode on FSDP2-sharded shared parameters: this rank's columns of the global batch's J [m, n_local].

    One ordinary backward per task, restricted to FSDP's unsharded copies (the heads are not touched), which
    FSDP reduce-scatters into the shards' ``.grad``: row i's shard, read and cleared before the next task.
    The cotangents are times the world size against FSDP's mean, as in :func:`lift_into_shards`.  No per-task
    gradient crosses ranks whole: the Gram is the sum of the shards' local Grams (``products_over_ranks``)."""
    refuse_unsupported(host)
    copies = unsharded_copies(shared)
    world = distributed.world_size()
    dtensor = _dtensor()
    host.set_aside_head_grads(shared)  # the passes below write the shards' .grad; the step's own comes later
    rows = []
    for task in range(host.num_tasks):
        torch.autograd.backward(losses[:, task], grad_tensors=cotangent[:, task].to(losses.dtype) * world,
                                inputs=copies, retain_graph=True)
        local = [param.grad.to_local() if isinstance(param.grad, dtensor) else param.grad for param in shared]
        rows.append(torch.cat([torch.zeros(_local_numel(param), dtype=shared[0].dtype, device=shared[0].device)
                               if grad is None else grad.reshape(-1) for param, grad in zip(shared, local)]))
        for param in shared:
            param.grad = None
    return torch.stack(rows)


def add_sharded_direction(host: EngineHost, rows: Tensor, coefficients: Tensor, factor: Tensor | float,
                          shared: Sequence[Tensor]) -> None:
    """Direction mode on FSDP2-sharded parameters: each shard's ``.grad`` = its part of factor * J^T w, from this
    rank's columns ``rows`` (a sharded DTensor gradient, as FSDP's own backward leaves it)."""
    refuse_unsupported(host)
    dtensor = _dtensor()
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        direction = (coefficients.to(acc) @ rows.to(acc)) * factor
        host.set_aside_head_grads(shared)
        offset = 0
        for param in shared:
            local = param.to_local() if isinstance(param, dtensor) else param
            part = direction[offset: offset + local.numel()].view_as(local).to(param.dtype)
            offset += local.numel()
            param.grad = (dtensor.from_local(part, param.device_mesh, param.placements, shape=param.shape,
                                             stride=param.stride()) if isinstance(param, dtensor) else part)


def _local_numel(param: Tensor) -> int:
    dtensor = _dtensor()
    return int(param.to_local().numel()) if isinstance(param, dtensor) else param.numel()


def _dtensor() -> Any:
    """The DTensor class (imported when needed: torch.distributed is not on every build's import path)."""
    from torch.distributed.tensor import DTensor

    return DTensor
