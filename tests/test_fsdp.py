"""FSDP2-sharded trunks: the Balancer and the step(closure) optimizers, in both Jacobian modes, on 2 gloo ranks equal
one process on the global batch, with the heads replicated or sharded too; what cannot run (MoCo in parameters
mode, accumulation, capturable steps) is refused with one line that names FSDP and the alternative, not with a
message that blames the user's losses (a gloo group of one: fully_shard needs a group)."""

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
def test_moco_alone_is_refused_in_parameters_mode_on_sharded_parameters_when_built() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    expected = r"MoCo cannot run in parameters mode on FSDP-sharded.*state_dict would depend on the sharding.*DataPar"
    with pytest.raises(ValueError, match=expected):
        create("moco", net["trunk"].parameters(), 2)
    with pytest.raises(ValueError, match=expected):
        drmoo.Balancer("moco", net["trunk"].parameters(), 2, lr=0.1)
    for method in ("mgda", "modo", "sdmgrad", "double-clip", "nashmtl", "famo", "double-loop"):
        create(method, net["trunk"].parameters(), 2)  # parameters mode: accepted


def sharded_closure(net: nn.ModuleDict, x: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def closure() -> tuple[torch.Tensor, torch.Tensor]:
        z = net["trunk"](x)
        return (net["heads"](z) - 1.0) ** 2, z

    return closure


@pytest.mark.usefixtures("group_of_one")
def test_a_capturable_step_on_sharded_parameters_is_refused_and_changes_nothing() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    shards: list[Any] = list(net["trunk"].parameters())
    optimizer = create("mgda", shards, 2, jacobian="features", capturable=True)
    before = [p.full_tensor().clone() for p in shards]
    with pytest.raises(ValueError, match=r"capturable steps with FSDP-sharded shared parameters are not supported"):
        optimizer.step(sharded_closure(net, torch.randn(6, 4)))
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(shards, before))
    assert optimizer.steps_taken == 0 and all(p.grad is None for p in [*shards, *net["heads"].parameters()])


@pytest.mark.usefixtures("group_of_one")
def test_famo_restores_its_shards_when_the_re_evaluation_after_writing_them_fails() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    shards: list[Any] = list(net["trunk"].parameters())
    optimizer = create("famo", shards, 2, lr=0.1)
    before = [p.full_tensor().clone() for p in shards]
    closure = sharded_closure(net, torch.randn(6, 4))

    def reevaluate() -> torch.Tensor:
        assert not all(torch.equal(p.full_tensor(), b) for p, b in zip(shards, before))  # the shards were written
        return closure()[0][:3]  # not the batch stepped on

    with pytest.raises(ValueError, match=r"re-evaluated losses have shape \(3, 2\)"):
        optimizer.step(lambda: closure()[0], reevaluate=reevaluate)
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(shards, before))
    assert optimizer.steps_taken == 0


@pytest.mark.usefixtures("group_of_one")
def test_accumulating_micro_batches_with_sharded_heads_is_refused_and_changes_nothing() -> None:
    net = two_task_net()
    fully_shard(net["heads"])  # the trunk replicated: only the heads' kept gradients could not reach their shards
    balancer = drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1)
    losses = (net["heads"](net["trunk"](torch.randn(6, 4))) - 1.0) ** 2
    with pytest.raises(ValueError, match=r"cannot be accumulated with FSDP-sharded heads.*keep the heads replicated"):
        balancer.backward(losses, accumulate=True)
    assert balancer.steps_taken == 0 and all(p.grad is None for p in net.parameters())


