"""Issue 18's optimizer and kernel-API defects: one test (or one parametrized family) per defect.

SW-7 hyperparameters written after construction are checked at every step; SW-8 a parameter given
twice is refused; SW-10 the public kernel ops validate their arguments as torch's own ops do, before
writing anything; SW-11 losses that do not depend on the shared parameters are refused; U-4 and U-5
clear messages (losses on another device, gram of a 0-d tensor, MoCo after a requires_grad toggle,
a float64 group in a float32 optimizer, an absurd task count, the failing iteration, a stale lock).
"""

from __future__ import annotations

import copy
import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

import drmoo
from drmoo import store
from drmoo.optim import MoCo, NonFiniteStepError, available, create
from drmoo_kernels import Divergence, available_backends, backend_module

METHODS = sorted(available())


def build(toy: Callable[..., Any], method: str, **kwargs: Any) -> tuple[Any, Any]:
    problem = toy()
    torch.manual_seed(0)
    return problem, create(method, problem.shared, problem.num_tasks, backend="reference", **kwargs)


def assert_unchanged(problem: Any, before: list[Tensor]) -> None:
    for got, want in zip(problem.snapshot(), before):
        assert torch.equal(got, want)


# ------------------------------------------------------------------ SW-7: hyperparameters at each step
@pytest.mark.parametrize("method", METHODS)
def test_sw7_an_lr_scheduler_that_yields_nan_is_refused_at_the_next_step(toy, method: str) -> None:
    problem, optimizer = build(toy, method, lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: float("nan") if epoch >= 1 else 1.0)
    optimizer.step(problem.closure(1))
    scheduler.step()  # lr = 0.05 * nan
    before = problem.snapshot()
    state = copy.deepcopy(optimizer.state_dict()["state"])
    with pytest.raises(ValueError, match=r"parameter group 0: lr must be finite and >= 0, got nan .*LR scheduler"):
        optimizer.step(problem.closure(2))
    assert_unchanged(problem, before)
    assert optimizer.steps_taken == 1
    assert torch.equal(optimizer.state_dict()["state"]["drmoo"]["w"], state["drmoo"]["w"])


@pytest.mark.parametrize(("key", "value", "message"), [
    ("lam", -1.0, r"parameter group 0: lam must be finite and > 0, got -1\.0"),
    ("lr", -0.1, r"parameter group 0: lr must be finite and >= 0, got -0\.1"),
    ("pref_lr", float("inf"), r"parameter group 0: pref_lr must be finite and >= 0, got inf"),
    ("c2", float("nan"), r"parameter group 0: c2 must be finite and > 0, got nan"),
    ("divergence", "hellinger", r"parameter group 0: divergence: unknown divergence"),
])
def test_sw7_a_direct_param_groups_write_is_refused_at_the_next_step(toy, key: str, value: Any, message: str) -> None:
    problem, optimizer = build(toy, "double-clip")
    optimizer.param_groups[0][key] = value
    before = problem.snapshot()
    with pytest.raises(ValueError, match=message):
        optimizer.step(problem.closure(1))
    assert_unchanged(problem, before)


def test_sw7_a_write_into_a_second_group_only_is_refused(toy) -> None:
    problem = toy()
    optimizer = create("mgda", [{"params": [problem.A]}, {"params": [problem.c]}], 3, backend="reference")
    optimizer.param_groups[1]["lr"] = 0.5  # the step reads group 0: a silent no-op without the check
    with pytest.raises(ValueError, match="'lr' differs between parameter groups"):
        optimizer.step(problem.closure(1))


def test_sw7_a_capturable_step_checks_float_hyperparameters_too(toy) -> None:
    problem, optimizer = build(toy, "double-clip", capturable=True)
    optimizer.param_groups[0]["lam"] = float("nan")
    with pytest.raises(ValueError, match="parameter group 0: lam must be finite"):
        optimizer.step(problem.closure(1))


def test_sw7_the_balancer_checks_its_hyperparameters_at_each_backward(toy) -> None:
    problem = toy()
    balancer = drmoo.Balancer("double-clip", problem.shared, 3, backend="reference")
    balancer.algorithm.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="parameter group 0: lr must be finite and >= 0, got nan"):
        balancer.backward(problem.losses(torch.arange(16)))
    assert problem.A.grad is None and balancer.steps_taken == 0


# ------------------------------------------------------------------------ SW-8: a parameter given twice
def test_sw8_a_parameter_twice_in_one_group_is_refused(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match="appears twice in one parameter group"):
        create("double-clip", [problem.A, problem.c, problem.A], 3)


