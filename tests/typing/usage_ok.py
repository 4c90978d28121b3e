"""Typed use of drmoo's public API that mypy --strict and pyright must accept (tests/typing)."""

from __future__ import annotations

import torch
from torch import nn

import drmoo
from drmoo.optim import available, create

trunk = nn.Linear(4, 8)
heads = nn.Linear(8, 2)
optimizer = torch.optim.Adam([*trunk.parameters(), *heads.parameters()], lr=1e-3)

coupled = drmoo.Balancer("double-clip", trunk.parameters(), 2, lam=0.8, c2=0.5, resample=False, optimizer=optimizer)
fixed = drmoo.Balancer("mgda", trunk.parameters(), num_tasks=2, lr=1e-3, solver="min_norm", max_iter=100)
drmoo.Balancer("double-loop", trunk.parameters(), 2, dual_lr=1e-3, inner_steps=3, seed=0, lr=1e-3)
drmoo.Balancer("modo", trunk.parameters(), 2, lr=1e-3, divergence="kl")
drmoo.Balancer("moco", trunk.parameters(), 2, lr=1e-3, ema=0.9)
drmoo.Balancer("sdmgrad", trunk.parameters(), 2, lr=1e-3, sdm_lambda=0.3, normalize=False)
drmoo.Balancer("nashmtl", trunk.parameters(), 2, lr=1e-3, update_every=2, max_norm=1.0)
drmoo.Balancer("famo", trunk.parameters(), 2, lr=1e-3, loss_floor=(0.0, 0.1), backend=None)
drmoo.Balancer("mgda", [{"params": list(trunk.parameters())}], 2, lr=1, allow_partial_shared=True,
               jacobian="parameters", capturable=False)
drmoo.Balancer("famo", trunk.parameters(), 2, lr=1e-3, jacobian="features", check_trunk_gradients=False)

# A method's name held in a str (a config file's): checked and typed by drmoo.method_name.
name_from_config: str = "nashmtl"
typed_name: drmoo.MethodName = drmoo.method_name(name_from_config)
drmoo.Balancer(drmoo.method_name(name_from_config), trunk.parameters(), 2, lam=0.8, optimizer=optimizer)
drmoo.Balancer("double-clip", trunk.parameters(), 2, jacobian="features", lr=0.1, features_rate_chosen=True)
shared: drmoo.SharedParams = trunk.parameters()
drmoo.Balancer(typed_name, shared, 2, lr=1e-3)

x, y = torch.randn(16, 4), torch.randn(16, 2)
losses: torch.Tensor = (heads(trunk(x)) - y) ** 2
given: drmoo.LossesInput = losses
objectives: torch.Tensor = coupled.backward(given)
weights: torch.Tensor = coupled.w
eta: torch.Tensor = fixed.eta
steps: int = fixed.steps_taken
state = fixed.state_dict()
fixed.load_state_dict(state)
names: list[str] = list(available())
stepper = create("mgda", trunk.parameters(), 2, lr=1e-3)


def closure() -> tuple[torch.Tensor, torch.Tensor]:
    """The closure protocol's weighted form: (per-sample losses, sample_weight)."""
    batch_losses: torch.Tensor = (heads(trunk(x)) - y) ** 2
    return batch_losses, torch.ones_like(batch_losses)


stepped: torch.Tensor = stepper.step(closure)  # a step optimizer's step, not torch.optim.Optimizer's
