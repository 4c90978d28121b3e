"""capturable=True: a steady-state step makes no host read, and a non-finite step is skipped on the device.

The host reads are caught without a GPU: the step runs inside a ``TorchDispatchMode`` that fails on
every operator that hands a tensor's value to the host (``_local_scalar_dense`` -- behind
``.item()``, ``bool()``, ``float()``, ``int()`` -- ``is_nonzero``, ``equal``, ``nonzero``, boolean-mask
indexing, copies between the host and the device), with ``Tensor.tolist`` / ``Tensor.numpy``
(which read memory directly, below the dispatcher) patched to fail too.  On a GPU, the last test
captures ``optimizer.step`` in a CUDA graph and checks that replays match eager steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from drmoo.optim import available, create
from drmoo_kernels import available_backends

aten = torch.ops.aten

# (method, constructor arguments): every method, and each code path a steady-state step can take.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("double-clip", {}),
    ("double-clip", {"resample": False}),
    ("double-loop", {"inner_steps": 3, "seed": 3}),
    ("mgda", {}),
    ("mgda", {"solver": "min_norm"}),
    ("modo", {}),
    ("moco", {}),
    ("sdmgrad", {}),
    ("nashmtl", {"update_every": 1, "solver_iters": 20}),  # weight-update steps
    ("nashmtl", {"update_every": 2, "solver_iters": 20}),  # step 2 (the checked one) reuses alpha
    ("famo", {}),
]
IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in e.items()) or 'default'}" for m, e in CASES]
CPU_BACKENDS = [b for b in ("reference", "cpp") if b in available_backends()]


class HostRead(AssertionError):
    """A step read a tensor's value on the host."""


class NoHostReads(TorchDispatchMode):
    """Fail on every operator that moves a tensor's value to the host or needs it there."""

    VALUE_READS = frozenset({aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero,
                             aten.masked_select, aten.item})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in self.VALUE_READS:
            raise HostRead(f"{func} reads a tensor's value on the host")
        if packet is aten.index and any(
            isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] if len(args) > 1 else [])
        ):
            raise HostRead("boolean-mask indexing: its output size depends on the values (a host read)")
        if packet is aten._to_copy and isinstance(args[0], Tensor) and "device" in kwargs:
            if torch.device(kwargs["device"]).type != args[0].device.type:
                raise HostRead(f"a copy between {args[0].device} and {kwargs['device']}")
        if packet is aten.copy_ and args[0].device.type != args[1].device.type and args[1].dim() > 0:
            raise HostRead(f"a copy between {args[1].device} and {args[0].device}")
        return func(*args, **kwargs)


@contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(name: str) -> Callable[..., Any]:
        def method(*_: Any, **__: Any) -> Any:
            raise HostRead(f"Tensor.{name} reads a tensor's values on the host")

        return method

    with monkeypatch.context() as patch:
        patch.setattr(Tensor, "tolist", refuse("tolist"))
        patch.setattr(Tensor, "numpy", refuse("numpy"))
        with NoHostReads():
            yield


def closure_for(problem: Any, seed: int, poison: Callable[[Tensor], Tensor] | None = None) -> Callable[..., Tensor]:
    draw = problem.batches(seed)
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = [draw()]
        losses = problem.losses(last[0])
        return losses if poison is None else poison(losses)

    return closure


def state_snapshot(problem: Any, optimizer: Any) -> dict[str, Any]:
    state = copy.deepcopy(optimizer.state_dict()["state"]["drmoo"])
    state.pop("skipped_steps")
    state.pop("step")  # a capturable step counts calls, skipped ones included
    state.pop("index_rng_state", None)  # Double-Loop's host-side index draws are consumed all the same
    return {"params": problem.snapshot(), "state": state}


def assert_same(now: dict[str, Any], before: dict[str, Any]) -> None:
    for got, want in zip(now["params"], before["params"]):
        assert torch.equal(got, want), "a skipped step changed a parameter"
    assert now["state"].keys() == before["state"].keys()
    for key, want in before["state"].items():
        got = now["state"][key]
        assert torch.equal(got, want) if isinstance(want, Tensor) else got == want, f"a skipped step changed {key}"


