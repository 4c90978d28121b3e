"""Ranks whose heads differ (a layer more above z on rank 1) raise a readable ValueError on every rank.

The heads' gradients are summed over ranks in one collective per step; entered with different sizes it
aborted gloo (SIGABRT).  The once-per-optimizer cross-rank check now covers the heads' shapes, before any
collective that depends on them.  (Self-contained: its ranks load this file by path.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import drmoo


def _rank_with_its_own_heads(rank: int, world: int, init_file: str, jacobian: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        torch.manual_seed(0)
        trunk = torch.nn.Linear(4, 5)
        layers: list[torch.nn.Module] = [torch.nn.Linear(5, 5), torch.nn.Tanh()] if rank == 1 else []
        heads = torch.nn.Sequential(*layers, torch.nn.Linear(5, 2))  # rank 1: one layer more above z
        z = trunk(torch.randn(8, 4))
        losses = (heads(z) - 1.0) ** 2
        balancer = drmoo.Balancer("mgda", trunk.parameters(), 2, jacobian=jacobian, lr=0.1)
        raised = ""
        try:
            balancer.backward(losses, **({"features": z} if jacobian == "features" else {}))
        except ValueError as error:
            raised = str(error)
        (Path(out_dir) / f"rank{rank}.txt").write_text(raised)
    finally:
        dist.destroy_process_group()


def test_ranks_whose_heads_differ_raise_a_readable_value_error(tmp_path: Path,
                                                               run_ranks: Callable[..., None]) -> None:
    """Features mode (the reported case); parameters mode goes through the same check (the heads are then every
    trainable leaf but the shared parameters)."""
    run_ranks(_rank_with_its_own_heads, 2, str(tmp_path / "init"), "features", str(tmp_path))
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "disagree on the heads" in message, f"rank {rank}: {message!r}"
        assert "((5, 5), 'torch.float32')" in message and "on rank 1" in message, f"rank {rank}: {message!r}"
