"""Train a small two-task model with ``drmoo.Balancer`` + ``torch.optim.Adam``.

The balancer turns the per-sample losses into the DR dual objectives, runs the chosen method
(Double-Clip MGDA here) and writes its balanced direction into the shared trunk's ``.grad`` and
each head's DR gradient into the head's ``.grad``; Adam -- or any torch optimizer, with any
parameter groups, schedulers or gradient clipping -- then takes the step.

    python examples/balancer_adam.py [--steps 300] [--method double-clip]
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

import drmoo

NUM_TASKS = 2


class TwoTaskNet(nn.Module):
    """A shared MLP trunk and one linear head per task; forward gives the [B, 2] predictions."""

    def __init__(self, features: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(hidden, 1) for _ in range(NUM_TASKS)])

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def make_data(samples: int = 1024, features: int = 8, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A two-task regression whose tasks pull the trunk apart (opposite use of the first input)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    y = torch.stack([torch.sin(2 * x[:, 0]) + x[:, 1], -torch.sin(2 * x[:, 0]) + x[:, 2] ** 2], dim=1)
    return x, y + 0.1 * torch.randn(samples, NUM_TASKS, generator=generator)


def per_sample_losses(predictions: Tensor, targets: Tensor) -> Tensor:
    """[B, 2]: one column per task, NOT averaged over the batch (the DR dual reweighs the samples)."""
    return (predictions - targets) ** 2


def main(steps: int = 300, method: str = "double-clip", batch_size: int = 64, seed: int = 0) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    x_all, y_all = make_data(seed=seed)
    model = TwoTaskNet(features=x_all.shape[1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # optimizer=: the dual variables eta step with Adam's (scheduled) learning rate too.
    balancer = drmoo.Balancer(method, model.trunk.parameters(), num_tasks=NUM_TASKS, lam=0.8, optimizer=optimizer)

    with torch.no_grad():
        before = per_sample_losses(model(x_all), y_all).mean(dim=0)
    for _ in range(steps):
        rows = torch.randint(0, x_all.shape[0], (batch_size,))
        optimizer.zero_grad()
        losses = per_sample_losses(model(x_all[rows]), y_all[rows])  # [B, 2]
        balancer.backward(losses)  # trunk .grad: the balanced direction; heads: their task's DR gradient
        optimizer.step()
    with torch.no_grad():
        after = per_sample_losses(model(x_all), y_all).mean(dim=0)

    print(f"{method} + Adam, {steps} steps: per-task mean loss {before.tolist()} -> {after.tolist()}")
    print(f"preference w = {balancer.w.tolist()}, dual variables eta = {balancer.eta.tolist()}")
    return {"before": before.tolist(), "after": after.tolist(), "w": balancer.w.tolist()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    parser.add_argument("--method", default="double-clip", choices=sorted(drmoo.optim.available()),
                        help="the drmoo method (default: double-clip)")
    arguments = parser.parse_args()
    main(steps=arguments.steps, method=arguments.method)
