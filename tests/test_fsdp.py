"""FSDP2-sharded trunks: features mode's Balancer on 2 gloo ranks equals one process on the global batch; what
cannot run (parameters mode, step(closure)) is refused with one line that names FSDP and the alternative, not
with a message that blames the user's losses (a gloo group of one: fully_shard needs a group)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import drmoo
from drmoo import distributed
from drmoo.optim import create


def two_task_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"trunk": nn.Sequential(nn.Linear(4, 8), nn.Tanh()), "heads": nn.Linear(8, 2)})


@pytest.mark.usefixtures("group_of_one")
def test_sharded_shared_parameters_in_parameters_mode_are_refused_when_built_but_for_the_gram_methods() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    expected = r"cannot run in parameters mode on FSDP-sharded.*jacobian='features'.*MGDA, MoDo, SDMGrad.*DataParallel"
    for method in ("double-clip", "famo", "nashmtl", "moco"):
        with pytest.raises(ValueError, match=expected):
            create(method, net["trunk"].parameters(), 2)
    drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1)  # parameters mode: accepted


@pytest.mark.usefixtures("group_of_one")
def test_a_step_closure_optimizer_on_sharded_parameters_is_refused_at_its_step() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    optimizer = create("mgda", net["trunk"].parameters(), 2, jacobian="features")
    x = torch.randn(6, 4)

    def closure() -> tuple[torch.Tensor, torch.Tensor]:
        z = net["trunk"](x)
        return (net["heads"](z) - 1.0) ** 2, z

    with pytest.raises(ValueError, match=r"step\(closure\) writes theta itself and cannot run on FSDP-sharded"):
        optimizer.step(closure)


@pytest.mark.usefixtures("group_of_one")
def test_sharding_after_the_balancer_was_built_is_named_in_the_message() -> None:
    net = two_task_net()
    balancer = drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1)
    fully_shard(net["trunk"])  # replaces the parameters the balancer holds
    losses = (net["heads"](net["trunk"](torch.randn(6, 4))) - 1.0) ** 2
    with pytest.raises(ValueError, match=r"wrapped by FSDP or fully_shard after the balancer was built"):
        balancer.backward(losses)


@pytest.mark.usefixtures("group_of_one")
def test_accumulating_micro_batches_in_features_mode_on_sharded_parameters_is_refused() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    balancer = drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1, jacobian="features")
    z = net["trunk"](torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"cannot accumulate micro-batches on FSDP-sharded.*one backward"):
        balancer.backward((net["heads"](z) - 1.0) ** 2, features=z, accumulate=True)
    assert balancer.steps_taken == 0 and all(p.grad is None for p in net.parameters())


# ------------------------------------------------------------------------------ 2 ranks vs 1 process
STEPS, GLOBAL_BATCH = 3, 16
CASES = {"mgda": {"pref_lr": 0.3}, "double-clip": {"pref_lr": 0.3, "c2": 0.05, "features_rate_chosen": True}}


# Parameters mode: the methods it runs on sharded parameters (each Gram a sum of the shards' local Grams).
PARAMETER_CASES = {"mgda": {"pref_lr": 0.3}, "modo": {"pref_lr": 0.3}, "sdmgrad": {"pref_lr": 0.3}}


def train_features_mode(method: str, shard: bool, jacobian: str = "features") -> dict[str, Any]:
    """STEPS steps of SGD with the balancer (features mode unless ``jacobian``); under a process group each rank
    passes its shard of every global batch (every W-th row), and with ``shard`` the trunk is wrapped by
    fully_shard (heads not)."""
    features = jacobian == "features"
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh()).double()
    heads = nn.ModuleList([nn.Linear(6, 1) for _ in range(2)]).double()
    if shard:
        fully_shard(trunk)
    optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    balancer = drmoo.Balancer(method, trunk.parameters(), 2, jacobian=jacobian,  # type: ignore[call-overload]
                              optimizer=optimizer, **(CASES if features else PARAMETER_CASES)[method])
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 4, generator=generator, dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)
        rows = distributed.shard(torch.arange(GLOBAL_BATCH))
        optimizer.zero_grad()
        z = trunk(x[rows])
        losses = (torch.cat([head(z) for head in heads], dim=1) - y[rows]) ** 2
        balancer.backward(losses, features=z if features else None)
        optimizer.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in [*trunk.parameters(), *heads.parameters()]]
    return {"params": [p.detach().clone() for p in params], "eta": balancer.eta.clone(), "w": balancer.w.clone(),
            "steps": balancer.steps_taken}


def _fsdp_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        runs = {method: train_features_mode(method, shard=True) for method in CASES}
        runs |= {f"parameters {method}": train_features_mode(method, True, "parameters") for method in PARAMETER_CASES}
        torch.save(runs, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_a_fully_sharded_trunk_equal_one_process_on_the_global_batch(
        tmp_path: Path, run_ranks: Callable[..., None]) -> None:
    run_ranks(_fsdp_rank, 2, str(tmp_path / "init"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in (0, 1)]
    singles = {method: train_features_mode(method, shard=False) for method in CASES}
    singles |= {f"parameters {method}": train_features_mode(method, False, "parameters") for method in PARAMETER_CASES}
    for method, single in singles.items():
        for result in ranks:
            assert result[method]["steps"] == STEPS
            for a, b in zip(result[method]["params"], single["params"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=method)
            for key in ("eta", "w"):
                torch.testing.assert_close(result[method][key], single[key], rtol=1e-6, atol=1e-6,
                                           msg=f"{method} {key}")
        torch.manual_seed(0)
        initial = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh()).double()
        assert all(not torch.equal(a, b) for a, b in zip(single["params"], initial.parameters()))  # the trunk moved
