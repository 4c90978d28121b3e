"""Cross-rank agreement under torch.distributed: every rank abandons a step, or none.

A rank that raised alone (a NaN in its shard) would leave the others waiting forever in the step's
next collective, so the finite flags are agreed on before any rank acts on them; and ranks that run
different problems (another m, B or parameter shapes) would reach collectives of different sizes (a
gloo abort or a hang), so that is checked once, with one fixed-size collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from drmoo import distributed

from ._engine import JacobianEngine


def global_dual_forward(ops: ModuleType, losses: Tensor, eta: Tensor, lam: float, scale: float, divergence: Any,
                        weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The backend's ``dual_forward`` op over all ranks: the per-task objective, z and the loss cotangents.

    Under torch.distributed the objective and z are averaged over ranks and the cotangents divided by the
    world size, so that they are those of the global batch (see :mod:`drmoo.distributed`).
    """
    objective, z, cotangent = ops.dual_forward(losses, eta, lam, scale, divergence, weights)
    if distributed.is_distributed():
        distributed.all_reduce_mean(objective, z)
        cotangent = cotangent / distributed.world_size()
    return objective, z, cotangent


def all_ranks_finite(finite: Tensor) -> Tensor:
    """``finite`` (bool flags of this rank) reduced to one flag [1]: True when every rank's are all True."""
    return distributed.all_reduce_max((~finite.all()).to(torch.int32).reshape(1)) == 0


def check_same_problem(losses: Tensor, shared: Sequence[Tensor], num_tasks: int, settings: dict[str, Any]) -> None:
    """Raise ValueError on every rank unless all run the same optimizer (``settings``: method, Jacobian mode,
    hyperparameters -- what decides which collectives a step makes, and their sizes) on m tasks and B rows
    with the same shared parameters.  Called before the step's first collective."""
    distributed.check_same_on_every_rank({
        **settings,
        "the number of tasks m": num_tasks,
        "the number of rows B of the losses (the shard size)": losses.shape[0],
        "the number of shared parameters": len(shared),
        "the shared parameters' shapes and dtype": distributed.fingerprint(
            [(tuple(p.shape), str(p.dtype)) for p in shared]),
    }, device=losses.device)


def check_same_heads(engine: JacobianEngine, losses: Tensor, shared: Sequence[Tensor], device: torch.device) -> None:
    """Raise ValueError on every rank unless all feed the same heads (their number, shapes and dtypes): their
    gradients are summed over ranks in one collective per step, which ranks with different heads (a layer
    more above z on one) would enter with different sizes (a gloo abort).  Called once, before it runs.

    A graph the engine refuses counts as no heads here: the step raises that itself, with its own message."""
    try:
        heads = engine.heads(losses, shared, feed_heads=True)
    except ValueError:
        heads = []
    distributed.check_same_on_every_rank({
        "the heads (the trainable parameters the losses reach besides the shared ones): shapes and dtypes":
            [(tuple(head.shape), str(head.dtype)) for head in heads],
    }, device=device)


def agree_on_losses(losses: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
    """The losses' per-task finite flags agreed on by every rank, in one collective that also carries B:
    ``(flags, rows)``, ``rows`` = [the most rows of a rank, minus the fewest], on the device.

    The global statistics are means of the ranks' means, which is the global batch's only for equal
    shards: eager steps check :func:`equal_shards` with their other guards (every rank sees the same
    values, so every rank raises :func:`unequal_shards_error`, or none).
    """
    rows = losses.shape[0]
    # [B, -B] filled on the device: a tensor built from host numbers would be a blocking host-to-device copy
    # in every step (capturable ones included)
    shard_rows = torch.full((2,), rows, dtype=torch.int64, device=finite.device)
    shard_rows[1:].neg_()
    flags = torch.cat([(~finite).to(torch.int64), shard_rows])
    flags = distributed.all_reduce_max(flags)
    return flags[:-2] == 0, flags[-2:]


def equal_shards(rows: Tensor) -> Tensor:
    """[1] bool: every rank's losses have as many rows (``rows`` from :func:`agree_on_losses`)."""
    return (rows[0] == -rows[1]).reshape(1)


def unequal_shards_error(rows: Tensor) -> ValueError:
    """The error of unequal shards, naming the fewest and the most rows (a host read: on failure only)."""
    most, negative_fewest = rows.tolist()
    return ValueError(distributed.unequal_shards_message(-negative_fewest, most))
