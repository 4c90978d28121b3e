"""Data parallelism: 2 gloo processes equal 1 process on the concatenated batches; torchrun end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from drmoo import distributed
from drmoo.optim import available, create

STEPS = 4
GLOBAL_BATCH = 24
# Float64 everywhere: the only difference between the runs is the order of the sums
# (two half-batch sums + an all-reduce vs one sum), so the tolerance is a few ulps times the steps.
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}


def _run(method: str) -> dict[str, torch.Tensor]:
    """Train a small 3-task model for STEPS steps; under a process group each rank sees its shard."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(200, 5, generator=gen, dtype=torch.float64), torch.randn(200, 3, generator=gen,
                                                                                           dtype=torch.float64)
    trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh()).double()
    heads = nn.Linear(4, 3).double()
    optimizer = create(method, list(trunk.parameters()), 3, lr=0.05, backend="reference")
    head_optimizer = torch.optim.SGD(heads.parameters(), lr=0.01)
    batches = torch.Generator().manual_seed(2)
    last: list[torch.Tensor] = []

    def closure(same_batch: bool = False) -> torch.Tensor:
        if not same_batch:  # every rank draws the same global batch and keeps its shard
            last[:] = [distributed.shard(torch.randint(0, 200, (GLOBAL_BATCH,), generator=batches))]
        rows = last[0]
        return (heads(trunk(inputs[rows])) - targets[rows]) ** 2

    for _ in range(STEPS):
        head_optimizer.zero_grad()
        optimizer.step(closure)
        distributed.all_reduce_grads(heads.parameters())
        head_optimizer.step()
    state = {f"trunk.{k}": v for k, v in trunk.state_dict().items()}
    state.update({f"heads.{k}": v for k, v in heads.state_dict().items()})
    return {**state, "w": optimizer.w.clone(), "eta": optimizer.eta.clone()}


def _worker(rank: int, world: int, init_file: str, method: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = _run(method)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", sorted(available()))
def test_two_gloo_processes_equal_one_process_on_the_whole_batch(tmp_path: Path, method: str,
                                                                run_ranks: Callable[..., None]) -> None:
    single = _run(method)
    out = tmp_path / "rank0.pt"
    run_ranks(_worker, 2, str(tmp_path / "init"), method, str(out))
    parallel = torch.load(out)
    assert single.keys() == parallel.keys()
    for key in single:
        torch.testing.assert_close(parallel[key], single[key], **TOLERANCE, msg=f"{method}: {key}")
    initial = _initial_trunk()
    assert any(not torch.equal(single[key], initial[key]) for key in initial), "the shared parameters should move"


def _initial_trunk() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh()).double()
    return {f"trunk.{k}": v for k, v in trunk.state_dict().items()}


def test_shard_takes_every_world_size_th_row(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch.equal(distributed.shard(torch.arange(5)), torch.arange(5))  # one process: everything
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.shard(torch.arange(6)).tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="divisible by the number of processes 2"):
        distributed.shard(torch.arange(5))


def test_torchrun_end_to_end(tmp_path: Path) -> None:
    """drmoo train --nproc 2 relaunches itself under torchrun (gloo) and writes one run directory."""
    run = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "drmoo", "train", "--nproc", "2", "--method", "double-clip", "--max-steps", "2",
               "--input-size", "16", "--train-size", "48", "--test-size", "16", "--batch-size", "16", "--quiet",
               "--cache-dir", str(tmp_path / "cache"), "--out", str(run)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "done").is_file() and (run / "checkpoint.pt").is_file()
    steps = (run / "steps.csv").read_text().strip().splitlines()
    assert len(steps) == 3  # header + 2 steps, written once (rank 0 only)
    assert result.stdout.count("run saved in") == 1
