"""Data parallelism on torch.distributed for the multi-objective optimizers.

The scheme (one process per device, launched by ``torchrun``): every rank draws the same global
batch, keeps its shard (rank r takes rows r, r + W, r + 2W, ... - the DistributedSampler rule applied
to each batch the closure draws), and computes

* its dual statistics on the shard - the per-task objective and z = s (1 - mean_b v) are means over
  the batch, so the global ones are the mean over ranks (one all-reduce of 2m numbers), and the loss
  cotangents v / B_global are the local ones divided by W;
* its per-task Jacobian on the shard with those cotangents - the global J is the sum over ranks (one
  all-reduce of the flat [m, n] buffer);

after which every rank runs the identical (fused) update.  The heads' gradients are summed the same
way, by the optimizer's step.  With equal shard sizes this equals one process on the whole batch
up to the order of floating-point sums.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_grads", "all_reduce_max", "all_reduce_mean", "check_same_on_every_rank", "fingerprint",
           "is_distributed", "rank", "shard", "unequal_shards_message", "world_size"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def shard(rows: Tensor) -> Tensor:
    """This rank's share of a global batch of row indices (every W-th, starting at the rank).

    Args:
        rows: the global batch's row indices, the same on every rank; their number must be divisible by
            the number of processes W.
    """
    size = world_size()
    if size == 1:
        return rows
    if rows.shape[0] % size != 0:
        raise ValueError(f"the batch size {rows.shape[0]} must be divisible by the number of processes {size}")
    return rows[rank() :: size]


def all_reduce_mean(*tensors: Tensor) -> None:
    """In place: each tensor becomes its mean over ranks (one collective for all of them).

    Args:
        tensors: the tensors to average; each keeps its shape and dtype.
    """
    if not is_distributed() or not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat)
    flat /= world_size()
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def all_reduce_sum_(tensor: Tensor) -> Tensor:
    if is_distributed():
        dist.all_reduce(tensor)
    return tensor


def all_reduce_max(value: Tensor) -> Tensor:
    """Elementwise maximum over ranks (used to agree on flags: a failure anywhere is a failure everywhere).

    Args:
        value: reduced in place and returned.
    """
    if is_distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def all_reduce_grads(params: Iterable[Tensor]) -> None:
    """Sum the ``.grad`` of parameters outside the multi-objective update (the heads) over ranks.

    Heads sharded by FSDP2 (``fully_shard``) are skipped: their ``.grad`` is a sharded DTensor that FSDP's
    reduce-scatter already summed over ranks (a step feeds them through FSDP's own backward).

    Args:
        params: the heads' parameters; those without a ``.grad``, and FSDP2-sharded ones, are skipped.
    """
    if not is_distributed():
        return
    from torch.distributed.tensor import DTensor  # imported when needed, as every FSDP2 helper does

    # a sharded head's .grad holds its shard of the global batch's sum already: summing it again would double it
    grads = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def fingerprint(value: object) -> int:
    """A deterministic 32-bit digest of ``repr(value)`` (the same on every rank and run, unlike ``hash``
    of a string), for comparing structured values across ranks with one integer.

    Args:
        value: any value whose ``repr`` is deterministic (tuples of shapes and dtype names).

    Returns:
        The CRC-32 of ``repr(value)``, an int in [0, 2**32).
    """
    return zlib.crc32(repr(value).encode())


def check_same_on_every_rank(quantities: dict[str, object], *, device: torch.device | str = "cpu") -> None:
    """Raise ValueError on every rank, naming each quantity that differs between ranks and every rank's
    value of it, unless every quantity is the same on all of them.

    One fixed-size collective (a MAX all-reduce of [q, -q] per quantity; a value that is not an int is
    compared by its :func:`fingerprint`): the ranks must call it with the same keys, in the same order --
    which is why it compares what later collectives depend on *before* those run.  Only when something
    differs are the differing values gathered (one object all-gather), so the message shows them, not
    their fingerprints; a dict value shows only its differing keys.  Does nothing in a single process.

    Args:
        quantities: name -> this rank's value (``num_tasks``, the batch size, the method's name, ...).
        device: where the collective's tensor lives (the process group's device: CUDA for NCCL).

    Raises:
        ValueError: on every rank, when some quantity differs between ranks.
    """
    if not is_distributed():
        return
    numbers = [v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**62 else fingerprint(v)
               for v in quantities.values()]
    values = torch.tensor(numbers, dtype=torch.int64, device=device)
    extremes = all_reduce_max(torch.cat([values, -values])).tolist()
    count = len(quantities)
    differing = [name for index, name in enumerate(quantities) if extremes[index] != -extremes[count + index]]
    if not differing:
        return
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, {name: quantities[name] for name in differing})
    described = [_by_rank(name, [ranks[name] for ranks in gathered]) for name in differing]
    raise ValueError(
        f"the {world_size()} processes disagree on {'; '.join(described)}: every rank must build the balancer / "
        "optimizer with the same method, Jacobian mode, hyperparameters, shared parameters and num_tasks, and pass "
        "an equal shard of the global batch (drmoo.distributed.shard)"
    )


def _by_rank(name: str, values: list[Any]) -> str:
    """``name (V on rank 0, W on ranks 1, 2)``; for dicts, each differing key so (``lam: 0.8 on rank 0, ...``)."""
    if all(isinstance(v, dict) for v in values):
        keys = [key for key in dict.fromkeys(k for v in values for k in v)
                if any(v.get(key) != values[0].get(key) for v in values)]
        return "; ".join(_by_rank(f"{name} {key}", [v.get(key) for v in values]) for key in keys)
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value)[:120], []).append(rank)
    shown = [f"{text} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:8]))}"
             + (", ..." if len(ranks) > 8 else "") for text, ranks in groups.items()]
    return f"{name} ({', '.join(shown[:6])}{', ...' if len(shown) > 6 else ''})"


def unequal_shards_message(fewest: int, most: int) -> str:
    return (
        f"the ranks passed unequal shards ({fewest} to {most} rows): the global statistics are the mean of the "
        "ranks' means, which is the global batch's only when every rank holds the same number of rows; "
        "split each global batch with drmoo.distributed.shard (a batch size divisible by the number of "
        "processes, e.g. a DataLoader with drop_last=True)"
    )