def test_sw8_a_parameter_in_two_groups_is_refused(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match="already in parameter group 0"):
        create("mgda", [{"params": [problem.A]}, {"params": [problem.c, problem.A]}], 3)


def test_sw8_add_param_group_refuses_a_parameter_already_there(toy) -> None:
    problem = toy()
    optimizer = create("double-clip", [problem.A], 3)
    with pytest.raises(ValueError, match="already in parameter group 0"):
        optimizer.add_param_group({"params": [problem.c, problem.A]})
    with pytest.raises(ValueError, match="appears twice"):
        optimizer.add_param_group({"params": [problem.c, problem.c]})
    assert len(optimizer.param_groups) == 1


# ------------------------------------------------------------------ SW-10: the public kernel ops
KERNEL_BACKENDS = [name for name in ("reference", "cpp") if name in available_backends()]


@pytest.fixture(params=KERNEL_BACKENDS)
def ops(request: pytest.FixtureRequest) -> ModuleType:
    return backend_module(request.param)


def _dual_args(**override: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    args: dict[str, Any] = {
        "losses": torch.rand(8, 3, generator=gen), "eta": torch.zeros(3), "w": torch.full((3,), 1 / 3),
        "lam": 0.6, "scale": 1.0, "divergence": Divergence("chi2"), "gamma": 0.1, "f1": 1.0, "f2": 0.5,
        "sample_weight": None,
    }
    args.update(override)
    return args


def _gram_step_args(**override: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    args: dict[str, Any] = {
        "jacobian": torch.randn(3, 10, generator=gen), "w": torch.full((3,), 1 / 3),
        "params": [torch.zeros(4), torch.zeros(6)], "gamma": 0.1, "c1": 1.0, "c2": 0.5, "beta": 0.3, "rho": 1e-3,
        "mu": 0.5, "z": torch.zeros(3),
    }
    args.update(override)
    return args


def _call_dual_step(ops: ModuleType, args: dict[str, Any]) -> Any:
    return ops.dual_step(args["losses"], args["eta"], args["w"], args["lam"], args["scale"], args["divergence"],
                         args["gamma"], args["f1"], args["f2"], args["sample_weight"])


def _call_gram_step(ops: ModuleType, args: dict[str, Any]) -> Any:
    return ops.gram_step(args["jacobian"], args["w"], args["params"], args["gamma"], args["c1"], args["c2"],
                         args["beta"], args["rho"], args["mu"], args["z"])


@pytest.mark.parametrize("op", ["gram", "combine", "gram_step"])
@pytest.mark.parametrize("jacobian", [torch.ones(10), torch.tensor(1.0)], ids=["1-d", "0-d"])
def test_sw10_u4_a_jacobian_without_a_task_dimension_is_refused(ops: ModuleType, op: str, jacobian: Tensor) -> None:
    """A 1-D J used to be read as n tasks of one column (gram -> n x n); a 0-d one was an IndexError."""
    params = [torch.zeros(jacobian.numel())]
    calls = {
        "gram": lambda: ops.gram(jacobian),
        "combine": lambda: ops.combine(jacobian, torch.ones(1), params, 0.1),
        "gram_step": lambda: _call_gram_step(ops, _gram_step_args(jacobian=jacobian, params=params)),
    }
    with pytest.raises(ValueError, match=rf"drmoo\.{op}: J must be the \[m, n\] per-task gradient matrix"):
        calls[op]()
    assert torch.equal(params[0], torch.zeros(jacobian.numel()))


BAD_NUMBERS = [float("nan"), float("inf"), -0.5]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("name", ["lam", "scale", "gamma", "f1", "f2"])
def test_sw10_dual_step_refuses_bad_scalars_before_writing_eta(ops: ModuleType, name: str, value: float) -> None:
    args = _dual_args(**{name: value})
    with pytest.raises(ValueError, match=rf"drmoo\.dual_step: {name} must be finite and >=? 0, got"):
        _call_dual_step(ops, args)
    assert torch.equal(args["eta"], torch.zeros(3))


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("name", ["lam", "scale"])
def test_sw10_dual_forward_refuses_bad_scalars(ops: ModuleType, name: str, value: float) -> None:
    args = _dual_args(**{name: value})
    with pytest.raises(ValueError, match=rf"drmoo\.dual_forward: {name} must be finite and > 0"):
        ops.dual_forward(args["losses"], args["eta"], args["lam"], args["scale"], args["divergence"])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
@pytest.mark.parametrize("op", ["dual_forward", "dual_step"])
def test_sw10_bad_sample_weights_are_refused(ops: ModuleType, op: str, bad: float) -> None:
    weights = torch.ones(8, 3)
    weights[5, 1] = bad
    args = _dual_args(sample_weight=weights)
    with pytest.raises(ValueError, match=rf"drmoo\.{op}: sample_weight .* must be finite and >= 0"):
        if op == "dual_forward":
            ops.dual_forward(args["losses"], args["eta"], args["lam"], args["scale"], args["divergence"], weights)
        else:
            _call_dual_step(ops, args)
    assert torch.equal(args["eta"], torch.zeros(3))


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("name", ["gamma", "c1", "c2", "beta", "rho", "mu"])
def test_sw10_gram_step_refuses_bad_scalars_before_writing(ops: ModuleType, name: str, value: float) -> None:
    args = _gram_step_args(**{name: value})
    with pytest.raises(ValueError, match=rf"drmoo\.gram_step: {name} must be finite and >=? 0, got"):
        _call_gram_step(ops, args)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in args["params"])
    assert torch.equal(args["w"], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("lr", [float("nan"), -0.1, torch.tensor(float("nan")), torch.tensor(-1.0)],
                         ids=["nan", "negative", "nan-tensor", "negative-tensor"])
def test_sw10_combine_refuses_a_bad_lr(ops: ModuleType, lr: float | Tensor) -> None:
    params = [torch.zeros(10)]
    with pytest.raises(ValueError, match=r"drmoo\.combine: lr must be finite and >= 0"):
        ops.combine(torch.ones(3, 10), torch.ones(3), params, lr)
    assert torch.equal(params[0], torch.zeros(10))


def test_sw10_dual_step_refuses_an_expanded_eta(ops: ModuleType) -> None:
    eta = torch.zeros(1).expand(3)  # three entries, one memory cell: an in-place update would race
    with pytest.raises(ValueError, match=r"drmoo\.dual_step: eta is written in place, but several of its elements"):
        _call_dual_step(ops, _dual_args(eta=eta))


def test_sw10_gram_step_refuses_an_expanded_w(ops: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"drmoo\.gram_step: w is written in place, but several"):
        _call_gram_step(ops, _gram_step_args(w=torch.full((1,), 1 / 3).expand(3)))


@pytest.mark.parametrize("op", ["combine", "gram_step"])
def test_sw10_a_parameter_that_requires_grad_is_refused_under_grad_mode(ops: ModuleType, op: str) -> None:
    """Checked for every parameter before the first is written: params[0] stays as it was."""
    params = [torch.zeros(4), torch.zeros(6, requires_grad=True)]
    with pytest.raises(RuntimeError, match=rf"drmoo\.{op}: params\[1\] is a leaf Variable that requires grad"):
        if op == "combine":
            ops.combine(torch.ones(3, 10), torch.ones(3), params, 0.1)
        else:
            _call_gram_step(ops, _gram_step_args(params=params))
    assert torch.equal(params[0], torch.zeros(4))
    with torch.no_grad():  # as an optimizer writes its parameters: allowed
        ops.combine(torch.ones(3, 10), torch.ones(3), params, 0.1)
    assert not torch.equal(params[1], torch.zeros(6))


def test_sw10_combine_writes_nothing_when_the_parameters_do_not_fill_j(ops: ModuleType) -> None:
    params = [torch.zeros(4), torch.zeros(5)]  # 9 elements for J's 10 columns
    with pytest.raises(ValueError, match=r"drmoo\.combine: J has 10 columns but the parameters hold 9 elements"):
        ops.combine(torch.ones(3, 10), torch.ones(3), params, 0.1)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params)


def test_sw10_combine_refuses_a_parameter_given_twice(ops: ModuleType) -> None:
    shared = torch.zeros(5)
    with pytest.raises(ValueError, match=r"drmoo\.combine: params\[1\] is params\[0\] again"):
        ops.combine(torch.ones(3, 10), torch.ones(3), [shared, shared], 0.1)
    assert torch.equal(shared, torch.zeros(5))


def test_sw10_an_optimizer_step_still_reads_nothing_it_need_not(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' value checks are skipped inside a step (the optimizer checked its inputs): no extra host read."""
    from drmoo_kernels import _checks

    problem, optimizer = build(toy, "double-clip")
    allowed: list[bool] = []
    original = _checks._values_readable
    monkeypatch.setattr(_checks, "_values_readable", lambda tensor: allowed.append(original(tensor)) or allowed[-1])
    draw = problem.batches(1)
    optimizer.step(lambda: (problem.losses(rows := draw()), torch.ones(len(rows), 3, dtype=torch.float64)))
    assert allowed and not any(allowed)  # asked (sample weights, mu), never allowed to read


# ------------------------------------------------------------------ SW-11: losses without the parameters
@pytest.mark.parametrize("method", METHODS)
def test_sw11_losses_that_do_not_depend_on_the_shared_parameters_are_refused(toy, method: str) -> None:
    problem, optimizer = build(toy, method)
    before = problem.snapshot()
    with pytest.raises(ValueError, match="the losses do not depend on the shared parameters"):
        optimizer.step(lambda: torch.ones(8, 3, dtype=torch.float64, requires_grad=True))
    assert_unchanged(problem, before)
    assert optimizer.steps_taken == 0


def test_sw11_the_balancer_refuses_such_losses_from_a_closure(toy) -> None:
    problem = toy()
    balancer = drmoo.Balancer("mgda", problem.shared, 3, backend="reference")
    with pytest.raises(ValueError, match="the losses do not depend on the shared parameters"):
        balancer.backward(lambda: torch.ones(8, 3, dtype=torch.float64, requires_grad=True))
    assert problem.A.grad is None


def test_sw11_losses_that_reach_only_some_shared_parameters_are_still_accepted(toy) -> None:
    """An unused parameter is a zero gradient, not an error: only losses that reach none are refused."""
    problem = toy()
    unused = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    optimizer = create("mgda", [*problem.shared, unused], 3, backend="reference")
    optimizer.step(problem.closure(1))
    assert optimizer.steps_taken == 1


# ------------------------------------------------------------------------------- U-4: clear messages
def test_u4_losses_on_another_device_name_both_devices(toy) -> None:
    _, optimizer = build(toy, "double-clip")
    with pytest.raises(ValueError, match="losses on meta, but the shared parameters are on cpu"):
        optimizer.step(lambda: torch.ones(8, 3, device="meta", requires_grad=True))


def test_u4_moco_after_a_requires_grad_toggle_is_a_clear_error(toy) -> None:
    problem = toy()
    optimizer = MoCo(problem.shared, 3, backend="reference")
    optimizer.step(problem.closure(1))
    problem.c.requires_grad_(False)
    with pytest.raises(ValueError, match=r"MoCo tracks the Jacobian of 24 shared entries, .* now hold 20"):
        optimizer.step(problem.closure(2))


def test_u4_add_param_group_refuses_another_dtype(toy) -> None:
    problem = toy(dtype=torch.float32)
    optimizer = create("double-clip", [problem.A], 3)
    with pytest.raises(ValueError, match=r"one device and dtype .*torch\.float32.*torch\.float64"):
        optimizer.add_param_group({"params": [torch.zeros(3, dtype=torch.float64, requires_grad=True)]})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("num_tasks", [10**20, 5000, 0])
def test_u4_an_absurd_task_count_is_a_clear_value_error(toy, num_tasks: int) -> None:
    problem = toy()
    with pytest.raises(ValueError, match=rf"num_tasks must be an int in \[1, 4096\], got {num_tasks}"):
        create("double-clip", problem.shared, num_tasks)


# ---------------------------------------------------------------------------------------------- U-5
def test_u5_a_non_finite_step_names_the_iteration_that_failed(toy) -> None:
    problem, optimizer = build(toy, "double-clip")
    optimizer.step(problem.closure(1))
    with pytest.raises(NonFiniteStepError, match=r"in iteration 2 \(counted from 1; 1 completed before it\)"):
        optimizer.step(lambda: problem.losses(torch.arange(8)) * float("nan"))


def test_u5_a_lock_held_under_a_dead_pid_says_so(tmp_path: Path) -> None:
    """The pid in train.lock is the taker's; a leftover child that inherited the lock can outlive it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)
    _refused_while_held(tmp_path, pid, rf"pid {pid}, .*no longer exists")


def test_u5_a_lock_held_by_a_live_process_names_it(tmp_path: Path) -> None:
    _refused_while_held(tmp_path, os.getpid(), rf"in use by another drmoo process \(pid {os.getpid()},")


def _refused_while_held(run_dir: Path, recorded_pid: int, message: str) -> None:
    """Hold the run's lock (as this process) with ``recorded_pid`` written in it: run_lock must refuse."""
    holder = os.open(run_dir / store.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, f"{recorded_pid}\n".encode())
        with pytest.raises(store.RunLockedError, match=message):
            with store.run_lock(run_dir):
                pass
    finally:
        os.close(holder)


def test_u5_a_corrupt_eval_json_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "run" / "eval.json"
    path.parent.mkdir()
    path.write_text('{"results": [')
    with pytest.raises(store.UsageError, match=rf"^{path}: refused: not valid JSON"):
        store.read_json(path, what="evaluation")
