"""Gradient accumulation in ``step(closure)``: a closure that yields its batch in micro-batches gives the step
of a closure returning the whole batch.

The reference returns each draw's batch (64 rows) whole; the accumulated run yields the same rows in
micro-batches (4 x 16, then 10 + 30 + 4 + 20, then 5 + 59), for 3 steps of the optimizer itself (theta
written by the step).  Every draw is a fresh batch from the same stream in both runs, so MoDo's and
SDMGrad's three batches, and FAMO's re-evaluation of its batch, are compared draw by draw.

Tolerance, from float64 rounding.  Both runs compute the same finite sums over the batch's samples
(means of the dual statistics, per-task gradients, heads' gradients), only grouped differently (per
micro-batch, then across them).  Two groupings of a sum of N terms differ by at most 2 gamma_N times the
terms' absolute sum (gamma_N = N u / (1 - N u), u = 2^-53; Higham, eq. 4.4): here N <= 64 samples x 2
tasks x 14 factors along the net, 2 gamma_N < 4e-13 relative to sums of O(1) terms (inputs, weights
and losses are O(1)); the m x m solves (min-norm, Nash-MTL's) amplify it by the Gram's condition
number (< 1e3 here), and three steps carry it forward.  rtol 1e-10 (atol 1e-12 for entries near 0)
covers that with a margin and sits far below the 1e-3 an algorithmic difference shows (asserted by
``test_separate_steps_per_micro_batch_are_a_different_step``).  Measured: at most ~2e-15.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import drmoo
from drmoo.optim import NonFiniteStepError, create

from .test_accumulate import ACCEPTED

M = 2
LR = 0.05
BATCH = 64
STEPS = 3
SPLITS = ([16, 16, 16, 16], [10, 30, 4, 20], [5, 59])  # per step; unequal sizes from step 2
RTOL, ATOL = 1e-10, 1e-12

# ACCEPTED (the Balancer's accumulate mode's methods and hyperparameters) is the closure form's set too.
FEATURES_CASES = [case for case in ACCEPTED if case != "moco"]  # MoCo does not run in features mode


class TwoTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double()
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(M)]).double()

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample losses [B, 2] and the features z they read."""
        z = self.trunk(x)
        return (torch.cat([head(z) for head in self.heads], dim=1) - y) ** 2, z


def batches(seed: int = 1) -> Iterator[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(BATCH, 4, generator=generator, dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)
        yield x, y + 0.1 * torch.randn(BATCH, M, generator=generator, dtype=torch.float64)


WEIGHT = torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64)[:, None].expand(BATCH, M)


class Draws:
    """The closure of one run: each call (same_batch=False) draws the stream's next batch, whole or in
    micro-batches (``sizes``); ``same_batch=True`` (FAMO's re-evaluation) gives the last batch again, in
    the same form.  ``features``: each draw also gives z, and a step's later draws with a graph return its
    first draw itself (features mode's one batch per step).  ``lazy``: each micro-batch a callable."""

    def __init__(self, model: TwoTaskNet, *, features: bool, weighted: bool, lazy: bool = False) -> None:
        self.model, self.stream, self.features, self.weighted, self.lazy = model, batches(), features, weighted, lazy
        self.sizes: list[int] | None = None
        self.batch: tuple[Tensor, Tensor] | None = None
        self.first: Any = None  # features mode: the step's first draw

    def start_step(self, sizes: list[int] | None) -> None:
        self.sizes, self.first = sizes, None

    def one(self, rows: Tensor) -> Any:
        assert self.batch is not None
        x, y = self.batch
        losses, z = self.model.losses(x[rows], y[rows])
        parts = (losses, z) if self.features else (losses,)
        parts = (*parts, WEIGHT[rows]) if self.weighted else parts
        return parts[0] if len(parts) == 1 else parts

    def __call__(self, same_batch: bool = False) -> Any:
        if self.features and self.first is not None and not same_batch:
            return self.first
        if not same_batch:
            self.batch = next(self.stream)
        if self.sizes is None:
            drawn = self.one(torch.arange(BATCH))
        elif self.lazy:
            drawn = [lambda rows=rows: self.one(rows) for rows in torch.arange(BATCH).split(self.sizes)]
        else:
            drawn = (self.one(rows) for rows in torch.arange(BATCH).split(self.sizes))
        if self.features and not same_batch:
            self.first = drawn
        return drawn


