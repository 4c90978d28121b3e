"""The per-task Jacobian of torch.compile'd code: never under vmap, which torch cannot run there.

torch raises "trying to call a compiled backward function within vmap" when the vmapped strategy
(``jacobian_strategy="batched"``) backpropagates through a compiled graph's backward.  ``"auto"`` picks that
strategy on a GPU (parameters mode) and above 4 tasks in features mode, so it takes the per-task loop where
the graph it would vmap holds a compiled backward; an explicit ``"batched"`` is refused with drmoo's message.

Every ``torch.compile`` backend's graph reaches autograd as AOTAutograd's ``CompiledFunction``; these tests
compile with ``aot_eager`` (the same autograd node as inductor's, without a C++ build) to stay fast, and
compile each model once.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import drmoo
import drmoo.jacobian


class TwoTasks(nn.Module):
    """The model of the docs' torch.compile example."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())  # shared
        self.heads = nn.Linear(32, 2)  # one output per task

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.trunk(x))


def _batch(num_tasks: int) -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(16, 10), torch.randn(16, num_tasks)


@pytest.fixture(scope="module")
def docs_model() -> tuple[TwoTasks, Callable[[Tensor], Tensor]]:
    torch.manual_seed(0)
    model = TwoTasks()
    return model, torch.compile(model, backend="aot_eager")


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


DocsModel = tuple[TwoTasks, Callable[[Tensor], Tensor]]  # the model, and it compiled


def _docs_step(docs_model: DocsModel, strategy: str, *, compiled: bool) -> list[Tensor]:
    model, compiled_model = docs_model
    model.zero_grad(set_to_none=True)
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=2, lam=0.8, lr=1e-2,
                              jacobian_strategy=strategy)
    x, y = _batch(2)
    balancer.backward(((compiled_model if compiled else model)(x) - y) ** 2)
    return _grads(model)


def test_batched_is_refused_with_a_message_for_a_compiled_model(
        docs_model: tuple[TwoTasks, Callable[[Tensor], Tensor]]) -> None:
    with pytest.raises(ValueError, match=r"torch.compile'd backward .*CompiledFunction.*jacobian_strategy='loop'"):
        _docs_step(docs_model, "batched", compiled=True)
    _docs_step(docs_model, "batched", compiled=False)  # the same model eagerly: batched as asked


def test_auto_takes_the_loop_where_it_would_vmap_a_compiled_model(
        docs_model: tuple[TwoTasks, Callable[[Tensor], Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` picks ``batched`` on a GPU: made to pick it here, it falls back to the loop's gradients."""
    loop = _docs_step(docs_model, "loop", compiled=True)
    monkeypatch.setattr(drmoo.jacobian, "resolve_strategy",
                        lambda strategy, device, num_tasks, features: "batched" if strategy == "auto" else strategy)
    auto = _docs_step(docs_model, "auto", compiled=True)
    for a, b in zip(auto, loop):
        assert torch.equal(a, b)  # the same passes in the same order


NUM_TASKS = 6  # features mode's auto vmaps above 4 tasks on the CPU


@pytest.fixture(scope="module")
def compiled_head() -> tuple[nn.Module, nn.Module, Callable[[Tensor], Tensor]]:
    torch.manual_seed(0)
    trunk, head = nn.Sequential(nn.Linear(10, 32), nn.Tanh()), nn.Linear(32, NUM_TASKS)
    return trunk, head, torch.compile(head, backend="aot_eager")


@pytest.mark.parametrize("strategy", ["auto", "batched"])
def test_features_mode_with_a_compiled_head(
        compiled_head: tuple[nn.Module, nn.Module, Callable[[Tensor], Tensor]], strategy: str) -> None:
    trunk, head, compiled = compiled_head

    def step(strategy: str, head_of: Callable[[Tensor], Tensor]) -> list[Tensor]:
        trunk.zero_grad(set_to_none=True)
        balancer = drmoo.Balancer("mgda", trunk.parameters(), NUM_TASKS, jacobian="features", lr=1e-2,
                                  jacobian_strategy=strategy)
        x, y = _batch(NUM_TASKS)
        z = trunk(x)
        balancer.backward((head_of(z) - y) ** 2, features=z)
        return _grads(trunk)

    if strategy == "batched":
        with pytest.raises(ValueError, match=r"torch\.compile'd backward"):
            step("batched", compiled)
        step("batched", head)  # eagerly: vmapped as asked
        return
    for a, b in zip(step("auto", compiled), step("loop", compiled)):
        assert torch.equal(a, b)
