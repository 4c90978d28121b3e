"""Cross-rank agreement under torch.distributed: every rank abandons a step, or none.

A rank that raised alone (a NaN in its shard) would leave the others waiting forever in the step's
next collective, so the finite flags are agreed on before any rank acts on them; and ranks that run
different problems (another m, B or parameter shapes) would reach collectives of different sizes (a
gloo abort or a hang), so that is checked once, with one fixed-size collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from drmoo import distributed


def all_ranks_finite(finite: Tensor) -> Tensor:
    """``finite`` (bool flags of this rank) reduced to one flag [1]: True when every rank's are all True."""
    return distributed.all_reduce_max((~finite.all()).to(torch.int32).reshape(1)) == 0


def check_same_problem(losses: Tensor, shared: Sequence[Tensor], num_tasks: int) -> None:
    """Raise ValueError on every rank unless all run m tasks on B rows with the same shared parameters."""
    distributed.check_same_on_every_rank({
        "the number of tasks m": num_tasks,
        "the number of rows B of the losses (the shard size)": losses.shape[0],
        "the number of shared parameters": len(shared),
        "the shared parameters' shapes and dtype": distributed.fingerprint(
            [(tuple(p.shape), str(p.dtype)) for p in shared]),
    }, device=losses.device)


def agree_on_losses(losses: Tensor, finite: Tensor, *, read_rows: bool) -> Tensor:
    """The losses' per-task finite flags agreed on by every rank, in one collective that also carries B.

    The global statistics are means of the ranks' means, which is the global batch's only for equal
    shards: with ``read_rows`` (eager steps, which read the flags right after anyway) unequal shard
    sizes raise ValueError on every rank.
    """
    rows = losses.shape[0]
    flags = torch.cat([(~finite).to(torch.int64),
                       torch.tensor([rows, -rows], dtype=torch.int64, device=finite.device)])
    flags = distributed.all_reduce_max(flags)
    if read_rows:  # (a host read)
        most, fewest = flags[-2:].tolist()
        if most != -fewest:
            raise ValueError(distributed.unequal_shards_message(-fewest, most))
    return flags[:-2] == 0
