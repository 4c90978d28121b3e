"""drmoo.cuda_graph.GraphedStep: one whole training step (forward, the method's step, the heads' step) as a CUDA graph.

On the CPU: every refusal (not a drmoo.optim optimizer, Double-Loop, Nash-MTL with update_every > 1,
capturable=False, not on CUDA, a bad warmup_steps, a batch of another shape than the captured one),
and the closure's bookkeeping (fresh draws counted, same_batch re-evaluation, features mode's one
batch per step).  On a GPU: a few graphed steps follow eager steps from the same start.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drmoo import Balancer
from drmoo.cuda_graph import GraphedStep, check_graphable
from drmoo.optim import create


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))]


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("build", "named"), [
    (lambda p: Balancer("mgda", p, 2, lr=0.1), "drmoo.Balancer is not supported"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "got SGD"),
    (lambda p: create("double-loop", p, 2, capturable=True), "Double-Loop cannot be captured"),
    (lambda p: create("nashmtl", p, 2, capturable=True, update_every=2), "update_every=2"),
    (lambda p: create("mgda", p, 2), "capturable=True"),
    (lambda p: create("double-clip", p, 2, capturable=True), "CUDA device; this optimizer's are on cpu"),
    (lambda p: create("nashmtl", p, 2, capturable=True, update_every=1), "CUDA device"),
])
def test_what_cannot_be_captured_is_refused_by_name(build: Callable[[list[nn.Parameter]], Any], named: str) -> None:
    optimizer = build(_params())
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        check_graphable(optimizer)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        GraphedStep(optimizer, lambda x, y: x)


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True, "3"])
def test_warmup_steps_must_be_a_positive_integer(warmup: Any) -> None:
    optimizer = create("mgda", _params(), 2, capturable=True)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 1"):
        GraphedStep(optimizer, lambda x, y: x, warmup_steps=warmup)


def _unchecked(optimizer: Any, loss_fn: Callable[[Tensor, Tensor], Any]) -> GraphedStep:
    """A GraphedStep on the CPU, past its CUDA check: for the parts that need no graph."""
    graphed = object.__new__(GraphedStep)
    graphed.optimizer, graphed.loss_fn, graphed.heads, graphed.warmup_steps = optimizer, loss_fn, None, 1
    graphed.device, graphed.steps, graphed.draws_per_step = torch.device("cpu"), 0, None
    graphed.graph, graphed.static, graphed.objective, graphed._side = None, [], None, None
    return graphed


@pytest.mark.parametrize(("inputs", "targets", "named"), [
    (torch.zeros(3, 5), torch.zeros(3, 2, dtype=torch.long), "inputs of shape (3, 5)"),  # the last, smaller batch
    (torch.zeros(4, 5), torch.zeros(4, 3, dtype=torch.long), "targets of shape (4, 3)"),
    (torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.long), "torch.float64"),
])
def test_a_batch_unlike_the_captured_one_is_refused(inputs: Tensor, targets: Tensor, named: str) -> None:
    graphed = _unchecked(None, lambda x, y: x)
    graphed.static = [(torch.ones(4, 5), torch.ones(4, 2, dtype=torch.long))]
    with pytest.raises(ValueError, match=rf"{named.replace('(', '[(]').replace(')', '[)]')}.*drop_last=True"):
        graphed._fill(lambda: (inputs, targets))
    assert torch.equal(graphed.static[0][0], torch.ones(4, 5)), "a refused batch was copied in"


def test_a_batch_like_the_captured_one_fills_every_slot_in_order() -> None:
    graphed = _unchecked(None, lambda x, y: x)
    graphed.static = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)) for _ in range(3)]
    batches = iter([(torch.full((2, 3), float(i)), torch.full((2,), i)) for i in range(3)])
    graphed._fill(lambda: next(batches))
    for i, (x, y) in enumerate(graphed.static):
        assert torch.equal(x, torch.full((2, 3), float(i))) and torch.equal(y, torch.full((2,), i))


def test_step_on_names_step_draw_for_a_method_that_draws_several_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    graphed = _unchecked(None, lambda x, y: x)
    monkeypatch.setattr(GraphedStep, "step", lambda self, draw: (draw(), draw()))  # a two-draw step
    with pytest.raises(ValueError, match=r"draws more than one batch per step.*GraphedStep\.step\(draw\)"):
        graphed.step_on(torch.zeros(2), torch.zeros(2))


# ------------------------------------------------------------------------------- the closure
def test_the_closure_counts_fresh_draws_and_re_evaluates_the_same_batch() -> None:
    seen: list[Tensor] = []
    graphed = _unchecked(create("famo", _params(), 2, capturable=True), lambda x, y: seen.append(x) or x)
    batches = iter([(torch.full((1,), float(i)), torch.zeros(1)) for i in range(3)])
    counter = [0]
    closure = graphed._closure(lambda: next(batches), counter)
    closure()
    closure(same_batch=True)  # FAMO's re-evaluation: the same batch, no new draw
    closure()
    assert counter == [2]
    assert [float(x) for x in seen] == [0.0, 0.0, 1.0]


def test_features_mode_draws_one_batch_with_a_graph_per_step() -> None:
    """As drmoo train's eager closure: later draws with a graph return the first (one z per step); draws
    without a graph (the dual variables' steps) stay fresh."""
    optimizer = create("modo", _params(), 2, capturable=True, jacobian="features")
    graphed = _unchecked(optimizer, lambda x, y: (x, y))
    batches = iter([(torch.full((1,), float(i)), torch.zeros(1)) for i in range(4)])
    counter = [0]
    closure = graphed._closure(lambda: next(batches), counter)
    first = closure()
    assert closure() is first and closure() is first
    with torch.no_grad():
        assert float(closure()[0]) == 1.0  # without a graph: a fresh batch
    assert counter == [2]


# ------------------------------------------------------------------------------- on a GPU
class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(16, 3) for _ in range(2))

    def features(self, x: Tensor) -> Tensor:
        return self.trunk(x)


