"""CR-1 (issue 18): a copied optimizer or Balancer keeps stepping exactly like the original.

``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load`` used to give an optimizer whose
``step()`` raised ``AttributeError: '_head_grads_before'``: torch's own pickling keeps only
``defaults``, ``state`` and ``param_groups``, and drmoo's methods keep per-step bookkeeping in
attributes beside them.  Every registered method (and MGDA with its exact min-norm solver, another
code path; no case is left out) is copied after two steps, through the method's own ``step`` and
through the Balancer, together with its model, and both go on for two more steps on the same
batches: parameters and drmoo state must agree bit for bit.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import available, create

TASKS = 2
LR = 0.05
# Values that make each method's own state move within two steps (w, clips, MoCo's tracking,
# FAMO's logits, Nash-MTL's reuse), so a copy that lost any of it would diverge.
MOVING: dict[str, dict[str, Any]] = {
    "double-clip": {"pref_lr": 0.3, "c2": 0.05, "f2": 0.05},
    "double-loop": {"pref_lr": 0.3, "dual_lr": 0.2, "inner_steps": 2, "seed": 3},
    "mgda": {"pref_lr": 0.3},
    "mgda[min_norm]": {"solver": "min_norm"},
    "modo": {"pref_lr": 0.3},
    "moco": {"pref_lr": 0.3, "ema": 0.6},
    "sdmgrad": {"pref_lr": 0.3},
    "nashmtl": {"solver_iters": 10, "update_every": 2},
    "famo": {"pref_lr": 0.2},
}


def test_every_registered_method_is_copied() -> None:
    assert {case.split("[")[0] for case in MOVING} == set(available())


def model_of(seed: int = 0) -> nn.ModuleDict:
    """Built from torch's own modules only, so that pickle needs nothing from this test file."""
    torch.manual_seed(seed)
    return nn.ModuleDict({"trunk": nn.Sequential(nn.Linear(3, 6), nn.Tanh()),
                          "heads": nn.Linear(6, TASKS)}).double()


def batches(seed: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        x = torch.randn(12, 3, generator=generator, dtype=torch.float64)
        out.append((x, torch.stack([x[:, 0] + x[:, 1], -x[:, 0] + 0.3 * x[:, 2]], dim=1)))
    return out


def losses(model: nn.ModuleDict, x: Tensor, y: Tensor) -> Tensor:
    return (model["heads"](model["trunk"](x)) - y) ** 2  # [B, TASKS] per sample and task


def advance(model: nn.ModuleDict, optimizer: Any, api: str, seed: int) -> None:
    """Two steps: the method's own step(closure) (heads by SGD), or SGD on the Balancer's .grad."""
    sgd = torch.optim.SGD(model.parameters() if api == "balancer" else model["heads"].parameters(), lr=LR)
    for x, y in batches(seed):
        sgd.zero_grad()
        if api == "balancer":
            optimizer.backward(losses(model, x, y))
        else:
            optimizer.step(lambda x=x, y=y: losses(model, x, y))
        sgd.step()


def copied(pair: tuple[nn.ModuleDict, Any], how: str, tmp_path: Path) -> tuple[nn.ModuleDict, Any]:
    if how == "deepcopy":
        return copy.deepcopy(pair)
    if how == "pickle":
        return pickle.loads(pickle.dumps(pair))
    torch.save(pair, tmp_path / "pair.pt")
    # weights_only=False unpickles objects: acceptable only for the file this test wrote just above
    return torch.load(tmp_path / "pair.pt", weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("api", ["step", "balancer"])
@pytest.mark.parametrize("case", list(MOVING))
def test_cr1_a_copied_optimizer_keeps_stepping_identically(case: str, api: str, how: str, tmp_path: Path) -> None:
    method = case.split("[")[0]
    model = model_of()
    if api == "balancer":
        optimizer: Any = drmoo.Balancer(method, model["trunk"].parameters(), TASKS, lr=LR, **MOVING[case])
    else:
        optimizer = create(method, model["trunk"].parameters(), TASKS, lr=LR, **MOVING[case])
    advance(model, optimizer, api, seed=1)
    twin_model, twin = copied((model, optimizer), how, tmp_path)
    assert all(a is not b for a, b in zip(twin_model.parameters(), model.parameters()))  # a copy, not an alias
    advance(model, optimizer, api, seed=2)
    advance(twin_model, twin, api, seed=2)
    for (name, mine), theirs in zip(model.named_parameters(), twin_model.parameters()):
        assert torch.equal(mine, theirs), name
    original, copy_state = optimizer.state_dict()["state"]["drmoo"], twin.state_dict()["state"]["drmoo"]
    assert set(original) == set(copy_state)
    for key, value in original.items():
        same = torch.equal(value, copy_state[key]) if isinstance(value, Tensor) else value == copy_state[key]
        assert same, key
    assert int(original["step"]) == 4
