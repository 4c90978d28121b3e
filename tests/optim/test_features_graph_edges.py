"""Features mode on the graphs at the edge of what it reads: pieces of z computed from one another, hooks on z,
and the one-pass head split's cat/stack forms (this file runs in the oldest-torch leg too: torch 2.11 frees a
graph node's Python wrapper as soon as it is dropped, which once hid every split there)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import drmoo
import drmoo._head_split
from drmoo._head_split import task_split

STRATEGIES = ("auto", "loop", "batched")
# The strategies sum the same float32 products (entries of size <= ~1, a few dozen terms each) in different
# orders: each sum is within k * eps32 * sum|terms| (k <= 48 terms, eps32 = 6e-8) of the exact one, ~3e-6 here.
ATOL = 1e-5


def _trunk_grad(strategy: str | None, build: Callable[[Tensor], tuple[Tensor, tuple[Tensor, ...]]],
                num_tasks: int, method: str = "mgda") -> Tensor:
    """The trunk's first-layer ``.grad`` after one Balancer backward (``strategy`` None: parameters mode)."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    x = torch.randn(8, 4)
    losses, features = build(trunk(x))
    if strategy is None:
        drmoo.Balancer(method, trunk.parameters(), num_tasks, lr=1e-2).backward(losses)
    else:
        balancer = drmoo.Balancer(method, trunk.parameters(), num_tasks, jacobian="features", lr=1e-2,
                                  jacobian_strategy=strategy)
        balancer.backward(losses, features=features)
    grad = trunk[0].weight.grad
    assert grad is not None
    return grad


def _two_stages(z: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The reported graph: one head reads z and z2 = f(z), both passed as pieces of z."""
    torch.manual_seed(1)
    head = nn.Linear(6, 1)
    z2 = torch.relu(z) * 2
    return (head(z2) + head(z) - torch.randn(8, 1)) ** 2, (z, z2)


@pytest.mark.parametrize("method", ["mgda", "famo"])  # a Jacobian of rows, and one combined gradient
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_piece_computed_from_another_is_counted_once(strategy: str, method: str) -> None:
    """One task: every method's direction is that task's gradient, the same in both modes (at HEAD: x1.6)."""
    expected = _trunk_grad(None, _two_stages, 1, method)
    torch.testing.assert_close(_trunk_grad(strategy, _two_stages, 1, method), expected, rtol=0, atol=ATOL)


def _separate_heads_on_two_stages(z: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Two tasks, separate heads, one on z2 = f(z) and one on z: the one-pass split applies."""
    torch.manual_seed(1)
    heads = [nn.Linear(6, 1), nn.Linear(6, 1)]
    z2 = torch.tanh(z) * 3
    return (torch.cat([heads[0](z2), heads[1](z)], dim=1) - torch.randn(8, 2)) ** 2, (z, z2)


def test_every_strategy_takes_the_split_s_partial_rows() -> None:
    auto = _trunk_grad("auto", _separate_heads_on_two_stages, 2)
    for strategy in ("loop", "batched"):
        torch.testing.assert_close(_trunk_grad(strategy, _separate_heads_on_two_stages, 2), auto, rtol=0,
                                   atol=ATOL)


def _head(kind: str) -> nn.Module:
    """A task's head: ``auto`` takes linear heads' rows as outer products, deeper ones by the one-pass split."""
    return nn.Linear(6, 1) if kind == "linear" else nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 1))


def _hooked(hook: Callable[[Tensor], Tensor] | None,
            kind: str = "linear") -> Callable[[Tensor], tuple[Tensor, tuple[Tensor, ...]]]:
    def build(z: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        torch.manual_seed(1)
        heads = [_head(kind) for _ in range(3)]
        if hook is not None:
            z.register_hook(hook)
        return (torch.cat([head(z) for head in heads], dim=1) - torch.randn(8, 3)) ** 2, (z,)

    return build


@pytest.mark.parametrize("kind", ["linear", "deep"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("hook", "gain"), [(lambda g: g * 2, 2.0), (lambda g: -g, -1.0)], ids=["double", "reverse"])
def test_a_hook_on_z_is_applied_once(strategy: str, hook: Callable[[Tensor], Tensor], gain: float, kind: str) -> None:
    """As in parameters mode: the gradient into the trunk is transformed once (it was x4 in loop and batched, a
    reversal cancelled itself, and the head split called the hook with None)."""
    plain = _trunk_grad(strategy, _hooked(None, kind), 3)
    torch.testing.assert_close(_trunk_grad(strategy, _hooked(hook, kind), 3), gain * plain, rtol=0, atol=ATOL)
    plain_parameters = _trunk_grad(None, _hooked(None, kind), 3)
    torch.testing.assert_close(_trunk_grad(None, _hooked(hook, kind), 3), gain * plain_parameters, rtol=0,
                               atol=ATOL)


def _columns(join: str) -> Callable[[Tensor], tuple[Tensor, tuple[Tensor, ...]]]:
    """Separate two-layer heads (not plain linear ones, which have a path of their own) joined by ``join``."""
    def build(z: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        torch.manual_seed(1)
        outputs = [_head("deep")(z) for _ in range(3)]
        if join == "cat":
            losses = torch.cat(outputs, dim=1)
        elif join == "cat(-1)":
            losses = torch.cat(outputs, dim=-1)
        else:
            losses = torch.stack([out.squeeze(-1) for out in outputs], dim=-1)
        return (losses - torch.randn(8, 3)) ** 2, (z,)

    return build


@pytest.mark.parametrize("join", ["cat", "cat(-1)", "stack(-1)"])
def test_separate_heads_are_split_in_one_pass(join: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` takes the one-pass split for separate heads joined along the task dimension, whatever the torch."""
    losses, features = _columns(join)(torch.randn(8, 6, requires_grad=True).tanh())
    assert task_split(losses, features) is not None
    calls: list[int] = []
    one_pass = drmoo._head_split.split_task_jacobian

    def counted(*args: object, **kwargs: object) -> tuple[Tensor | None, ...]:
        calls.append(1)
        return one_pass(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("drmoo.optim._features.split_task_jacobian", counted)
    split = _trunk_grad("auto", _columns(join), 3)
    assert calls, "the one-pass split was not taken"
    torch.testing.assert_close(split, _trunk_grad("loop", _columns(join), 3), rtol=0, atol=ATOL)