# ------------------------------------------------------------------------------- the detector
def test_the_detector_catches_every_kind_of_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.tensor([1.0, 2.0])
    reads = [lambda: t[0].item(), lambda: bool(t[0]), lambda: float(t[0]), lambda: int(t[0]), lambda: t.tolist(),
             lambda: torch.equal(t, t), lambda: t.nonzero(), lambda: t[t > 1], lambda: (t > 1).any().item(),
             lambda: t.numpy(), lambda: [0, 1, 2][t[0].long()]]
    for read in reads:
        with pytest.raises(HostRead), no_host_reads(monkeypatch):
            read()
    with no_host_reads(monkeypatch):  # and lets device-side work through
        torch.where(t > 1, t, 0.0).sum().sqrt()


# ------------------------------------------------------------------------------ no host reads
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("method", "extra"), CASES, ids=IDS)
def test_a_steady_state_step_reads_nothing_on_the_host(toy, monkeypatch, method: str, extra: dict,
                                                       backend: str) -> None:
    problem = toy()
    optimizer = create(method, problem.shared, 3, lr=0.05, capturable=True, backend=backend, **extra)
    closure = closure_for(problem, 1)
    for _ in range(2):  # warm-up: buffers allocated, FAMO's floor tensor made
        optimizer.step(closure)
    problem.H.grad = torch.zeros_like(problem.H)
    with no_host_reads(monkeypatch):
        optimizer.step(closure)
    assert optimizer.steps_taken == 3
    assert bool(problem.H.grad.abs().sum() > 0), "the heads were fed"


@pytest.mark.parametrize("strategy", ["loop", "batched"])
def test_a_steady_state_features_double_loop_step_reads_nothing_on_the_host(toy, monkeypatch, strategy: str) -> None:
    """Features-mode Double-Loop (Y and Y_bar w.r.t. z, Y_tilde^T w by one pass, its finiteness folded into
    the cross product on the device): a capturable step reads no tensor value on the host either."""
    problem = toy()
    optimizer = create("double-loop", problem.shared, 3, lr=0.05, capturable=True, jacobian="features",
                       inner_steps=3, seed=3)
    optimizer.jacobian_strategy = strategy
    draw = problem.batches(1)

    def closure_of(rows: Tensor) -> Callable[[], tuple[Tensor, Tensor]]:
        cached: list[tuple[Tensor, Tensor]] = []

        def closure() -> tuple[Tensor, Tensor]:
            if cached and torch.is_grad_enabled():
                return cached[0]
            z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
            batch = ((z @ problem.H - problem.targets[rows]) ** 2, z)
            if torch.is_grad_enabled():
                cached.append(batch)
            return batch

        return closure

    for _ in range(2):  # warm-up: buffers allocated
        optimizer.step(closure_of(draw()))
    problem.H.grad = torch.zeros_like(problem.H)
    closure = closure_of(draw())
    with no_host_reads(monkeypatch):
        optimizer.step(closure)
    assert optimizer.steps_taken == 3 and int(optimizer.state["drmoo"]["skipped_steps"]) == 0
    assert bool(problem.H.grad.abs().sum() > 0), "the heads were fed"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["reference", "cuda", "triton"])
@pytest.mark.parametrize(("method", "extra"), CASES, ids=IDS)
def test_a_steady_state_step_on_the_gpu_reads_nothing_on_the_host(toy, monkeypatch, method: str, extra: dict,
                                                                  backend: str) -> None:
    """As above with CUDA tensors and kernels: also catches copies between the host and the device."""
    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not available here")
    problem = toy(dtype=torch.float32)
    device = torch.device("cuda")
    problem.inputs, problem.targets = problem.inputs.to(device), problem.targets.to(device)
    problem.A, problem.c, problem.H = (p.detach().to(device).requires_grad_()
                                       for p in (problem.A, problem.c, problem.H))
    optimizer = create(method, problem.shared, 3, lr=0.05, capturable=True, backend=backend, **extra)
    draw = problem.batches(1)
    batches = [draw().to(device) for _ in range(3 * 8)]
    feed = iter(batches)
    last: list[Tensor] = []

    def closure(same_batch: bool = False) -> Tensor:
        if not same_batch:
            last[:] = [next(feed)]
        return problem.losses(last[0])

    for _ in range(2):
        optimizer.step(closure)
    problem.H.grad = torch.zeros_like(problem.H)
    with no_host_reads(monkeypatch):
        optimizer.step(closure)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(problem.A).all()) and bool(problem.H.grad.abs().sum() > 0)


