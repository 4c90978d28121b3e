"""Misuse that mypy --strict and pyright must reject (tests/typing): each line whose comment starts
with "rejected" must give an error, and no other line may."""

from __future__ import annotations

from torch import nn

import drmoo

trunk = nn.Linear(4, 8)

drmoo.Balancer("dubble-clip", trunk.parameters(), 2, lr=1e-3)  # rejected: a misspelt method
drmoo.Balancer("double-clip", trunk.parameters(), 2, lam="0.8", lr=1e-3)  # rejected: lam is a float
drmoo.Balancer("double-clip", trunk.parameters(), 2, lamb=0.8, lr=1e-3)  # rejected: no such hyperparameter
drmoo.Balancer("mgda", trunk.parameters(), 2, c2=0.5, lr=1e-3)  # rejected: Double-Clip's, not MGDA's
drmoo.Balancer("mgda", trunk.parameters(), 2, solver="minnorm", lr=1e-3)  # rejected: not a solver
drmoo.Balancer("mgda", trunk.parameters(), 2, jacobian="feature", lr=1e-3)  # rejected: not a Jacobian mode
drmoo.Balancer("mgda", trunk.parameters(), "2", lr=1e-3)  # rejected: num_tasks is an int
drmoo.Balancer("mgda", trunk.parameters(), 2, jacobian="features", check_trunk_gradients="no")  # rejected: a bool


def from_config(name: str) -> None:
    """A method's name read from a config file is a str (a local would be narrowed to its literal)."""
    drmoo.Balancer(name, trunk.parameters(), 2, lr=1e-3)  # rejected: a str is no MethodName (method_name)


drmoo.Balancer("famo", trunk.parameters(), 2, lr=1e-3, features_rate_chosen=True)  # rejected: FAMO's rate carries over