@pytest.mark.usefixtures("group_of_one")
def test_a_failing_step_leaves_the_sharded_heads_grad_as_it_found_it() -> None:
    net = two_task_net()
    fully_shard(net["trunk"])
    fully_shard(net["heads"])
    balancer = drmoo.Balancer("mgda", net["trunk"].parameters(), 2, lr=0.1, jacobian="features")
    heads: list[Any] = list(net["heads"].parameters())
    before = [torch.full_like(p, 0.5) for p in heads]  # sharded DTensors, as FSDP's own backward leaves them
    for head, grad in zip(heads, before):
        head.grad = grad.clone()
    losses, z = sharded_closure(net, torch.randn(6, 4))()
    infinite_slope = losses + torch.sqrt(losses - losses.detach())  # the same values, an infinite gradient
    with pytest.raises(ValueError, match=r"non-finite"):
        balancer.backward(infinite_slope, features=z)
    assert balancer.steps_taken == 0
    assert all(torch.equal(h.grad.full_tensor(), b.full_tensor()) for h, b in zip(heads, before))
    assert all(p.grad is None for p in net["trunk"].parameters())
    losses, z = sharded_closure(net, torch.randn(6, 4))()
    balancer.backward(losses, features=z)  # a step that succeeds adds the heads' gradients to theirs
    assert balancer.steps_taken == 1
    assert all(not torch.equal(h.grad.full_tensor(), b.full_tensor()) for h, b in zip(heads, before))


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
# Per method, hyperparameters that move w and eta visibly in STEPS steps (Nash-MTL: a weight update, then a step
# that reuses the weights through one combined backward, then an update; Double-Loop: its own index generator).
CASES: dict[str, dict[str, Any]] = {
    "mgda": {"pref_lr": 0.3}, "modo": {"pref_lr": 0.3}, "sdmgrad": {"pref_lr": 0.3},
    "double-clip": {"pref_lr": 0.3, "c2": 0.05}, "nashmtl": {"update_every": 2}, "famo": {"pref_lr": 0.1},
    "double-loop": {"pref_lr": 0.3, "dual_lr": 0.1, "inner_steps": 2, "seed": 0},
}
RATE_CHOSEN = {"double-clip", "nashmtl"}  # features mode warns unless the rate was chosen for it
# (method, form, jacobian): the Balancer in both modes; the step(closure) optimizers in both modes (they write
# each rank's shards themselves; FAMO in its same-batch form, which re-evaluates the batch after that write).
RUNS = ([(method, "balancer", "parameters") for method in CASES]
        + [(method, "balancer", "features") for method in ("mgda", "double-clip", "nashmtl", "famo")]
        + [(method, "closure", jacobian) for jacobian in ("parameters", "features") for method in CASES])


def hyperparameters(method: str, jacobian: str) -> dict[str, Any]:
    return {**CASES[method], **({"features_rate_chosen": True} if jacobian == "features" and method in RATE_CHOSEN
                                 else {})}


def train(method: str, form: str, jacobian: str, shard: bool) -> dict[str, Any]:
    """STEPS steps of the Balancer with SGD (``form`` "balancer") or of the method's own step(closure) (heads by
    SGD, their gradients summed over ranks); under a process group each rank passes its shard of every global
    batch (every W-th row), and with ``shard`` the trunk is wrapped by fully_shard (heads not)."""
    features = jacobian == "features"
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh()).double()
    heads = nn.ModuleList([nn.Linear(6, 1) for _ in range(2)]).double()
    if shard:
        fully_shard(trunk)
    generator = torch.Generator().manual_seed(1)
    rows = distributed.shard(torch.arange(GLOBAL_BATCH))
    batch: list[torch.Tensor] = []

    def forward(same_batch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not same_batch:  # a fresh global batch (FAMO's same-batch form recomputes the last one)
            x = torch.randn(GLOBAL_BATCH, 4, generator=generator, dtype=torch.float64)
            batch[:] = [x, torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)]
        z = trunk(batch[0][rows])
        return (torch.cat([head(z) for head in heads], dim=1) - batch[1][rows]) ** 2, z

    if form == "balancer":
        optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
        algorithm: Any = drmoo.Balancer(method, trunk.parameters(), 2, jacobian=jacobian,  # type: ignore[call-overload]
                                        optimizer=optimizer, **hyperparameters(method, jacobian))
        for _ in range(STEPS):
            optimizer.zero_grad()
            losses, z = forward()
            algorithm.backward(losses, features=z if features else None)
            optimizer.step()
    else:
        algorithm = create(method, trunk.parameters(), 2, jacobian=jacobian, lr=0.1,
                           **hyperparameters(method, jacobian))
        head_optimizer = torch.optim.SGD(heads.parameters(), lr=0.1)
        for _ in range(STEPS):
            head_optimizer.zero_grad()
            algorithm.step(one_batch_closure(forward, features))
            distributed.all_reduce_grads(heads.parameters())
            head_optimizer.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in [*trunk.parameters(), *heads.parameters()]]
    return {"params": [p.detach().clone() for p in params], "eta": algorithm.eta.clone(), "w": algorithm.w.clone(),
            "steps": algorithm.steps_taken}


def one_batch_closure(forward: Callable[[bool], tuple[torch.Tensor, torch.Tensor]], features: bool) -> Any:
    """One step's closure: fresh batches; in features mode every draw with a graph after the first returns the first
    (one z per step, as drmoo's own OneBatchPerStep does)."""
    first: list[Any] = []

    def closure(same_batch: bool = False) -> Any:
        with_graph = torch.is_grad_enabled() and not same_batch
        if features and with_graph and first:
            return first[0]
        losses, z = forward(same_batch)
        result = (losses, z) if features else losses
        if features and with_graph:
            first.append(result)
        return result

    return closure


