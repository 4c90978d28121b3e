"""Issue 29: the Balancer's defects with a GradScaler (CR-11, SW-18), across ranks (CR-16, SW-15)
and in its messages (U-11).

* CR-11: with the heads in a second torch optimizer (torch's multi-optimizer AMP loop) an overflow
  put the Inf marker in one shared parameter only; the heads' optimizer had no gradient at all and
  ``scaler.step`` failed with "No inf checks were recorded for this optimizer".
* SW-18: an overflow in the heads' scaled gradients only: the balancer advanced eta, w and its step
  count while the scaler skipped the step.
* CR-16: ranks with different shared sets or m reached collectives of different sizes (a gloo
  abort or a hang); SW-15: unequal shards were averaged silently.  Both are refused on every rank.
* U-11: messages named a closure when the losses were given, and misnamed meta-device problems.

The GradScaler runs on the CPU in float32: an initial scale of 2**126 makes the scaled backward
overflow float32 the way fp16 overflows under autocast on a GPU (the same code path: a non-finite
Jacobian or head gradient).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import drmoo
from drmoo import distributed

M = 2
HUGE_SCALE = 2.0**126


class TwoTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(M)])

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def batch(rows: int = 8, seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=generator)
    return x, torch.stack([x[:, 0], x[:, 1] - x[:, 2]], dim=1)


def parameters_of(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------- CR-11
@pytest.mark.parametrize("form", ["losses", "closure"])
def test_an_overflow_reaches_the_scaler_of_a_second_optimizer_holding_the_heads(form: str) -> None:
    """torch's multi-optimizer AMP loop: scaler.step(trunk_opt); scaler.step(heads_opt); scaler.update().
    Guards CR-11: the heads' optimizer must see the overflow too (an Inf in its parameters' .grad)."""
    model = TwoTaskNet()
    trunk_optimizer = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    heads_optimizer = torch.optim.SGD(model.heads.parameters(), lr=0.1)
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), M, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=HUGE_SCALE)
    before = parameters_of(model)
    x, y = batch()
    trunk_optimizer.zero_grad()
    heads_optimizer.zero_grad()
    def draw() -> Tensor:
        return 1e6 * (model(x) - y) ** 2  # large enough for the scaled trunk gradients to overflow too

    balancer.backward(draw() if form == "losses" else draw, scaler=scaler)
    scaler.step(trunk_optimizer)
    scaler.step(heads_optimizer)  # raised AssertionError: No inf checks were recorded for this optimizer
    scaler.update()
    assert scaler.get_scale() < HUGE_SCALE
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a skipped step moved a parameter"
    assert balancer.steps_taken == 0 and float(balancer.stats["found_inf"]) == 1.0


# ------------------------------------------------------------------------------------- SW-18
def overflow_in_the_heads_only(model: TwoTaskNet) -> None:
    """An Inf in the heads' gradients alone (the shared parameters' Jacobian stays finite), as an
    fp16 overflow confined to the heads' scaled gradients gives."""
    model.heads[1].weight.register_hook(lambda grad: grad * float("inf"))


def test_an_overflow_in_the_heads_only_skips_the_balancers_step_with_the_scalers() -> None:
    """Guards SW-18: the scaler skips the step (an Inf in a head's .grad); the balancer must skip it too."""
    model = TwoTaskNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    overflow_in_the_heads_only(model)
    before = parameters_of(model)
    x, y = batch()
    balancer.backward((model(x) - y) ** 2, scaler=scaler)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() < 2.0**4  # the scaler saw the overflow and skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert balancer.steps_taken == 0, "the balancer counted a step the scaler skipped"
    assert bool((balancer.eta == 0).all()) and bool((balancer.w == 1.0 / M).all())


