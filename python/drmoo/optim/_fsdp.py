"""Shared parameters sharded by FSDP: features mode's Balancer runs on them; the rest is refused in one line.

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

What is refused, with one line naming FSDP and the alternative: parameters mode (its m per-task
gradients are taken with respect to the parameters the balancer holds, which FSDP's forward never
uses), the ``step(closure)`` optimizers (they write theta themselves), FSDP1's ``FlatParameter``, a
GradScaler and capturable steps on sharded parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from drmoo import distributed

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


def refuse_sharded(params: Sequence[Tensor], jacobian: str) -> None:
    """Raise ValueError, naming FSDP and the alternative, if ``params`` are sharded in a way the ``jacobian``
    mode cannot run on (every way but FSDP2 in features mode)."""
    sharding = sharding_of(params)
    if sharding is None or (jacobian == "features" and is_sharded(params)):
        return
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
    if not host.direction_mode:
        raise ValueError("a drmoo optimizer's step(closure) writes theta itself and cannot run on FSDP-sharded "
                         "parameters: use drmoo.Balancer(..., jacobian='features') and a torch optimizer, or "
                         f"{ALTERNATIVE}")
    if host.loss_scale != 1.0 or host.grad_scale != 1.0 or host.found_inf is not None:
        raise ValueError("a GradScaler or capturable steps with FSDP-sharded shared parameters are not supported: "
                         "use FSDP's MixedPrecisionPolicy (bf16 needs no scaler), or " + ALTERNATIVE)
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


def _dtensor() -> Any:
    """The DTensor class (imported when needed: torch.distributed is not on every build's import path)."""
    from torch.distributed.tensor import DTensor

    return DTensor
