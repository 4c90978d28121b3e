"""drmoo.Balancer with a DistributedDataParallel model (2 gloo processes) and with a torch.compile'd model.

DDP.  Each rank passes its shard's per-sample losses to ``balancer.backward``; the method all-reduces
the dual statistics and the Jacobian itself (:mod:`drmoo.distributed`) and, in direction mode, sums
the heads' gradients of the step over ranks, so after every backward each ``.grad`` is the global
batch's, the same on both ranks (bitwise: both ranks run the identical computation on the
all-reduced numbers) and equal to one process on the concatenated batch up to the order of the
floating-point sums (float64, the tolerance of tests/test_distributed.py).  ``torch.autograd.grad``
fires none of DDP's hooks, so DDP itself reduces nothing: without that sum the heads of the two
ranks drift apart.  Every backward starts from nonzero ``.grad`` (PRIOR_GRAD, the same on every
rank): the earlier gradients must be added back once, after the sum, not summed with the step's.

torch.compile.  The default inductor backend (C++ on the CPU) computes the same float32 forward and
backward with other fusions and summation orders, so each step's gradients differ from eager by a
few ulps; see COMPILE_TOLERANCE.
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

NUM_TASKS = 2
GLOBAL_BATCH = 8
STEPS = 3
LR = 0.05
DDP_TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}
PRIOR_GRAD = 0.25  # every .grad before each backward (see the module docstring)


class TwoTaskNet(nn.Module):
    """A shared tanh trunk and one linear head per task; forward gives the [B, 2] predictions."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh()).to(dtype)
        self.heads = nn.ModuleList([nn.Linear(6, 1) for _ in range(NUM_TASKS)]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def _batches(dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2 * STEPS):  # enough for the closure form (two draws per Double-Clip step)
        x = torch.randn(GLOBAL_BATCH, 4, generator=generator, dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)
        batches.append((x.to(dtype), y.to(dtype)))
    return batches


# ------------------------------------------------------------------------------------------ DDP
def _train_under_ddp(method: str, form: str, wrap: bool) -> dict[str, Any]:
    """STEPS balancer steps of SGD; under a process group each rank sees its shard of every global
    batch, and with ``wrap`` the model is DDP-wrapped, its forward and ``balancer.backward`` run
    inside ``no_sync()`` (the documented use).  Returns every step's .grad and the final state."""
    model = TwoTaskNet(torch.float64)
    forward: nn.Module = model
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if wrap and distributed.is_distributed():
        forward = DistributedDataParallel(model)
        no_sync = forward.no_sync  # the balancer communicates itself; DDP's reducer must stay idle
    balancer = drmoo.Balancer(method, model.trunk.parameters(), NUM_TASKS, lr=LR)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    draws = iter(_batches(torch.float64))

    def shard_losses() -> Tensor:
        x, y = next(draws)
        rows = distributed.shard(torch.arange(GLOBAL_BATCH))  # every rank keeps every W-th sample
        return (forward(x[rows]) - y[rows]) ** 2

    grads: list[list[Tensor]] = []
    for _ in range(STEPS):
        # nonzero rather than None: the step's gradients must be added to existing ones, which are
        # the same on every rank and must not be summed over ranks
        for param in model.parameters():
            param.grad = torch.full_like(param, PRIOR_GRAD)
        with no_sync():
            balancer.backward(shard_losses() if form == "losses" else shard_losses)
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "w": balancer.w.clone(), "eta": balancer.eta.clone()}


def _ddp_worker(rank: int, world: int, init_file: str, method: str, form: str, wrap: bool, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_train_under_ddp(method, form, wrap), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# Every method with a DDP-wrapped model; the closure (multi-batch) form; a process group without
# the DDP wrapper (as `drmoo train --nproc` runs).
DDP_CASES = [(method, "losses", True) for method in sorted(available())] + [
    ("double-clip", "closure", True), ("famo", "closure", True), ("double-clip", "losses", False)]


@pytest.mark.parametrize(("method", "form", "wrap"), DDP_CASES)
def test_balancer_under_ddp_equals_one_process_on_the_whole_batch(tmp_path: Path, method: str, form: str,
                                                                  wrap: bool, run_ranks: Callable[..., None]) -> None:
    single = _train_under_ddp(method, form, wrap)
    run_ranks(_ddp_worker, 2, str(tmp_path / "init"), method, form, wrap, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for step, (first, second) in enumerate(zip(ranks[0]["grads"], ranks[1]["grads"])):
        for index, (a, b) in enumerate(zip(first, second)):
            assert torch.equal(a, b), f"{method}: step {step}, parameter {index}: the ranks' .grad differ"
    parallel = ranks[0]
    for step, (mine, theirs) in enumerate(zip(parallel["grads"], single["grads"])):
        for index, (a, b) in enumerate(zip(mine, theirs)):
            torch.testing.assert_close(a, b, **DDP_TOLERANCE, msg=lambda text, s=step, i=index: f"{method}: step {s}, "
                                       f"parameter {i}: {text}")
    for key in ("w", "eta"):
        torch.testing.assert_close(parallel[key], single[key], **DDP_TOLERANCE, msg=f"{method}: {key}")
    for a, b in zip(parallel["params"], single["params"]):
        torch.testing.assert_close(a, b, **DDP_TOLERANCE)


def _fail_then_step_under_ddp() -> dict[str, Any]:
    """A backward whose shared-parameter gradients are NaN on the last rank only (the heads, above the
    poisoned features, get finite ones first), then a good one; every .grad starts at PRIOR_GRAD."""
    model = TwoTaskNet(torch.float64)
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), NUM_TASKS, lr=LR)
    x, y = _batches(torch.float64)[0]
    rows = distributed.shard(torch.arange(GLOBAL_BATCH))
    poisoned = distributed.rank() == distributed.world_size() - 1

    def poison(_module: nn.Module, _inputs: Any, features: Tensor) -> None:
        if poisoned:
            features.register_hook(lambda grad: grad * float("nan"))

    for param in model.parameters():
        param.grad = torch.full_like(param, PRIOR_GRAD)
    hook = model.trunk.register_forward_hook(poison)
    try:
        balancer.backward((model(x[rows]) - y[rows]) ** 2)
    except drmoo.optim.NonFiniteStepError as error:
        raised = str(error)
    else:
        raised = ""
    hook.remove()
    after_failure = [p.grad.clone() for p in model.parameters()]
    state_after_failure = (balancer.steps_taken, balancer.w.clone(), balancer.eta.clone())
    balancer.backward((model(x[rows]) - y[rows]) ** 2)
    return {"raised": raised, "after_failure": after_failure, "state_after_failure": state_after_failure,
            "after_good_step": [p.grad.clone() for p in model.parameters()]}


