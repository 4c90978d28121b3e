"""FSDP-sharded shared parameters: refused with one line that names FSDP and the alternative (DDP), not with
a message that blames the user's losses.  One process, a gloo group of one (fully_shard needs a group)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import drmoo
from drmoo.optim import create


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def two_task_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"trunk": nn.Sequential(nn.Linear(4, 8), nn.Tanh()), "heads": nn.Linear(8, 2)})


@pytest.mark.usefixtures("group_of_one")
def test_sharded_shared_parameters_are_refused_when_built() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    expected = r"sharded DTensors \(FSDP2's fully_shard.*not supported; .*DistributedDataParallel"
    with pytest.raises(ValueError, match=expected):
        drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1)
    with pytest.raises(ValueError, match=expected):
        create("double-clip", net["trunk"].parameters(), 2)


@pytest.mark.usefixtures("group_of_one")
def test_sharding_after_the_balancer_was_built_is_named_in_the_message() -> None:
    net = two_task_net()
    balancer = drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1)
    fully_shard(net["trunk"])  # replaces the parameters the balancer holds
    losses = (net["heads"](net["trunk"](torch.randn(6, 4))) - 1.0) ** 2
    with pytest.raises(ValueError, match=r"wrapped by FSDP or fully_shard after the balancer was built"):
        balancer.backward(losses)