def run(case: str, *, accumulate: bool, features: bool = False, weighted: bool = False, same_batch: bool = False,
        lazy: bool = False, splits: tuple[list[int], ...] = SPLITS) -> dict[str, Any]:
    """STEPS steps of the optimizer, each draw whole or in micro-batches; what the step leaves after each."""
    name, hparams = ACCEPTED[case]
    model = TwoTaskNet()
    mode: dict[str, Any] = {"jacobian": "features"} if features else {}
    if features and name in ("mgda", "nashmtl"):
        mode["features_rate_chosen"] = True
    optimizer = create(name, model.trunk.parameters(), M, lr=LR, lam=0.8, **hparams, **mode)
    draws = Draws(model, features=features, weighted=weighted, lazy=lazy)
    closure: Callable[..., Any] = draws if same_batch else lambda: draws()
    record: dict[str, list[Any]] = {"theta": [], "heads": [], "eta": [], "w": [], "steps": [], "objective": []}
    for step in range(STEPS):
        model.heads.zero_grad(set_to_none=True)
        draws.start_step(splits[step] if accumulate else None)
        objective = optimizer.step(closure)
        record["theta"].append([p.detach().clone() for p in model.trunk.parameters()])
        record["heads"].append([p.grad.clone() for p in model.heads.parameters()])
        record["eta"].append(optimizer.eta.clone())
        record["w"].append(optimizer.w.clone())
        record["steps"].append(optimizer.steps_taken)
        record["objective"].append(objective.clone())
        assert optimizer.accumulation is None and optimizer.drawn_micro_batches is None  # nothing outlives the step
    record["state"] = optimizer.state_dict()["state"]["drmoo"]
    return record


def largest_difference(full: dict[str, Any], micro: dict[str, Any]) -> float:
    pairs = [(a, b) for key in ("theta", "heads") for step in range(STEPS)
             for a, b in zip(full[key][step], micro[key][step])]
    pairs += [(full[key][step], micro[key][step]) for key in ("eta", "w", "objective") for step in range(STEPS)]
    return max(float((a - b).abs().max()) for a, b in pairs)


def assert_full_batch_step(full: dict[str, Any], micro: dict[str, Any]) -> None:
    assert micro["steps"] == full["steps"] == [1, 2, 3]  # one step per call, whatever the micro-batches
    for key in ("theta", "heads"):
        for step in range(STEPS):
            for a, b in zip(full[key][step], micro[key][step]):
                torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL,
                                           msg=lambda text, key=key, step=step: f"{key} {step}: {text}")
    for key in ("eta", "w", "objective"):
        for step in range(STEPS):
            torch.testing.assert_close(micro[key][step], full[key][step], rtol=RTOL, atol=ATOL)
    for key, value in full["state"].items():  # the method's own state (MoCo's tracking, FAMO's logits, ...)
        if isinstance(value, Tensor) and value.is_floating_point():
            torch.testing.assert_close(micro["state"][key], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda text, key=key: f"{key}: {text}")
        else:
            assert micro["state"][key] == value


# ----------------------------------------------------------------------------- the full-batch step
@pytest.mark.parametrize("case", list(ACCEPTED))
def test_micro_batches_give_the_full_batch_step(case: str) -> None:
    assert_full_batch_step(run(case, accumulate=False), run(case, accumulate=True))


@pytest.mark.parametrize("case", FEATURES_CASES)
def test_micro_batches_give_the_full_batch_step_in_features_mode(case: str) -> None:
    full, micro = run(case, accumulate=False, features=True), run(case, accumulate=True, features=True)
    assert_full_batch_step(full, micro)


@pytest.mark.parametrize("features", [False, True], ids=["parameters", "features"])
def test_famos_same_batch_form_reevaluates_the_batch_in_micro_batches(features: bool) -> None:
    full = run("famo", accumulate=False, features=features, same_batch=True)
    micro = run("famo", accumulate=True, features=features, same_batch=True)
    assert_full_batch_step(full, micro)
    assert float(micro["state"]["pending"]) == 0.0  # the same-batch form ran (no deferred logit update)


@pytest.mark.parametrize("case", ["mgda", "famo"])  # a Jacobian-forming method and the combined-gradient one
def test_importance_weighted_micro_batches_give_the_full_batch_step(case: str) -> None:
    assert_full_batch_step(run(case, accumulate=False, weighted=True), run(case, accumulate=True, weighted=True))


def test_callable_micro_batches_give_the_full_batch_step() -> None:
    assert_full_batch_step(run("modo", accumulate=False), run("modo", accumulate=True, lazy=True))


def test_one_micro_batch_is_the_one_tensor_closure_bit_for_bit() -> None:
    full, one = run("mgda", accumulate=False), run("mgda", accumulate=True, splits=([BATCH],) * STEPS)
    assert largest_difference(full, one) == 0.0


