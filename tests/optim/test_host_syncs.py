"""One host read per eager step, at most; none with ``capturable=True``.

A host read (sync) makes the host wait for the device: on a GPU each one stalls the launch queue.  An
eager step's NaN/Inf guards used to read one flag each (5 to 16 reads a step; Double-Loop 16); they now
OR into one device-side flag that the step reads once, just before its first write that cannot be
undone (or at its end), and only a failing step looks at which guard failed, to name it.

The reads are counted without a GPU: the step runs inside a ``TorchDispatchMode`` that counts every
operator handing a tensor's value to the host -- ``bool(t)``, ``t.item()``, ``float(t)``, ``int(t)`` and
``if t:`` all dispatch ``aten._local_scalar_dense`` in torch 2.x -- with ``aten.is_nonzero``,
``aten.item``, ``aten.equal``, ``aten.nonzero``, ``aten.masked_select`` and boolean-mask indexing, and with
``Tensor.tolist`` / ``Tensor.numpy`` (which read a CPU tensor's memory below the dispatcher) wrapped to
count too.  The step counted is the third: the first steps make one-time checks (the heads-as-shared check,
the ranks' agreement on the problem).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import drmoo
from drmoo.optim import NonFiniteStepError, available, create
from drmoo.optim._loss_scale import divide_, times

aten = torch.ops.aten

METHODS = sorted(available())
NO_FEATURES = {"moco"}  # its tracked Jacobian averages rows over batches: refused in features mode
MODES = ("parameters", "features")
APIS = ("step", "balancer")
# Constructor arguments that make every method's step short and every code path a steady step takes.
EXTRA: dict[str, dict[str, Any]] = {
    "double-loop": {"inner_steps": 3, "seed": 3},
    "nashmtl": {"update_every": 1, "solver_iters": 20},
}
CASES = [(method, mode, api) for method in METHODS for mode in MODES for api in APIS
         if not (mode == "features" and method in NO_FEATURES)]
WARMUP_STEPS = 2


class SyncCounter(TorchDispatchMode):
    """Counts the operators that read a tensor's value on the host (the module docstring)."""

    READS = frozenset({aten._local_scalar_dense, aten.is_nonzero, aten.item, aten.equal, aten.nonzero,
                       aten.masked_select})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func.overloadpacket
        if packet in self.READS or (packet is aten.index and any(
                isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in (args[1] if len(args) > 1 else []))):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    counter = SyncCounter()

    def counted(name: str) -> Callable[..., Any]:
        original = getattr(Tensor, name)

        def read(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.reads.append(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        patch.setattr(Tensor, "tolist", counted("tolist"))
        patch.setattr(Tensor, "numpy", counted("numpy"))
        with counter:
            yield counter


class Driver:
    """One method on the toy problem, driven through one API in one Jacobian mode."""

    def __init__(self, problem: Any, method: str, mode: str, api: str, *,
                 scaler: torch.amp.GradScaler | None = None, **hparams: Any) -> None:
        self.problem, self.mode, self.api, self.scaler = problem, mode, api, scaler
        self.draw = problem.batches(1)
        self.poison: Callable[[Tensor], Tensor] | None = None
        hparams = {"lr": 0.05, **EXTRA.get(method, {}), **hparams}
        if api == "step":
            self.optimizer = create(method, problem.shared, problem.num_tasks, jacobian=mode, **hparams)
        else:
            self.balancer = drmoo.Balancer(method, problem.shared, problem.num_tasks, jacobian=mode, **hparams)
            self.optimizer = self.balancer.algorithm

    def _batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        problem = self.problem
        z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
        losses = (z @ problem.H - problem.targets[rows]) ** 2
        return (losses if self.poison is None else self.poison(losses)), z

    def step(self) -> None:
        """One step: the optimizer's ``step(closure)``, or the Balancer's ``backward`` on one batch."""
        if self.api == "balancer":
            losses, z = self._batch(self.draw())
            if self.mode == "features":
                self.balancer.backward(losses, features=z, scaler=self.scaler)
            else:
                self.balancer.backward(losses, scaler=self.scaler)
            return
        if self.mode == "parameters":  # a fresh batch at every call, as the closure protocol asks
            self.optimizer.step(lambda: self._batch(self.draw())[0])
            return
        rows = self.draw()
        cached: list[tuple[Tensor, Tensor]] = []

        def closure() -> tuple[Tensor, Tensor]:  # features mode: the step's one batch (one z) at every call
            if cached and torch.is_grad_enabled():
                return cached[0]
            batch = self._batch(rows)
            if torch.is_grad_enabled():
                cached.append(batch)
            return batch

        self.optimizer.step(closure)


def steady_step_reads(driver: Driver, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    for _ in range(WARMUP_STEPS):
        driver.step()
    with counting_syncs(monkeypatch) as counter:
        driver.step()
    return counter.reads


def test_the_counter_counts_every_kind_of_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.tensor([1.0, 2.0])
    reads = [lambda: t[0].item(), lambda: bool(t[0]), lambda: float(t[0]), lambda: int(t[0]), lambda: t.tolist(),
             lambda: torch.equal(t, t), lambda: t.nonzero(), lambda: t[t > 1], lambda: t.numpy(),
             lambda: bool((t > 1).all())]
    for read in reads:
        with counting_syncs(monkeypatch) as counter:
            read()
        assert len(counter.reads) == 1, counter.reads
    with counting_syncs(monkeypatch) as counter:  # and device-side work is not counted
        torch.where(t > 1, t, 0.0).sum().sqrt()
    assert counter.reads == []


@pytest.mark.parametrize(("method", "mode", "api"), CASES)
def test_an_eager_step_reads_the_host_once_at_most(toy, monkeypatch, method: str, mode: str, api: str) -> None:
    reads = steady_step_reads(Driver(toy(), method, mode, api), monkeypatch)
    assert len(reads) <= 1, f"{method} {mode} {api}: {len(reads)} host reads in one eager step: {reads}"


@pytest.mark.parametrize(("method", "mode", "api"), CASES)
def test_a_capturable_step_reads_nothing(toy, monkeypatch, method: str, mode: str, api: str) -> None:
    driver = Driver(toy(), method, mode, api, capturable=True)
    reads = steady_step_reads(driver, monkeypatch)
    assert reads == [], f"{method} {mode} {api} (capturable): {reads}"
    assert driver.optimizer.steps_taken == WARMUP_STEPS + 1


@pytest.mark.parametrize(("method", "mode", "api"), CASES)
def test_a_non_finite_eager_step_still_names_the_losses_and_changes_nothing(toy, monkeypatch, method: str,
                                                                            mode: str, api: str) -> None:
    """The one read stops a NaN step before anything is written, and the message names what was non-finite."""
    problem = toy()
    driver = Driver(problem, method, mode, api)
    for _ in range(WARMUP_STEPS):
        driver.step()
    before = problem.snapshot()
    state = {key: value.clone() if isinstance(value, Tensor) else value
             for key, value in driver.optimizer.state["drmoo"].items()}
    driver.poison = lambda losses: losses * torch.tensor([1.0, float("nan"), 1.0], dtype=losses.dtype)
    with pytest.raises(NonFiniteStepError, match=r"non-finite \(NaN or Inf\) per-sample losses for task\(s\) \[1\]"):
        driver.step()
    assert all(torch.equal(got, want) for got, want in zip(problem.snapshot()[:2], before[:2])), "theta moved"
    for key, want in state.items():
        got = driver.optimizer.state["drmoo"][key]
        assert torch.equal(got, want) if isinstance(want, Tensor) else got == want, f"{key} changed"


@pytest.mark.parametrize(("method", "mode"), [(method, mode) for method, mode, api in CASES if api == "balancer"])
def test_a_balancer_step_under_a_grad_scaler_reads_the_host_once(
        toy: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, method: str, mode: str) -> None:
    """An enabled GradScaler's scale multiplies every backward pass and divides the gradients back as a 0-d
    tensor on the device: read as a float before the passes, it was a second host read in every step."""
    driver = Driver(toy(), method, mode, "balancer", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    reads = steady_step_reads(driver, monkeypatch)
    assert len(reads) == 1, f"{method} {mode} (GradScaler): {len(reads)} host reads in one eager step: {reads}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_a_scale_tensor_applies_as_the_float_did_without_a_read(monkeypatch: pytest.MonkeyPatch,
                                                                dtype: torch.dtype) -> None:
    """Times 2^16 and back, as the float 65536.0 did, in every dtype (fp16's largest finite value is 65504)."""
    values = torch.tensor([0.5, -0.25, 1e-4, 0.0], dtype=dtype)
    scale = torch.tensor(2.0**16)
    with counting_syncs(monkeypatch) as counter:
        scaled = times(values, scale)
        back = divide_(scaled.clone(), scale)
    assert counter.reads == []
    assert scaled.dtype == dtype and torch.equal(scaled, values * 2.0**16)
    assert torch.equal(back, values)


# Other code paths a steady eager step can take (parameters mode, step(closure)).
VARIANTS = [
    ("mgda", {"solver": "min_norm"}),
    ("double-clip", {"resample": False}),
    ("double-loop", {"inner_steps": 5, "seed": 3}),  # Double-Loop's default inner loop: 15 reads a step before
    ("nashmtl", {"update_every": 2, "solver_iters": 20}),  # the checked step (the third) reuses alpha
]


@pytest.mark.parametrize(("method", "extra"), VARIANTS, ids=[f"{m}-{e}" for m, e in VARIANTS])
def test_other_code_paths_read_the_host_once_at_most(toy, monkeypatch, method: str, extra: dict) -> None:
    problem = toy()
    optimizer = create(method, problem.shared, problem.num_tasks, lr=0.05, **extra)
    draw = problem.batches(1)
    for _ in range(WARMUP_STEPS):
        optimizer.step(lambda: problem.losses(draw()))
    with counting_syncs(monkeypatch) as counter:
        optimizer.step(lambda: problem.losses(draw()))
    assert len(counter.reads) <= 1, counter.reads


def test_sample_weights_and_famos_same_batch_form_read_once(toy, monkeypatch) -> None:
    """The weights' validity is one more guard read with the others; FAMO's same-batch form steps theta
    before re-evaluating the batch, and reads its guards (the re-evaluation's too) once, after it."""
    problem = toy()
    weighted = create("mgda", problem.shared, problem.num_tasks, lr=0.05)
    draw = problem.batches(1)
    closure = lambda: (problem.losses(draw()), torch.ones(problem.batch_size, problem.num_tasks,  # noqa: E731
                                                           dtype=problem.A.dtype))
    famo = create("famo", problem.shared, problem.num_tasks, lr=0.05)
    last: list[Tensor] = []

    def same_batch_closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = [draw()]
        return problem.losses(last[0])

    for optimizer, drawing in ((weighted, closure), (famo, same_batch_closure)):
        for _ in range(WARMUP_STEPS):
            optimizer.step(drawing)
        with counting_syncs(monkeypatch) as counter:
            optimizer.step(drawing)
        assert len(counter.reads) <= 1, (type(optimizer).__name__, counter.reads)


def test_a_non_finite_re_evaluation_still_restores_theta_and_eta(toy) -> None:
    """FAMO's same-batch form: theta and eta were stepped, then the re-evaluated losses are NaN: the one
    read after the re-evaluation raises naming them, and theta and eta are as before the step."""
    problem = toy()
    famo = create("famo", problem.shared, problem.num_tasks, lr=0.05)
    draw = problem.batches(1)
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = [draw()]
            return problem.losses(last[0])
        return problem.losses(last[0]) * float("nan")

    before, eta = problem.snapshot(), famo.eta.clone()
    with pytest.raises(NonFiniteStepError, match=r"per-sample losses for task\(s\) \[0, 1, 2\] in iteration 1 "):
        famo.step(closure)
    assert all(torch.equal(got, want) for got, want in zip(problem.snapshot()[:2], before[:2]))
    assert torch.equal(famo.eta, eta) and famo.steps_taken == 0


@pytest.mark.parametrize("method", ["modo", "double-loop"])
def test_a_failed_guard_wins_over_an_error_met_after_it(toy, method: str) -> None:
    """The guards are read late, but a step still fails where it met its first NaN: a closure that breaks
    on a later call (after a NaN batch) reports the NaN, as when each guard was read at once."""
    problem = toy()
    optimizer = create(method, problem.shared, problem.num_tasks, lr=0.05, **EXTRA.get(method, {}))
    draw = problem.batches(1)
    for _ in range(WARMUP_STEPS):  # past the first steps' one-time checks, which read the host at once
        optimizer.step(lambda: problem.losses(draw()))
    calls: list[int] = []

    def closure() -> Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the data loader broke")
        return problem.losses(draw()) * float("nan")

    with pytest.raises(NonFiniteStepError, match="non-finite"):
        optimizer.step(closure)
    assert len(calls) == 2, "the case this test is about: the NaN guard was still unread at the second draw"


def test_a_non_finite_first_step_does_not_settle_the_heads_as_shared_check(toy) -> None:
    """The heads-as-shared check reads the first Jacobians; a step whose losses are NaN must not pass it
    (a NaN row reaches every parameter): it reads the step's guards first, and the next step still refuses."""
    problem = toy()
    heads = [problem.H[:, task].detach().clone().requires_grad_() for task in range(problem.num_tasks)]
    draw = problem.batches(1)

    def losses() -> Tensor:
        rows = draw()
        z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
        return torch.stack([(z @ head - problem.targets[rows, task]) ** 2 for task, head in enumerate(heads)], 1)

    optimizer = create("mgda", [problem.A, problem.c, *heads], problem.num_tasks, lr=0.05)
    with pytest.raises(NonFiniteStepError):
        optimizer.step(lambda: losses() * float("nan"))
    with pytest.raises(ValueError, match="looks like a task-specific head"):
        optimizer.step(losses)


@pytest.mark.parametrize("api", APIS)
def test_pieces_of_z_that_are_disjoint_views_of_one_tensor_read_the_host_once(toy, monkeypatch, api: str) -> None:
    """``features=(z[:, :2], z[:, 2:])``: the duplicate-features check (SW-25) compared such views element by
    element on the host at every step: 2 reads a step with step(closure), 3 with the Balancer (which checks z
    twice); overlap is a property of the views' layouts, decided without reading a value."""
    problem = toy()
    draw = problem.batches(1)

    def batch() -> tuple[Tensor, tuple[Tensor, ...]]:
        rows = draw()
        z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
        pieces = (z[:, :2], z[:, 2:])  # interleaved in z's memory, sharing no element
        return (pieces[0] @ problem.H[:2] + pieces[1] @ problem.H[2:] - problem.targets[rows]) ** 2, pieces

    balancer = drmoo.Balancer("mgda", problem.shared, problem.num_tasks, jacobian="features", lr=0.05)
    optimizer = create("mgda", problem.shared, problem.num_tasks, jacobian="features", lr=0.05)

    def step() -> None:
        losses, pieces = batch()
        if api == "balancer":
            balancer.backward(losses, features=pieces)
        else:
            def closure() -> Any:  # the step's one batch (one z) at every call; z as its pieces
                return losses, pieces

            optimizer.step(closure)

    for _ in range(WARMUP_STEPS):
        step()
    with counting_syncs(monkeypatch) as counter:
        step()
    assert len(counter.reads) == 1, counter.reads


def test_ranks_agree_on_the_losses_without_a_host_to_device_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every data-parallel step (capturable included) agrees on the losses' finite flags and the shard size B in
    one collective; its payload is built on the device -- a tensor made from host numbers (``aten.lift_fresh``)
    would be a blocking host-to-device copy in every step on a GPU."""
    from drmoo.optim import _agreement

    monkeypatch.setattr(_agreement.distributed, "all_reduce_max", lambda values: values)  # one rank
    losses, finite = torch.ones(5, 3), torch.tensor([True, False, True])

    class FromHost(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy, aten.scalar_tensor):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with FromHost() as from_host:
        flags, rows = _agreement.agree_on_losses(losses, finite)
    assert from_host.ops == []
    assert flags.tolist() == [True, False, True] and rows.tolist() == [5, -5]


@pytest.mark.parametrize("num_tasks", [2, 3, 8])
@pytest.mark.parametrize(("mode", "api"), [(mode, api) for mode in MODES for api in APIS])
@pytest.mark.parametrize("capturable", [False, True])
def test_min_norm_up_to_the_face_enumeration_reads_once(toy, monkeypatch, num_tasks: int, mode: str, api: str,
                                                        capturable: bool) -> None:
    """MGDA's exact weights for m <= 10 (the closed form, or every face in one batched solve) are found on the
    device: the step's one read is its guards' verdict, in features mode as in parameters mode."""
    driver = Driver(toy(num_tasks=num_tasks), "mgda", mode, api, solver="min_norm", capturable=capturable)
    reads = steady_step_reads(driver, monkeypatch)
    assert len(reads) == (0 if capturable else 1), reads


@pytest.mark.parametrize("clip", [{}, {"clip_c1": 1.0, "clip_c2": 0.05}], ids=["no-clip", "clip"])
@pytest.mark.parametrize(("mode", "api"), [(mode, api) for mode in MODES for api in APIS])
@pytest.mark.parametrize("capturable", [False, True])
def test_min_norm_above_the_face_enumeration_reads_once(toy, monkeypatch, mode: str, api: str, capturable: bool,
                                                        clip: dict[str, float]) -> None:
    """MGDA's exact weights for m > 10 (Wolfe's active set): eagerly the Gram reaches the host in the step's one
    read, with the guards' verdict, and the walk stops there once exact (it read a "done" flag every 8 steps on
    the device: 6 reads at m = 40); capturable, a fixed count of steps on the device and no read.  With the
    clip, the theta Gram rides in the same read and the clip's factor is taken on the host (on the device it was
    one more guard to read before theta is written: 2 reads).

    Features mode reads once more, and must: the trunk's gradients are lifted from the rows with the weights the
    host found, after the read that gave it the Gram, and a NaN/Inf they carry (a bad parameter, an overflow in
    the trunk's backward) must stop the step before theta (or ``.grad``) is written -- a second read, whatever
    is folded into the first.  Only a solve on the device avoids it (``capturable=True``), or writing them
    untested (``check_trunk_gradients=False``, the test below)."""
    driver = Driver(toy(num_tasks=14), "mgda", mode, api, solver="min_norm", capturable=capturable,
                    features_rate_chosen=True, **clip)
    reads = steady_step_reads(driver, monkeypatch)
    assert len(reads) == (0 if capturable else 1 if mode == "parameters" else 2), reads


@pytest.mark.parametrize("api", APIS)
def test_min_norm_above_the_face_enumeration_without_the_trunk_check_reads_once(toy, monkeypatch, api: str) -> None:
    """Features mode's second read above is the trunk gradients' NaN/Inf test: with ``check_trunk_gradients``
    off the lifted gradients are written unread, and the step's one read is the Gram's with the guards'."""
    driver = Driver(toy(num_tasks=14), "mgda", "features", api, solver="min_norm", features_rate_chosen=True)
    driver.optimizer.check_trunk_gradients = False
    reads = steady_step_reads(driver, monkeypatch)
    assert len(reads) == 1, reads


ACCUMULATING = [(method, mode) for method in ("famo", "mgda", "moco", "modo", "nashmtl", "sdmgrad") for mode in MODES
                if not (mode == "features" and method in NO_FEATURES)]


@pytest.mark.parametrize(("method", "mode"), ACCUMULATING)
def test_a_micro_batch_reads_the_host_once(toy, monkeypatch, method: str, mode: str) -> None:
    """``backward(losses, accumulate=True)`` runs outside a step, where each guard was read where it was met: the
    losses', then the dual statistics' (2 reads per micro-batch).  They are read together, once; the step that
    closes the accumulation reads once, as any step."""
    driver = Driver(toy(), method, mode, "balancer", **({"nashmtl": {"solver_iters": 20}}.get(method, {})))
    balancer = driver.balancer

    def micro_batch() -> None:
        losses, z = driver._batch(driver.draw())
        balancer.backward(losses, features=z if mode == "features" else None, accumulate=True)

    for _ in range(WARMUP_STEPS):
        micro_batch()
        driver.step()
    with counting_syncs(monkeypatch) as counter:
        micro_batch()
    assert len(counter.reads) == 1, counter.reads
    with counting_syncs(monkeypatch) as counter:
        driver.step()
    assert len(counter.reads) == 1, counter.reads


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_micro_batch_still_raises_naming_its_losses_and_keeps_nothing(toy, mode: str) -> None:
    """The micro-batch's guards are read once, after its backward passes: a NaN micro-batch still raises naming
    the losses (not the dual statistics its NaN reached next) and adds nothing to the accumulation."""
    driver = Driver(toy(), "mgda", mode, "balancer")
    balancer = driver.balancer
    losses, z = driver._batch(driver.draw())
    balancer.backward(losses, features=z if mode == "features" else None, accumulate=True)
    pending = balancer._accumulation
    assert pending is not None and pending.micro_batches == 1
    kept = pending.jacobian.clone()
    losses, z = driver._batch(driver.draw())
    poisoned = losses * torch.tensor([1.0, float("nan"), 1.0], dtype=losses.dtype)
    with pytest.raises(NonFiniteStepError, match=r"non-finite \(NaN or Inf\) per-sample losses for task\(s\) \[1\]"):
        balancer.backward(poisoned, features=z if mode == "features" else None, accumulate=True)
    assert pending.micro_batches == 1 and torch.equal(pending.jacobian, kept)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("poisoned", [None, 0, 2], ids=["finite", "nan-first", "nan-last"])
def test_a_step_on_a_closures_micro_batches_reads_the_host_once(toy, monkeypatch, mode: str,
                                                                poisoned: int | None) -> None:
    """``step(closure)`` with a closure yielding 3 micro-batches: the first two are reduced inside the step, and
    their guards join the step's (they were read as each was reduced: 3 reads a step); a NaN in any micro-batch
    still stops the step before anything is written, naming the losses."""
    problem = toy()
    optimizer = create("mgda", problem.shared, problem.num_tasks, jacobian=mode, lr=0.05)
    draw = problem.batches(1)
    nan_in: list[int | None] = [None]

    def closure() -> Any:
        def micro_batches() -> Any:
            for index in range(3):
                rows = draw()
                z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
                losses = (z @ problem.H - problem.targets[rows]) ** 2
                if index == nan_in[0]:
                    losses = losses * torch.tensor([1.0, float("nan"), 1.0], dtype=losses.dtype)
                yield (losses, z) if mode == "features" else losses
        return micro_batches()

    for _ in range(WARMUP_STEPS):
        optimizer.step(closure)
    before, state = problem.snapshot(), (optimizer.eta.clone(), optimizer.w.clone(), optimizer.steps_taken)
    nan_in[0] = poisoned
    with counting_syncs(monkeypatch) as counter:
        if poisoned is None:
            optimizer.step(closure)
        else:
            with pytest.raises(NonFiniteStepError, match=r"per-sample losses for task\(s\) \[1\]"):
                optimizer.step(closure)
    if poisoned is None:
        assert len(counter.reads) == 1, counter.reads
        return
    assert all(torch.equal(got, want) for got, want in zip(problem.snapshot()[:2], before[:2])), "theta moved"
    assert torch.equal(optimizer.eta, state[0]) and torch.equal(optimizer.w, state[1])
    assert optimizer.steps_taken == state[2]
