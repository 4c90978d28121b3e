"""Issue 37, CR-19 and U-15's cross-rank message: ranks that build different optimizers raise a readable
ValueError on every rank (self-contained: its ranks load this file by path, without the test package)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import drmoo

# ------------------------------------------------------------------------------- CR-19, U-15 (ranks)
# What rank 1 builds differently from rank 0, and what every rank's ValueError must say.
RANK_SETTINGS = {
    "jacobian": ({"jacobian": "features"}, {"jacobian": "parameters"},
                 ("the Jacobian mode", "'features' on rank 0", "'parameters' on rank 1")),
    "method": ({"method": "mgda"}, {"method": "double-clip"}, ("the method", "'MGDA' on rank 0")),
    "hyperparameter": ({"lam": 0.8}, {"lam": 0.5}, ("lam", "0.8 on rank 0", "0.5 on rank 1")),
}


def _mismatched_rank(rank: int, world: int, init_file: str, case: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        settings = {"method": "mgda", "jacobian": "features", **RANK_SETTINGS[case][rank]}
        method, jacobian = settings.pop("method"), settings.pop("jacobian")
        torch.manual_seed(0)
        trunk, heads = torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)
        z = trunk(torch.randn(8, 4))
        losses = (heads(z) - 1.0) ** 2
        balancer = drmoo.Balancer(method, trunk.parameters(), 2, jacobian=jacobian, lr=0.1, **settings)
        raised = ""
        try:
            balancer.backward(losses, **({"features": z} if jacobian == "features" else {}))
        except ValueError as error:
            raised = str(error)
        (Path(out_dir) / f"rank{rank}.txt").write_text(raised)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", list(RANK_SETTINGS))
def test_cr19_ranks_that_differ_in_mode_method_or_settings_raise_a_readable_value_error(
        case: str, tmp_path: Path, run_ranks: Callable[..., None]) -> None:
    """Ranks in different Jacobian modes (or methods) died: rank 0 SIGABRT, rank 1 'Connection reset by peer'.
    The once-per-optimizer cross-rank check now covers the method, the mode and every hyperparameter, before
    any collective that depends on them, and says which differs with each rank's value (it printed opaque
    fingerprints, 'from 605595398 to 1662919193')."""
    run_ranks(_mismatched_rank, 2, str(tmp_path / "init"), case, str(tmp_path))
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        for fragment in RANK_SETTINGS[case][2]:
            assert fragment in message, f"rank {rank}: {message!r}"