def test_separate_steps_per_micro_batch_are_a_different_step() -> None:
    """What the tolerance guards against: a step per micro-batch (the naive loop) is off by far more."""
    full = run("mgda", accumulate=False)
    model = TwoTaskNet()
    optimizer = create("mgda", model.trunk.parameters(), M, lr=LR / 4, lam=0.8, pref_lr=0.3)
    x, y = next(batches())
    for rows in torch.arange(BATCH).split(16):
        optimizer.step(lambda rows=rows: model.losses(x[rows], y[rows])[0])
    difference = max(float((a - b.detach()).abs().max()) for a, b in zip(full["theta"][0], model.trunk.parameters()))
    assert difference > 1e-3


def test_a_callable_micro_batch_is_evaluated_once_the_one_before_is_freed() -> None:
    """Callable micro-batches: one graph at a time (the earlier micro-batch's losses are gone when the next is
    computed); the whole step still sees every micro-batch."""
    model = TwoTaskNet()
    optimizer = create("mgda", model.trunk.parameters(), M, lr=LR, lam=0.8)
    x, y = next(batches())
    alive: list[bool] = []
    earlier: list[weakref.ref[Tensor]] = []

    def micro_batch(rows: Tensor) -> Tensor:
        alive.extend(ref() is not None for ref in earlier)
        losses = model.losses(x[rows], y[rows])[0]
        earlier.append(weakref.ref(losses))
        return losses

    optimizer.step(lambda: [lambda rows=rows: micro_batch(rows) for rows in torch.arange(BATCH).split(16)])
    assert len(earlier) == 4 and alive == [False] * 6  # 1 + 2 + 3 earlier micro-batches checked, all freed


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method", ["double-clip", "double-loop"])
def test_methods_that_cannot_accumulate_exactly_are_refused(method: str) -> None:
    model = TwoTaskNet()
    optimizer = create(method, model.trunk.parameters(), M, lr=LR)
    x, y = next(batches())
    before = [p.detach().clone() for p in model.trunk.parameters()]
    with pytest.raises(ValueError, match=r"cannot accumulate micro-batches exactly: .*eta.*; return the whole "
                                         r"batch's losses from the closure"):
        optimizer.step(lambda: (model.losses(x[rows], y[rows])[0] for rows in torch.arange(BATCH).split(16)))
    assert optimizer.steps_taken == 0 and all(torch.equal(a, b) for a, b in zip(before, model.trunk.parameters()))