def _fsdp_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save({run: train(*run, shard=True) for run in RUNS}, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_a_fully_sharded_trunk_equal_one_process_on_the_global_batch(
        tmp_path: Path, run_ranks: Callable[..., None]) -> None:
    run_ranks(_fsdp_rank, 2, str(tmp_path / "init"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in (0, 1)]
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh()).double()
    for run in RUNS:
        single = train(*run, shard=False)
        for result in ranks:
            assert result[run]["steps"] == STEPS
            for a, b in zip(result[run]["params"], single["params"]):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=str(run))
            for key in ("eta", "w"):
                torch.testing.assert_close(result[run][key], single[key], rtol=1e-9, atol=1e-12, msg=f"{run} {key}")
        assert all(not torch.equal(a, b) for a, b in zip(single["params"], initial.parameters()))  # the trunk moved
        assert single["eta"].abs().min() > 1e-3, run  # eta moved on every task


# ------------------------------------------------------------------------------ sharded heads, 2 ranks vs 1 process
# (method, form, jacobian, wrap): "each" wraps every head (two layers, so that each rank holds rows of the first)
# by fully_shard, "root" wraps the root module after the trunk (its heads: Linear(6, 1), whose rows features mode
# would otherwise take from the weights directly).
HEAD_RUNS = [("mgda", "balancer", "features", "each"), ("double-clip", "balancer", "features", "root"),
             ("mgda", "balancer", "parameters", "root"), ("famo", "balancer", "parameters", "each"),
             ("modo", "closure", "parameters", "each"), ("mgda", "closure", "features", "root"),
             ("famo", "closure", "parameters", "root")]  # its re-evaluation without a graph, then the heads' step


class TwoTaskModel(nn.Module):
    """A trunk and two heads; the root's forward returns the heads' outputs and z (FSDP2 on the root runs in it)."""

    def __init__(self, wrap: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh())
        self.heads = nn.ModuleList([nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)) if wrap == "each"
                                    else nn.Linear(6, 1) for _ in range(2)])
        self.double()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.trunk(x)
        return torch.cat([head(z) for head in self.heads], dim=1), z


def train_sharded_heads(method: str, form: str, jacobian: str, wrap: str, shard: bool) -> dict[str, Any]:
    """:func:`train` with heads that FSDP2 shards too (``wrap``; none without ``shard``)."""
    features = jacobian == "features"
    model = TwoTaskModel(wrap)
    if shard:
        fully_shard(model.trunk)
        for module in model.heads if wrap == "each" else [model]:
            fully_shard(module)
    generator = torch.Generator().manual_seed(1)
    rows = distributed.shard(torch.arange(GLOBAL_BATCH))
    batch: list[torch.Tensor] = []

    def forward(same_batch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not same_batch:
            x = torch.randn(GLOBAL_BATCH, 4, generator=generator, dtype=torch.float64)
            batch[:] = [x, torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)]
        outputs, z = model(batch[0][rows])
        return (outputs - batch[1][rows]) ** 2, z

    if form == "balancer":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        algorithm: Any = drmoo.Balancer(method, model.trunk.parameters(), 2, jacobian=jacobian,  # type: ignore[call-overload]
                                        optimizer=optimizer, **hyperparameters(method, jacobian))
        for _ in range(STEPS):
            optimizer.zero_grad()
            losses, z = forward()
            algorithm.backward(losses, features=z if features else None)
            optimizer.step()
    else:
        algorithm = create(method, model.trunk.parameters(), 2, jacobian=jacobian, lr=0.1,
                           **hyperparameters(method, jacobian))
        head_optimizer = torch.optim.SGD(model.heads.parameters(), lr=0.1)
        for _ in range(STEPS):
            head_optimizer.zero_grad()
            algorithm.step(one_batch_closure(forward, features))
            distributed.all_reduce_grads(model.heads.parameters())  # sharded heads: skipped, FSDP summed them
            head_optimizer.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"params": [p.detach().clone() for p in params], "eta": algorithm.eta.clone(), "w": algorithm.w.clone(),
            "steps": algorithm.steps_taken}


def _sharded_heads_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save({run: train_sharded_heads(*run, shard=True) for run in HEAD_RUNS}, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_sharded_heads_equal_one_process_on_the_global_batch(
        tmp_path: Path, run_ranks: Callable[..., None]) -> None:
    run_ranks(_sharded_heads_rank, 2, str(tmp_path / "init"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in (0, 1)]
    worst = 0.0
    for run in HEAD_RUNS:
        single = train_sharded_heads(*run, shard=False)
        initial = list(TwoTaskModel(run[3]).parameters())
        assert all(not torch.equal(a, b) for a, b in zip(single["params"], initial)), run  # trunk and heads moved
        assert single["eta"].abs().min() > 1e-3, run
        for result in ranks:
            assert result[run]["steps"] == STEPS
            for a, b in zip(result[run]["params"], single["params"]):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=str(run))
                worst = max(worst, (a - b).abs().max().item())
            for key in ("eta", "w"):
                torch.testing.assert_close(result[run][key], single[key], rtol=1e-9, atol=1e-12, msg=f"{run} {key}")
                worst = max(worst, (result[run][key] - single[key]).abs().max().item())
    print(f"sharded heads: largest difference from one process {worst:.3g}")
