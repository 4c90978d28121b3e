"""A DistributedDataParallel model whose forward runs outside ``no_sync()``: every method, FAMO included.

FAMO fed its heads with ``torch.autograd.backward(inputs=heads)``, which runs the heads' AccumulateGrad hooks;
DDP's reducer then waited for the trunk's gradients, which the balancer never hands it, and the model's next
forward raised DDP's "Expected to have finished reduction in the prior iteration".  The heads are now fed as
every Jacobian pass feeds them (``autograd.grad`` and an add into ``.grad``): DDP's reducer stays idle, as
inside ``no_sync()``, and the gradients are the same.  (A gloo group of one process: DDP's reducer is the
same as with more, and the test needs no second interpreter.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import drmoo


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.heads = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.trunk(x))


def _train(method: str, *, no_sync: bool) -> list[Tensor]:
    torch.manual_seed(0)
    model = Net()
    ddp_model = DistributedDataParallel(model)
    balancer = drmoo.Balancer(method, model.trunk.parameters(), 2, lr=1e-2)  # type: ignore[call-overload]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        optimizer.zero_grad()
        with ddp_model.no_sync() if no_sync else contextlib.nullcontext():
            balancer.backward((ddp_model(x) - y) ** 2)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.usefixtures("group_of_one")
@pytest.mark.parametrize("method", ["famo", "mgda"])
def test_a_ddp_model_outside_no_sync_trains_as_inside(method: str) -> None:
    outside = _train(method, no_sync=False)  # FAMO: "Expected to have finished reduction" at the 2nd forward
    inside = _train(method, no_sync=True)
    for a, b in zip(outside, inside):
        assert torch.equal(a, b)