GPU_CASES = [
    ("double-clip", {}),  # two draws a step (one without a graph)
    ("double-clip", {"jacobian": "features"}),
    ("mgda", {}),
    ("modo", {}),  # three draws
    ("famo", {}),  # a same-batch re-evaluation
    ("nashmtl", {"update_every": 1, "solver_iters": 20}),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("method", "extra"), GPU_CASES, ids=[f"{m}-{'-'.join(map(str, e.values())) or 'default'}"
                                                              for m, e in GPU_CASES])
def test_graphed_training_steps_follow_eager_ones(method: str, extra: dict) -> None:
    """Same start, same batches: warm-up, capture and replays end where eager capturable steps do.

    The graph replays the kernels the eager step launches, in the same order, so the results would
    be bitwise equal; the tolerance (about 40 float32 ulps relative, after 7 steps at lr 0.05)
    admits only a different cuBLAS/cuSOLVER algorithm choice inside capture (the capture forces
    cuSOLVER where eager steps may take MAGMA) and any atomics' summation order.
    """
    device = torch.device("cuda")
    steps, warmup = 7, 2
    torch.manual_seed(0)
    template = _Model().to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16, 2), generator=gen))
               for _ in range(3 * steps)]  # enough for three draws a step
    features_mode = extra.get("jacobian") == "features"

    def build() -> tuple[_Model, Any, torch.optim.SGD, Callable[[Tensor, Tensor], Any]]:
        model = copy.deepcopy(template)
        optimizer = create(method, model.trunk.parameters(), 2, lr=0.05, capturable=True, **extra)
        heads = torch.optim.SGD(model.heads.parameters(), lr=0.05)

        def loss_fn(x: Tensor, y: Tensor) -> Any:
            z = model.features(x)
            losses = torch.stack([F.cross_entropy(h(z), y[:, i], reduction="none")
                                  for i, h in enumerate(model.heads)], dim=1)
            return (losses, z) if features_mode else losses

        return model, optimizer, heads, loss_fn

    linalg = torch.backends.cuda.preferred_linalg_library()
    torch.backends.cuda.preferred_linalg_library("cusolver")  # as the capture does
    try:
        model, optimizer, heads, loss_fn = build()
        graphed = GraphedStep(optimizer, loss_fn, heads=heads, warmup_steps=warmup)
        feed = iter(batches)
        for _ in range(steps):
            graphed.step(lambda: next(feed))
        assert graphed.graph is not None and graphed.steps == steps
        assert optimizer.steps_taken == steps  # the host counter advanced by the replays
        graphed_params = [p.detach().clone() for p in model.parameters()]
        used = len(batches) - len(list(feed))

        # eager: the same batches in the same order, through an ordinary closure
        model, optimizer, heads, loss_fn = build()
        eager = GraphedStep(optimizer, loss_fn, heads=heads, warmup_steps=steps + 1)  # never captures
        feed = iter(batches)
        for _ in range(steps):
            eager.step(lambda: next(feed))
        assert eager.graph is None and len(batches) - len(list(feed)) == used
        torch.cuda.synchronize()
        for got, want in zip(graphed_params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=5e-6, atol=1e-6)
    finally:
        torch.backends.cuda.preferred_linalg_library(linalg)
