"""``jacobian="features"`` under torch.distributed (2 gloo processes) and with a compiled trunk.

DDP.  Each rank holds the features z of its own shard, so its rows J_z cover only its samples' columns:
the global batch's J_z is their concatenation, its Gram the sum of the ranks' Grams.  Only m x m
products (Grams, cross products, squared norms), the dual statistics and the one n-sized lifted
direction (as DDP's own gradient all-reduce) cross ranks -- never a Jacobian.  After every backward each
``.grad`` must be the same on both ranks (bitwise) and equal to one process on the concatenated batch
up to the order of the float64 sums (the tolerance of tests/test_distributed.py).

torch.compile.  A compiled trunk (eager heads) yields z as the output of the compiled graph; the
balancer walks the heads' graph down to it and lifts the direction through the compiled backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import drmoo
from drmoo import distributed
from drmoo.optim import available

NUM_TASKS = 3
GLOBAL_BATCH = 8
STEPS = 3
LR = 0.05
DDP_TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}
PRIOR_GRAD = 0.25
FEATURE_METHODS = sorted(name for name in available() if name != "moco")


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh()).to(dtype)
        self.heads = nn.ModuleList([nn.Linear(6, 1) for _ in range(NUM_TASKS)]).to(dtype)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = self.trunk(x)
        return torch.cat([head(z) for head in self.heads], dim=1), z


def _batches(dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2 * STEPS):
        x = torch.randn(GLOBAL_BATCH, 4, generator=generator, dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2], x[:, 3]], dim=1)
        batches.append((x.to(dtype), y.to(dtype)))
    return batches


def _train(method: str, form: str) -> dict[str, Any]:
    """STEPS features-mode balancer steps of SGD on each rank's shard (a DDP-wrapped model under a process
    group, its forward and backward inside ``no_sync()``)."""
    model = Net(torch.float64)
    forward: nn.Module = model
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if distributed.is_distributed():
        forward = DistributedDataParallel(model)
        no_sync = forward.no_sync
    seed_kw = {"seed": 0} if method == "double-loop" else {}
    balancer = drmoo.Balancer(method, model.trunk.parameters(), NUM_TASKS, jacobian="features", lr=LR, **seed_kw)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    draws = iter(_batches(torch.float64))

    def shard_losses() -> tuple[Tensor, Tensor]:
        x, y = next(draws)
        rows = distributed.shard(torch.arange(GLOBAL_BATCH))
        predictions, z = forward(x[rows])
        return (predictions - y[rows]) ** 2, z

    grads: list[list[Tensor]] = []
    for _ in range(STEPS):
        for param in model.parameters():
            param.grad = torch.full_like(param, PRIOR_GRAD)
        with no_sync():
            if form == "losses":
                losses, z = shard_losses()
                balancer.backward(losses, features=z)
            else:
                balancer.backward(shard_losses)
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "w": balancer.w.clone(), "eta": balancer.eta.clone()}


def _worker(rank: int, world: int, init_file: str, method: str, form: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_train(method, form), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # neither rank tears gloo down while the other may still be in a collective
    finally:
        dist.destroy_process_group()


DDP_CASES = [(method, "losses") for method in FEATURE_METHODS] + [("double-clip", "closure"), ("famo", "closure")]


@pytest.mark.parametrize(("method", "form"), DDP_CASES)
def test_features_mode_under_ddp_equals_one_process_on_the_whole_batch(tmp_path: Path, method: str, form: str,
                                                                       run_ranks: Callable[..., None]) -> None:
    single = _train(method, form)
    run_ranks(_worker, 2, str(tmp_path / "init"), method, form, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for step, (first, second) in enumerate(zip(ranks[0]["grads"], ranks[1]["grads"])):
        for index, (a, b) in enumerate(zip(first, second)):
            assert torch.equal(a, b), f"{method}: step {step}, parameter {index}: the ranks' .grad differ"
    for step, (mine, theirs) in enumerate(zip(ranks[0]["grads"], single["grads"])):
        for index, (a, b) in enumerate(zip(mine, theirs)):
            torch.testing.assert_close(a, b, **DDP_TOLERANCE, msg=lambda text, s=step, i=index: f"{method}: step {s}, "
                                       f"parameter {i}: {text}")
    for key in ("w", "eta"):
        torch.testing.assert_close(ranks[0][key], single[key], **DDP_TOLERANCE, msg=f"{method}: {key}")


# ------------------------------------------------------------------------------ torch.compile
COMPILE_STEPS = 3
# As tests/test_balancer_ddp_and_compile.py: inductor's other fusions and summation orders move each
# float32 gradient entry by a few ulps per step; 64 ulps per step of the O(1) magnitudes is generous.
COMPILE_TOLERANCE = {"rtol": 0.0, "atol": COMPILE_STEPS * 64 * torch.finfo(torch.float32).eps}


def test_features_mode_with_a_compiled_trunk_follows_the_eager_trajectory() -> None:
    results = []
    for compiled in (False, True):
        model = Net(torch.float32)
        trunk = torch.compile(model.trunk) if compiled else model.trunk
        balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), NUM_TASKS, jacobian="features", lr=LR)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for x, y in _batches(torch.float32)[:COMPILE_STEPS]:
            optimizer.zero_grad()
            z = trunk(x)
            losses = (torch.cat([head(z) for head in model.heads], dim=1) - y) ** 2
            balancer.backward(losses, features=z)
            optimizer.step()
        results.append(([p.detach().clone() for p in model.parameters()], balancer.w.clone(), balancer.eta.clone()))
    (eager, w_eager, eta_eager), (compiled_params, w_compiled, eta_compiled) = results
    for a, b in zip(eager, compiled_params):
        torch.testing.assert_close(a, b, **COMPILE_TOLERANCE)
    torch.testing.assert_close(w_eager, w_compiled, **COMPILE_TOLERANCE)
    torch.testing.assert_close(eta_eager, eta_compiled, **COMPILE_TOLERANCE)