def test_sharded_shared_parameters_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoTaskNet()
    optimizer = create("mgda", model.trunk.parameters(), M, lr=LR)
    monkeypatch.setattr("drmoo.optim._accumulate.is_sharded", lambda params: True)
    x, y = next(batches())
    with pytest.raises(ValueError, match=r"FSDP-sharded shared parameters: .*return the whole batch's losses from "
                                         r"the closure, or keep the trunk replicated"):
        optimizer.step(lambda: (model.losses(x[rows], y[rows])[0] for rows in torch.arange(BATCH).split(16)))


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host."""

    READS = frozenset({torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.item,
                       torch.ops.aten.equal, torch.ops.aten.nonzero})

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.reads += func.overloadpacket in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["mgda", "famo", "nashmtl"])
def test_capturable_steps_take_micro_batches_without_a_host_read(case: str) -> None:
    """capturable=True over micro-batches: the whole batch's step, no host read, and a non-finite micro-batch
    leaves the step undone on the device exactly as a non-finite whole batch does."""
    name, hparams = ACCEPTED[case]
    runs = []
    for accumulate in (False, True):
        model = TwoTaskNet()
        optimizer = create(name, model.trunk.parameters(), M, lr=LR, capturable=True, **hparams)
        stream = batches()
        for step in range(STEPS + 1):
            x, y = next(stream)
            bad = step == STEPS  # the last step's first micro-batch (or whole batch) is NaN

            def one(rows: Tensor, poisoned: bool, x: Tensor = x, y: Tensor = y, model: TwoTaskNet = model) -> Tensor:
                losses = model.losses(x[rows], y[rows])[0]
                return losses * math.nan if poisoned else losses

            if accumulate:
                def closure(x: Tensor = x, bad: bool = bad, one: Any = one) -> Any:
                    return [lambda rows=rows, i=i: one(rows, bad and i == 0)
                            for i, rows in enumerate(torch.arange(BATCH).split(16))]
            else:
                def closure(bad: bool = bad, one: Any = one) -> Any:
                    return one(torch.arange(BATCH), bad)
            counter = _HostReads()
            with counter:
                optimizer.step(closure)
            if step >= 1:
                assert counter.reads == 0, (case, accumulate, step)
        runs.append(([p.detach().clone() for p in model.trunk.parameters()], optimizer.w.clone(),
                     optimizer.steps_taken))
    (whole, w_whole, steps_whole), (micro, w_micro, steps_micro) = runs
    for a, b in zip(whole, micro, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(w_micro, w_whole, rtol=RTOL, atol=ATOL)
    assert steps_micro == steps_whole


def test_a_closure_that_yields_nothing_is_refused() -> None:
    model = TwoTaskNet()
    optimizer = create("mgda", model.trunk.parameters(), M, lr=LR)
    with pytest.raises(ValueError, match=r"returned no micro-batches \(an empty iterable\)"):
        optimizer.step(lambda: iter(()))
    assert optimizer.steps_taken == 0


def test_the_same_micro_batches_again_are_refused_in_parameters_mode() -> None:
    """MoDo draws three batches; in parameters mode each must be fresh (the first one's graphs are gone)."""
    model = TwoTaskNet()
    optimizer = create("modo", model.trunk.parameters(), M, lr=LR)
    x, y = next(batches())
    micro_batches = [model.losses(x[rows], y[rows])[0] for rows in torch.arange(BATCH).split(32)]
    with pytest.raises(ValueError, match="micro-batches of an earlier draw of this step again"):
        optimizer.step(lambda: micro_batches)
    assert optimizer.steps_taken == 0


def test_fresh_micro_batches_at_a_later_draw_are_refused_in_features_mode() -> None:
    model = TwoTaskNet()
    optimizer = create("modo", model.trunk.parameters(), M, lr=LR, jacobian="features")
    x, y = next(batches())
    with pytest.raises(ValueError, match=r"several independent batches .* the very iterable of micro-batches"):
        optimizer.step(lambda: (model.losses(x[rows], y[rows]) for rows in torch.arange(BATCH).split(16)))
    assert optimizer.steps_taken == 0


def test_a_non_finite_micro_batch_stops_the_step_and_changes_nothing() -> None:
    model = TwoTaskNet()
    optimizer = create("famo", model.trunk.parameters(), M, lr=LR)
    x, y = next(batches())
    optimizer.step(lambda: model.losses(x, y)[0])
    for head in model.heads.parameters():
        head.grad = torch.ones_like(head)
    saved = ([p.detach().clone() for p in model.parameters()], optimizer.eta.clone(), optimizer.w.clone(),
             {k: v.clone() if isinstance(v, Tensor) else v for k, v in optimizer.state["drmoo"].items()})
    poisoned = x.clone()
    poisoned[20] = float("nan")  # in the second of four micro-batches: reduced, not the step's own batch
    with pytest.raises(NonFiniteStepError, match="non-finite"):
        optimizer.step(lambda: (model.losses(poisoned[rows], y[rows])[0] for rows in torch.arange(BATCH).split(16)))
    assert optimizer.steps_taken == 1 and optimizer.accumulation is None
    assert all(torch.equal(a, b.detach()) for a, b in zip(saved[0], model.parameters()))
    assert all(torch.equal(head.grad, torch.ones_like(head)) for head in model.heads.parameters())
    assert torch.equal(optimizer.eta, saved[1]) and torch.equal(optimizer.w, saved[2])
    for key, value in saved[3].items():
        assert torch.equal(optimizer.state["drmoo"][key], value) if isinstance(value, Tensor) else \
            optimizer.state["drmoo"][key] == value


# ----------------------------------------------------------------------------- the Balancer's closure form
def test_the_balancers_closure_form_takes_micro_batches_too() -> None:
    """``Balancer.backward(closure)`` (the method's multi-batch form) runs the same step: micro-batches there give
    the whole batches' ``.grad``, eta and w."""
    results = []
    for sizes in (None, [10, 30, 24]):
        model = TwoTaskNet()
        balancer = drmoo.Balancer("modo", model.trunk.parameters(), M, lr=LR, pref_lr=0.3)
        stream = batches()

        def closure(sizes: list[int] | None = sizes, stream: Iterator[tuple[Tensor, Tensor]] = stream,
                    model: TwoTaskNet = model) -> Any:
            x, y = next(stream)
            if sizes is None:
                return model.losses(x, y)[0]
            return (model.losses(x[rows], y[rows])[0] for rows in torch.arange(BATCH).split(sizes))

        balancer.backward(closure)
        results.append(([p.grad.clone() for p in model.parameters()], balancer.eta.clone(), balancer.w.clone()))
    (grads, eta, w), (micro_grads, micro_eta, micro_w) = results
    for a, b in zip(grads, micro_grads):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(micro_eta, eta, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(micro_w, w, rtol=RTOL, atol=ATOL)