def test_a_non_finite_head_gradient_without_a_scaler_is_refused_and_changes_nothing() -> None:
    model = TwoTaskNet()
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), M, lr=0.1)
    overflow_in_the_heads_only(model)
    x, y = batch()
    with pytest.raises(drmoo.optim.NonFiniteStepError, match="the heads"):
        balancer.backward((model(x) - y) ** 2)
    assert balancer.steps_taken == 0 and all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- CR-16, SW-15
# Each case: what rank 1 does differently from rank 0.
RANK_CASES = {
    "different shared sets": "the number of shared parameters",
    "different m": "the number of tasks m",
    "unequal shards": "the number of rows B of the losses (the shard size) (2 on rank 0, 6 on rank 1",
    "unequal shards later": "unequal shards",
}


def _rank_program(case: str) -> dict[str, Any]:
    second = distributed.rank() == 1
    model = TwoTaskNet()
    if case == "different shared sets" and second:
        shared = list(model.trunk[0].parameters())[:1]  # the weight only
    else:
        shared = list(model.trunk.parameters())
    tasks = 3 if case == "different m" and second else M
    balancer = drmoo.Balancer("mgda", shared, tasks, lr=0.1)
    outcome: dict[str, Any] = {"raised": ""}
    rows = {"unequal shards": 6 if second else 2}.get(case, 4)
    try:
        for step in range(2):
            if case == "unequal shards later" and step == 1:
                rows = 6 if second else 2  # a last, uneven batch of an epoch
            x, y = batch(rows, seed=10 + distributed.rank())
            out = model(x)
            losses = (torch.cat([out, out[:, :1]], dim=1) if tasks == 3 else out) - (
                torch.cat([y, y[:, :1]], dim=1) if tasks == 3 else y)
            balancer.backward(losses**2)
    except ValueError as error:
        outcome["raised"] = str(error)
    outcome["steps_taken"] = balancer.steps_taken
    return outcome


def _rank_worker(rank: int, world: int, init_file: str, case: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A short timeout: a mismatched collective that hangs fails the test in seconds, not minutes.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        torch.save(_rank_program(case), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", list(RANK_CASES))
def test_ranks_that_disagree_on_the_problem_or_the_shard_size_are_refused_on_every_rank(
        tmp_path: Path, case: str, run_ranks: Callable[..., None]) -> None:
    """Guards CR-16 (a gloo abort, or a hang, for different shared sets or m) and SW-15 (unequal
    shards averaged into a wrong .grad): every rank raises a ValueError naming the difference."""
    run_ranks(_rank_worker, 2, str(tmp_path / "init"), case, str(tmp_path))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert RANK_CASES[case] in result["raised"], f"rank {rank}: {result['raised']!r}"
        assert result["steps_taken"] == (1 if case == "unequal shards later" else 0)


# ------------------------------------------------------------------------------------- U-11
def test_messages_name_the_balancers_losses_not_a_closure() -> None:
    """Guards U-11: losses given to backward were reported as what "the closure returned"."""
    model = TwoTaskNet()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=0.1)
    x, y = batch()
    bad_weights = -torch.ones(8, M)
    with pytest.raises(ValueError) as error:
        balancer.backward(((model(x) - y) ** 2, bad_weights))
    assert "closure" not in str(error.value) and "Balancer.backward was given sample weights" in str(error.value)
    with pytest.raises(ValueError) as error:
        balancer.backward((model(x) - y)[:0] ** 2)
    assert "closure" not in str(error.value)


def test_meta_device_problems_are_named() -> None:
    """Guards U-11: losses on the meta device were reported as "not depending on the shared
    parameters", and meta parameters failed later with "Tensor.item() cannot be called on meta tensors"."""
    model = TwoTaskNet()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=0.1)
    meta_model = TwoTaskNet().to("meta")
    with pytest.raises(ValueError, match="losses are on meta, but the balancer's shared parameters are on cpu"):
        balancer.backward(meta_model(torch.ones(8, 4, device="meta")) ** 2)
    with pytest.raises(ValueError, match="on the meta device"):
        drmoo.Balancer("mgda", meta_model.trunk.parameters(), M, lr=0.1)