@pytest.mark.parametrize(("method", "extra"), CASES, ids=IDS)
def test_the_eager_step_does_read_the_host(toy, monkeypatch, method: str, extra: dict) -> None:
    """The control: without capturable, the same step is caught (it checks finiteness on the host)."""
    problem = toy()
    optimizer = create(method, problem.shared, 3, lr=0.05, backend="reference", **extra)
    closure = closure_for(problem, 1)
    optimizer.step(closure)
    with pytest.raises(HostRead), no_host_reads(monkeypatch):
        optimizer.step(closure)


# ----------------------------------------------------------------------------- skipped steps
def nan_losses(losses: Tensor) -> Tensor:
    return losses * torch.where(torch.arange(losses.shape[1]) == 1, float("nan"), 1.0)


def nan_gradient(problem: Any) -> Callable[[Tensor], Tensor]:
    """Finite losses, NaN shared-parameter gradient: d sqrt(u)/du = inf at u = 0, times 0."""
    return lambda losses: losses + 0.0 * torch.sqrt(0.0 * problem.A.sum())


@pytest.mark.parametrize("poison", ["nan_losses", "nan_gradient", "negative_weights"])
@pytest.mark.parametrize(("method", "extra"), CASES, ids=IDS)
def test_a_non_finite_step_is_skipped_on_the_device(toy, monkeypatch, method: str, extra: dict, poison: str) -> None:
    problem = toy()
    optimizer = create(method, problem.shared, 3, lr=0.05, capturable=True, backend="reference", **extra)
    optimizer.step(closure_for(problem, 1))
    optimizer.step(closure_for(problem, 2))
    before = state_snapshot(problem, optimizer)
    problem.H.grad = torch.full_like(problem.H, 0.5)
    if poison == "negative_weights":
        good = closure_for(problem, 3)

        def bad(same_batch: bool = False) -> tuple[Tensor, Tensor]:
            losses = good(same_batch)
            return losses, torch.where(torch.arange(losses.shape[0])[:, None] == 0, -1.0, 1.0).expand_as(losses)

    else:
        bad = closure_for(problem, 3, nan_losses if poison == "nan_losses" else nan_gradient(problem))
    with no_host_reads(monkeypatch):
        optimizer.step(bad)  # no exception: the step is skipped on the device
    assert_same(state_snapshot(problem, optimizer), before)
    assert torch.equal(problem.H.grad, torch.full_like(problem.H, 0.5)), "a skipped step fed the heads"
    assert int(optimizer.state["drmoo"]["skipped_steps"]) == 1
    assert float(optimizer.stats["found_inf"]) == 1.0 and int(optimizer.stats["skipped_steps"]) == 1
    optimizer.step(closure_for(problem, 4))  # and the next good step goes through
    assert float(optimizer.stats["found_inf"]) == 0.0 and int(optimizer.state["drmoo"]["skipped_steps"]) == 1
    assert not torch.equal(problem.snapshot()[0], before["params"][0])


def test_a_skipped_step_leaves_heads_without_grad_at_zero(toy) -> None:
    """Heads whose .grad was None get zeros (a value decided on the device cannot choose None)."""
    problem = toy()
    optimizer = create("mgda", problem.shared, 3, lr=0.05, capturable=True)
    problem.H.grad = None
    optimizer.step(closure_for(problem, 3, nan_losses))
    assert problem.H.grad is not None and torch.equal(problem.H.grad, torch.zeros_like(problem.H))


# --------------------------------------------------------------------- same math as eager
@pytest.mark.parametrize(("method", "extra"), CASES, ids=IDS)
def test_capturable_steps_follow_the_eager_trajectory(toy, method: str, extra: dict) -> None:
    runs = []
    for capturable in (False, True):
        problem = toy()
        torch.manual_seed(0)
        optimizer = create(method, problem.shared, 3, lr=0.05, capturable=capturable, backend="reference", **extra)
        closure = closure_for(problem, 5)
        heads = []
        for _ in range(4):
            problem.H.grad = None
            optimizer.step(closure)
            heads.append(problem.H.grad.clone())
        runs.append([*problem.snapshot(), optimizer.w.clone(), optimizer.eta.clone(), *heads])
    for eager, capturable in zip(*runs):
        # the capturable theta update forms J^T w before writing it: a different rounding order
        torch.testing.assert_close(capturable, eager, rtol=1e-12, atol=1e-14)


