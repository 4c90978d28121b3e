"""Hostile input, round six (the training API): one test (or a family) per defect, named after it.

Each reproduction is the audit's, on a linear trunk with two heads: a value written where only the
constructor checked it, a forged state entry, a resumed run's dual step, a false or missing
heads-as-shared refusal in features mode, a refused backward that changed the balancer, a scheduler that
cycled a momentum that is not one, integer losses.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import create


def two_task_problem(seed: int = 0) -> tuple[nn.Linear, nn.Linear, Tensor]:
    torch.manual_seed(seed)
    return nn.Linear(4, 3), nn.Linear(3, 2), torch.randn(8, 4)


def losses_of(trunk: nn.Module, heads: nn.Module, x: Tensor) -> Tensor:
    return heads(trunk(x)) ** 2


# ------------------------------------------------------------------ MGDA's clip constants after construction
@pytest.mark.parametrize(("key", "value", "message"), [
    ("clip_c1", -3.0, r"parameter group 0: clip_c1 must be finite and > 0, got -3\.0"),
    ("clip_c2", float("nan"), r"parameter group 0: clip_c2 must be finite and > 0, got nan"),
    ("clip_c1", None, r"clip_c1 and clip_c2 clip the step together: give both or neither"),
])
def test_clip_constants_written_after_construction_are_refused_at_the_next_backward(
        key: str, value: Any, message: str) -> None:
    trunk, heads, x = two_task_problem()
    balancer = drmoo.Balancer("mgda", trunk.parameters(), 2, lr=0.1, clip_c1=1.0, clip_c2=0.5)
    balancer.algorithm.param_groups[0][key] = value
    with pytest.raises(ValueError, match=message):
        balancer.backward(losses_of(trunk, heads, x))
    assert trunk.weight.grad is None and balancer.steps_taken == 0


def test_a_negative_clip_constant_in_a_step_optimizer_is_named_not_blamed_on_lr() -> None:
    trunk, heads, x = two_task_problem()
    optimizer = create("mgda", trunk.parameters(), 2, clip_c1=1.0, clip_c2=0.5)
    optimizer.param_groups[0]["clip_c1"] = -3.0
    before = trunk.weight.detach().clone()
    with pytest.raises(ValueError, match="clip_c1 must be finite and > 0"):
        optimizer.step(lambda: losses_of(trunk, heads, x))
    assert torch.equal(trunk.weight, before)


@pytest.mark.parametrize(("clip_c1", "clip_c2", "message"), [
    (-5.0, 0.5, "clip_c1 must be finite and > 0"),
    (1.0, float("nan"), "clip_c2 must be finite and > 0"),
    (None, 0.5, "give both or neither"),
])
def test_a_state_with_invalid_clip_constants_is_refused(clip_c1: Any, clip_c2: Any, message: str) -> None:
    trunk, _, _ = two_task_problem()
    state = create("mgda", trunk.parameters(), 2, clip_c1=1.0, clip_c2=0.5).state_dict()
    state["param_groups"][0]["clip_c1"], state["param_groups"][0]["clip_c2"] = clip_c1, clip_c2
    loader = create("mgda", trunk.parameters(), 2, clip_c1=1.0, clip_c2=0.5)
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)
    assert loader.param_groups[0]["clip_c1"] == 1.0


# -------------------------------------------------------------------------- forged method-internal entries
@pytest.mark.parametrize("alpha", [[-3.0, -3.0], [0.0, 0.0], [2.0, -0.5]])
def test_a_nash_mtl_state_with_a_negative_or_zero_alpha_is_refused(alpha: list[float]) -> None:
    trunk, heads, x = two_task_problem()
    optimizer = create("nashmtl", trunk.parameters(), 2, update_every=2)
    optimizer.step(lambda: losses_of(trunk, heads, x))
    state = copy.deepcopy(optimizer.state_dict())
    state["state"]["drmoo"]["alpha"] = torch.tensor(alpha, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"alpha must be >= 0 with at least one entry > 0"):
        create("nashmtl", trunk.parameters(), 2, update_every=2).load_state_dict(state)


def test_a_nash_mtl_state_with_a_vanished_task_still_loads() -> None:
    trunk, heads, x = two_task_problem()
    optimizer = create("nashmtl", trunk.parameters(), 2)
    optimizer.step(lambda: losses_of(trunk, heads, x))
    state = copy.deepcopy(optimizer.state_dict())
    state["state"]["drmoo"]["alpha"] = torch.tensor([1.5, 0.0], dtype=torch.float64)  # the solver writes 0 there
    create("nashmtl", trunk.parameters(), 2).load_state_dict(state)


def test_a_famo_state_with_another_task_counts_loss_floor_is_refused_at_load() -> None:
    trunk, _, _ = two_task_problem()
    state = create("famo", trunk.parameters(), 3, loss_floor=[0.0, 0.1, 0.2]).state_dict()
    state["state"]["drmoo"] = create("famo", trunk.parameters(), 2).state_dict()["state"]["drmoo"]
    loader = create("famo", trunk.parameters(), 2)
    with pytest.raises(ValueError, match=r"loss_floor has 3 values, but this FAMO has num_tasks=2"):
        loader.load_state_dict(state)
    assert loader.param_groups[0]["loss_floor"] == (0.0,)


# ----------------------------------------------------------- Double-Loop's dual_lr across a resumed run
def test_double_loop_dual_lr_follows_the_loaded_state_after_a_decayed_rate() -> None:
    trunk, heads, x = two_task_problem()
    optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    balancer = drmoo.Balancer("double-loop", trunk.parameters(), 2, optimizer=optimizer, dual_lr=3e-3)
    balancer.backward(losses_of(trunk, heads, x))
    optimizer.step()
    optimizer.zero_grad()
    for group in optimizer.param_groups:  # a manual decay, no scheduler: no initial_lr in the group
        group["lr"] = 0.01
    balancer.backward(losses_of(trunk, heads, x))
    assert balancer.algorithm.param_groups[0]["dual_lr"] == pytest.approx(3e-4, rel=1e-12)
    saved_balancer, saved_optimizer = balancer.state_dict(), optimizer.state_dict()

    resumed_optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    resumed_optimizer.load_state_dict(saved_optimizer)  # lr 0.01 now
    resumed = drmoo.Balancer("double-loop", trunk.parameters(), 2, optimizer=resumed_optimizer, dual_lr=3e-3)
    resumed.load_state_dict(saved_balancer)
    resumed.backward(losses_of(trunk, heads, x))
    assert resumed.algorithm.param_groups[0]["dual_lr"] == pytest.approx(3e-4, rel=1e-12)


def test_double_loop_state_saved_before_its_first_backward_resumes_at_the_constructed_ratio() -> None:
    trunk, heads, x = two_task_problem()
    optimizer = torch.optim.SGD(trunk.parameters(), lr=0.1)
    balancer = drmoo.Balancer("double-loop", trunk.parameters(), 2, optimizer=optimizer, dual_lr=3e-3)
    assert balancer.algorithm.param_groups[0]["lr"] == 0.1  # the coupled rate from the start
    resumed = drmoo.Balancer("double-loop", trunk.parameters(), 2, optimizer=optimizer, dual_lr=3e-3)
    resumed.load_state_dict(balancer.state_dict())
    resumed.backward(losses_of(trunk, heads, x))
    assert resumed.algorithm.param_groups[0]["dual_lr"] == pytest.approx(3e-3, rel=1e-12)


# ------------------------------------------------------------ a refused backward leaves the balancer's rates
@pytest.mark.parametrize("method", ["double-clip", "double-loop"])
def test_an_invalid_optimizer_rate_is_refused_before_the_balancer_copies_it(method: str) -> None:
    trunk, heads, x = two_task_problem()
    optimizer = torch.optim.SGD(trunk.parameters(), lr=0.1)
    balancer = drmoo.Balancer(method, trunk.parameters(), 2, optimizer=optimizer)
    before = dict(balancer.algorithm.param_groups[0])
    optimizer.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"the optimizer passed as optimizer= has an invalid rate .*lr must be"):
        balancer.backward(losses_of(trunk, heads, x))
    after = balancer.algorithm.param_groups[0]
    assert after["lr"] == before["lr"] and after.get("dual_lr") == before.get("dual_lr")
    state = balancer.state_dict()
    drmoo.Balancer(method, trunk.parameters(), 2, optimizer=torch.optim.SGD(trunk.parameters(), lr=0.1)) \
        .load_state_dict(state)  # what was saved in the error handler loads


# ------------------------------------------------------------------- features mode: who reaches what
@pytest.mark.parametrize("batch", [5, 6, 7])
def test_features_mode_accepts_a_trunk_whose_entry_count_equals_the_rows_width(batch: int) -> None:
    torch.manual_seed(0)
    scale, shift, linear = nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.tensor(0.0)), nn.Linear(4, 2)
    shared = [scale, shift, *linear.parameters()]  # n = 12 = B * d at B = 6
    head0, head1 = nn.Linear(1, 1), nn.Linear(1, 1)
    balancer = drmoo.Balancer("mgda", shared, 2, lr=0.01, jacobian="features")
    z = linear(torch.randn(batch, 4)) * scale + shift
    balancer.backward(torch.cat([head0(z[:, :1]), head1(z[:, 1:])], 1) ** 2, features=z)
    assert scale.grad is not None and balancer.steps_taken == 1


@pytest.mark.parametrize("jacobian", ["parameters", "features"])
def test_a_tower_below_z_that_one_task_reads_is_refused_in_both_modes(jacobian: str) -> None:
    trunk, head, x = two_task_problem()
    tower = nn.Linear(3, 3)
    balancer = drmoo.Balancer("mgda", [*trunk.parameters(), *tower.parameters()], 2, lr=0.01, jacobian=jacobian)
    shared_out = trunk(x)
    tower_out = tower(torch.relu(shared_out))
    losses = torch.stack([head(shared_out)[:, 0], head(tower_out)[:, 1]], 1) ** 2
    with pytest.raises(ValueError, match=r"shared parameter 2 \(shape \(3, 3\)\) is reached only by the losses of "
                                         r"task\(s\) \[1\] of 2"):
        if jacobian == "features":
            balancer.backward(losses, features=(shared_out, tower_out))
        else:
            balancer.backward(losses)
    assert trunk.weight.grad is None


def test_features_mode_warns_once_of_a_trainable_layer_below_z_that_is_not_shared() -> None:
    trunk, heads, x = two_task_problem()
    stem = nn.Linear(4, 4)
    optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    balancer = drmoo.Balancer("mgda", trunk.parameters(), 2, optimizer=optimizer, jacobian="features")
    caught: list[list[warnings.WarningMessage]] = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            z = trunk(stem(x))
            balancer.backward(heads(z) ** 2, features=z)  # the line the warning must point at
        optimizer.step()
        optimizer.zero_grad()
        caught.append([w for w in got if "below the features z" in str(w.message)])
    assert len(caught[0]) == 1 and not caught[1]
    assert "2 trainable parameter(s)" in str(caught[0][0].message) and "(4, 4)" in str(caught[0][0].message)
    assert caught[0][0].filename == __file__
    assert stem.weight.grad is None  # as warned


def test_features_mode_does_not_warn_when_everything_below_z_is_shared_or_frozen() -> None:
    trunk, heads, x = two_task_problem()
    stem = nn.Linear(4, 4).requires_grad_(False)
    balancer = drmoo.Balancer("mgda", trunk.parameters(), 2, lr=0.01, jacobian="features")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = trunk(stem(x.requires_grad_()))  # an input leaf that requires grad is no layer: no warning
        balancer.backward(heads(z) ** 2, features=z)


# -------------------------------------------------------------------- SDMGrad's momentum is not a scheduler's
def test_a_scheduler_cycling_sdmgrads_momentum_is_refused() -> None:
    trunk, heads, x = two_task_problem()
    balancer = drmoo.Balancer("sdmgrad", trunk.parameters(), 2, lr=0.1, momentum=0.5)
    torch.optim.lr_scheduler.OneCycleLR(balancer.algorithm, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match=r"cycles 'momentum' .*cycle_momentum=False"):
        balancer.backward(losses_of(trunk, heads, x))
    assert trunk.weight.grad is None


def test_a_scheduler_that_leaves_momentum_alone_is_accepted() -> None:
    trunk, heads, x = two_task_problem()
    balancer = drmoo.Balancer("sdmgrad", trunk.parameters(), 2, lr=0.1, momentum=0.5)
    torch.optim.lr_scheduler.OneCycleLR(balancer.algorithm, max_lr=0.1, total_steps=10, cycle_momentum=False)
    balancer.backward(losses_of(trunk, heads, x))
    assert balancer.algorithm.param_groups[0]["momentum"] == 0.5


# ------------------------------------------------------------------------------------ integer losses
def test_integer_losses_are_refused_as_not_floating_point() -> None:
    trunk, _, _ = two_task_problem()
    balancer = drmoo.Balancer("mgda", trunk.parameters(), 2, lr=0.1)
    with pytest.raises(ValueError, match=r"losses must be floating point .*got torch\.int64"):
        balancer.backward(torch.ones(4, 2, dtype=torch.long))
