"""Shared parameters sharded by FSDP: refused with one line that names FSDP and the alternative.

FSDP2 (``torch.distributed.fsdp.fully_shard``) replaces a module's parameters by sharded ``DTensor``
parameters and runs the forward pass on all-gathered, unsharded copies: the losses' autograd graph
reaches the copies, never the sharded parameters an optimizer or a balancer holds.  FSDP1
(``FullyShardedDataParallel``) flattens them into ``FlatParameter`` shards the same way.  The
methods take per-task gradients (m backward passes, or one lifted through the trunk) with respect to
the parameters they hold, and write ``.grad`` on them directly, outside FSDP's gradient reduction; so
on sharded parameters they would find no gradient at all.  Until that path exists, such parameters
are refused when the optimizer or balancer is built, instead of the first backward failing with a
message that blames the user's losses.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["refuse_sharded", "sharding_of"]

ALTERNATIVE = ("keep the shared parameters replicated and use DistributedDataParallel (the balancer does its own "
               "all-reduce; gradient accumulation, backward(..., accumulate=True), bounds the activations' memory)")


def sharding_of(params: Sequence[Tensor]) -> str | None:
    """How ``params`` are sharded ("FSDP2 (fully_shard)", "FSDP (FullyShardedDataParallel)"), or None."""
    from torch.distributed.tensor import DTensor  # torch.distributed is importable on every supported build

    for param in params:
        if isinstance(param, DTensor):
            return "sharded DTensors (FSDP2's fully_shard, or tensor parallelism)"
        if getattr(param, "_is_flat_param", False) or type(param).__name__ == "FlatParameter":
            return "FSDP's FlatParameter shards (FullyShardedDataParallel)"
    return None


def refuse_sharded(params: Sequence[Tensor]) -> None:
    """Raise ValueError, naming FSDP and the alternative, if any of ``params`` is sharded."""
    sharding = sharding_of(params)
    if sharding is not None:
        raise ValueError(
            f"the shared parameters are {sharding}: drmoo's methods take their per-task gradients with respect to "
            "the parameters they hold, which FSDP's forward never uses (it computes with all-gathered copies), "
            f"so FSDP-sharded shared parameters are not supported; {ALTERNATIVE}"
        )