def test_capturable_is_a_checked_flag_and_survives_a_state_load(toy) -> None:
    problem = toy()
    with pytest.raises(ValueError, match="capturable must be True or False"):
        create("double-clip", problem.shared, 3, capturable="yes")
    for name in available():
        assert create(name, problem.shared, 3, capturable=True).capturable, name
    saved = create("moco", problem.shared, 3).state_dict()
    optimizer = create("moco", problem.shared, 3, capturable=True)
    optimizer.load_state_dict(saved)  # how this process runs the step is not training state
    assert optimizer.capturable


# ------------------------------------------------------------------------------- CUDA graphs
GRAPH_CASES = [(m, e) for m, e in CASES if m != "double-loop"]  # its host-drawn indices would be frozen
GRAPH_IDS = [i for i, (m, _) in zip(IDS, CASES) if m != "double-loop"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["reference", "cuda", "triton"])
@pytest.mark.parametrize(("method", "extra"), GRAPH_CASES, ids=GRAPH_IDS)
def test_a_cuda_graph_of_the_step_replays_like_eager_steps(toy, method: str, extra: dict, backend: str) -> None:
    """Capture ``optimizer.step`` with a static closure, replay it on new batches, compare with eager.

    The closure reads a static index buffer (the batch is copied into it before each replay); the
    heads' .grad is kept allocated and zeroed in place, as graph capture needs static memory.
    Nash-MTL with update_every > 1 would need one graph per branch: captured here at 2, whose
    captured (reuse) step is then replayed -- compared with eager steps that take the same branch.
    """
    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not available here")
    device = torch.device("cuda")
    steps, warmup = 7, 3
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (32,), generator=gen).to(device) for _ in range(steps)]

    def build() -> tuple[Any, Any, Tensor, Callable[..., Tensor]]:
        problem = toy(dtype=torch.float32)  # float32: the cuda and triton kernels (float64 falls back)
        for name in ("inputs", "targets"):
            setattr(problem, name, getattr(problem, name).to(device))
        with torch.no_grad():
            for name in ("A", "c", "H"):
                setattr(problem, name, getattr(problem, name).detach().to(device).requires_grad_())
        optimizer = create(method, problem.shared, 3, lr=0.05, capturable=True, backend=backend, **extra)
        rows = torch.zeros(32, dtype=torch.long, device=device)
        problem.H.grad = torch.zeros_like(problem.H)
        return problem, optimizer, rows, lambda same_batch=False: problem.losses(rows)

    linalg = torch.backends.cuda.preferred_linalg_library()
    torch.backends.cuda.preferred_linalg_library("cusolver")  # MAGMA's small solves synchronise
    try:
        # eager, capturable=True: the reference trajectory
        problem, optimizer, rows, closure = build()
        history = []
        for step in range(steps):
            rows.copy_(batches[step])
            problem.H.grad.zero_()
            if method == "nashmtl" and step >= warmup and extra["update_every"] > 1:
                optimizer.state["drmoo"]["step"] = warmup  # the branch the graph captured (see docstring)
            optimizer.step(closure)
            history.append([p.detach().clone() for p in (*problem.shared, problem.H.grad, optimizer.w, optimizer.eta)])

        # graph: warm-up eagerly on a side stream, capture once, replay the remaining steps
        problem, optimizer, rows, closure = build()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for step in range(warmup):
                rows.copy_(batches[step])
                problem.H.grad.zero_()
                optimizer.step(closure)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            optimizer.step(closure)
        for step in range(warmup, steps):
            rows.copy_(batches[step])
            problem.H.grad.zero_()
            graph.replay()
            got = [p.detach() for p in (*problem.shared, problem.H.grad, optimizer.w, optimizer.eta)]
            for value, want in zip(got, history[step]):
                # the same kernels as the eager steps: equal up to any atomics' summation order
                torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7,
                                           msg=lambda msg, s=step: f"step {s}: {msg}")
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.preferred_linalg_library(linalg)