def _failing_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_fail_then_step_under_ddp(), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_step_failing_on_one_rank_restores_every_grad_on_every_rank(tmp_path: Path,
                                                                      run_ranks: Callable[..., None]) -> None:
    """The method agrees on the failure (the summed Jacobian is NaN everywhere), every rank rolls the
    heads' fed gradients back, and the next step's collectives still pair up across ranks."""
    single = _fail_then_step_under_ddp()
    run_ranks(_failing_worker, 2, str(tmp_path / "init"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for rank, result in enumerate(ranks):
        assert "non-finite gradients of the shared parameters" in result["raised"], f"rank {rank}: {result['raised']!r}"
        for index, grad in enumerate(result["after_failure"]):
            assert bool((grad == PRIOR_GRAD).all()), f"rank {rank}, parameter {index}: .grad changed by a failed step"
        steps_taken, w, eta = result["state_after_failure"]
        assert steps_taken == 0 and bool((eta == 0).all()) and bool((w == 1.0 / NUM_TASKS).all())
    for index, (a, b, c) in enumerate(zip(ranks[0]["after_good_step"], ranks[1]["after_good_step"],
                                          single["after_good_step"])):
        assert torch.equal(a, b), f"parameter {index}: the ranks' .grad differ after the good step"
        torch.testing.assert_close(a, c, **DDP_TOLERANCE, msg=lambda text, i=index: f"parameter {i}: {text}")


# ------------------------------------------------------------------------------ torch.compile
# Eager and inductor evaluate the same float32 expressions with other fusions and summation orders
# (dot products of length <= 8, tanh's vectorised implementation): per step each gradient entry
# differs by a few ulps of the O(1) magnitudes involved; 64 ulps per step is a generous bound for
# the forward, the m backward passes and the update.  With SGD (lr < 1) those differences add up at
# most linearly over the steps; the parameters, w and eta are O(1).  A real defect (a head left
# without its gradient, a graph the balancer cannot walk) moves the trajectory by >= 1e-3.
COMPILE_STEPS = 4
COMPILE_TOLERANCE = {"rtol": 0.0, "atol": COMPILE_STEPS * 64 * torch.finfo(torch.float32).eps}


def _train_float32(model: nn.Module, forward: nn.Module) -> dict[str, Any]:
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), NUM_TASKS, lr=LR)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches(torch.float32)[:COMPILE_STEPS]:
        optimizer.zero_grad()
        balancer.backward((forward(x) - y) ** 2)
        optimizer.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "w": balancer.w.clone(),
            "eta": balancer.eta.clone()}


def test_balancer_with_a_compiled_model_follows_the_eager_trajectory() -> None:
    from torch._dynamo.utils import counters

    eager_model = TwoTaskNet(torch.float32)
    initial = [p.detach().clone() for p in eager_model.parameters()]
    eager = _train_float32(eager_model, eager_model)

    torch._dynamo.reset()
    counters.clear()
    model = TwoTaskNet(torch.float32)
    compiled = _train_float32(model, torch.compile(model))  # the default backend: inductor
    assert counters["stats"]["unique_graphs"] >= 1, "torch.compile compiled nothing: the test ran eagerly"

    for (name, _), a, b in zip(model.named_parameters(), compiled["params"], eager["params"]):
        torch.testing.assert_close(a, b, **COMPILE_TOLERANCE, msg=lambda text, name=name: f"{name}: {text}")
    for key in ("w", "eta"):
        torch.testing.assert_close(compiled[key], eager[key], **COMPILE_TOLERANCE, msg=key)
    moved = [(a - b).abs().max().item() for a, b in zip(compiled["params"], initial)]
    assert min(moved) > 1e-3, f"every parameter (trunk and heads) should move; moved {moved}"
