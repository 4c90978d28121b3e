"""Features mode's one-pass rows for separate heads (drmoo._head_split): found where the graph has them,
refused where it does not, and the very rows (and head gradients) the per-task passes compute."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import drmoo
import drmoo.jacobian
from drmoo._head_split import split_task_jacobian, task_split
from drmoo.jacobian import resolve_strategy, task_jacobian

B, D, M = 6, 5, 4


def _setup(seed: int = 0) -> tuple[Tensor, Tensor, nn.Linear]:
    torch.manual_seed(seed)
    trunk = nn.Linear(3, D)
    x = torch.randn(B, 3)
    return x, torch.randint(0, 2, (B, M)).float(), trunk


def _rows_and_head_grads(losses: Tensor, z: tuple[Tensor, ...], heads: list[Tensor], cotangent: Tensor,
                         strategy: str) -> tuple[Tensor, list[Tensor | None]]:
    out = torch.full((M, sum(p.numel() for p in z)), float("nan"))
    for head in heads:
        head.grad = None
    if strategy == "split":
        split = task_split(losses, z)
        assert split is not None
        grads = split_task_jacobian(losses, cotangent, z, out, split, heads=heads, retain_graph=True)
        return out, list(grads)
    task_jacobian(losses, cotangent, z, out, strategy=strategy, feed_heads=True, retain_graph=True, heads=heads)
    return out, [head.grad for head in heads]


def _linear_heads() -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(D, 1) for _ in range(M))


def _mlp_heads() -> nn.ModuleList:
    return nn.ModuleList(nn.Sequential(nn.Linear(D, 3), nn.Tanh(), nn.Linear(3, 1)) for _ in range(M))


def _cat_bce(z: Tensor, y: Tensor, heads: nn.Module) -> Tensor:
    return F.binary_cross_entropy_with_logits(torch.cat([h(z) for h in heads], 1), y, reduction="none")


def _cat_squared_cast(z: Tensor, y: Tensor, heads: nn.Module) -> Tensor:
    return ((torch.cat([h(z) for h in heads], 1) - y) ** 2).double().float()


def _stack_cross_entropies(z: Tensor, y: Tensor, heads: nn.Module) -> Tensor:
    return torch.stack([F.cross_entropy(h(z), y[:, i].long(), reduction="none") for i, h in enumerate(heads)], 1)


def _head_reads_z_twice(z: Tensor, y: Tensor, heads: nn.Module) -> Tensor:
    return torch.cat([h(z * z) for h in heads], 1).abs()


# Graphs with one subgraph per task between z and its loss column: (heads, losses of (z, y, heads)).
SPLIT_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[Tensor, Tensor, nn.Module], Tensor]]] = {
    "cat + bce": (_linear_heads, _cat_bce),
    "cat - y, squared, cast": (_mlp_heads, _cat_squared_cast),
    "stack of cross-entropies": (lambda: nn.ModuleList(nn.Linear(D, 3) for _ in range(M)), _stack_cross_entropies),
    "a head reads z twice": (_linear_heads, _head_reads_z_twice),
}


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_one_pass_gives_the_per_task_rows_and_head_grads(case: str) -> None:
    make_heads, losses_of = SPLIT_CASES[case]
    x, y, trunk = _setup()
    heads = make_heads()
    features = trunk(x)
    losses, z = losses_of(features, y, heads), (features,)
    cotangent = torch.rand(B, M)
    params = list(heads.parameters())
    loop_rows, loop_heads = _rows_and_head_grads(losses, z, params, cotangent, "loop")
    batched_rows, _ = _rows_and_head_grads(losses, z, params, cotangent, "batched")
    split_rows, split_heads = _rows_and_head_grads(losses, z, params, cotangent, "split")
    # The per-task passes and the split compute every row by the same ops (the other heads add zeros).
    assert torch.equal(split_rows, loop_rows)
    torch.testing.assert_close(split_rows, batched_rows)  # vmapped GEMMs may round differently
    for a, b in zip(split_heads, loop_heads):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # one sum over tasks against m partial ones
    # The hooks are gone: a later pass over the same graph sends the heads' gradients on to z again.
    again, _ = _rows_and_head_grads(losses, z, params, 2 * cotangent, "loop")
    assert torch.equal(again, 2 * loop_rows)


def test_tuple_features_and_a_head_that_skips_a_piece() -> None:
    x, y, trunk = _setup()
    second = nn.Linear(3, 2)
    heads = nn.ModuleList(nn.Linear(D + 2, 1) for _ in range(M - 1))
    last = nn.Linear(2, 1)
    z1, z2 = trunk(x), second(x)
    logits = torch.cat([*(h(torch.cat([z1, z2], 1)) for h in heads), last(z2)], 1)  # the last reads only z2
    losses = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    params = [*heads.parameters(), *last.parameters()]
    cotangent = torch.rand(B, M)
    loop_rows, _ = _rows_and_head_grads(losses, (z1, z2), params, cotangent, "loop")
    split_rows, _ = _rows_and_head_grads(losses, (z1, z2), params, cotangent, "split")
    assert torch.equal(split_rows, loop_rows)
    assert torch.equal(split_rows[-1, : B * D], torch.zeros(B * D))  # written as zeros, not left stale


def test_a_leaf_z_is_split_too() -> None:
    _, y, _ = _setup()
    z = torch.randn(B, D, requires_grad=True)
    heads = _linear_heads()
    losses = (torch.cat([h(z) for h in heads], 1) - y) ** 2
    cotangent = torch.rand(B, M)
    params = list(heads.parameters())
    loop_rows, _ = _rows_and_head_grads(losses, (z,), params, cotangent, "loop")
    split_rows, _ = _rows_and_head_grads(losses, (z,), params, cotangent, "split")
    assert torch.equal(split_rows, loop_rows)


def _refused_shared_head(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (nn.Linear(D, M)(z) - y) ** 2, z


def _refused_softmax_over_tasks(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return -torch.log_softmax(torch.cat([h(z) for h in _linear_heads()], 1), dim=1), z


def _refused_shared_hidden_layer(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    hidden = torch.tanh(nn.Linear(D, D)(z))
    return (torch.cat([h(hidden) for h in _linear_heads()], 1) - y) ** 2, z


def _refused_two_columns_from_one_head(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (torch.cat([nn.Linear(D, 2)(z), *(h(z) for h in list(_linear_heads())[2:])], 1) - y) ** 2, z


def _refused_columns_mixed(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    logits = torch.cat([h(z) for h in _linear_heads()], 1)
    return logits + logits.mean(1, keepdim=True), z


def _refused_broadcast_column(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (nn.Linear(D, 1)(z).expand(B, M) - y) ** 2, z


def _refused_shared_parameter(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    scale = nn.Parameter(torch.ones(1))
    return torch.cat([h(z) * scale for h in _linear_heads()], 1) ** 2, z


def _refused_cat_along_the_batch(x: Tensor, y: Tensor, trunk: nn.Module) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    heads = nn.Linear(D, M)
    return torch.cat([heads(z[: B // 2]), heads(z[B // 2:])], 0) ** 2, z


@pytest.mark.parametrize("losses_of", [_refused_shared_head, _refused_softmax_over_tasks, _refused_shared_hidden_layer,
                                       _refused_two_columns_from_one_head, _refused_columns_mixed,
                                       _refused_broadcast_column, _refused_shared_parameter,
                                       _refused_cat_along_the_batch], ids=lambda f: f.__name__[9:])
def test_graphs_without_one_subgraph_per_task_are_refused(losses_of: Callable[..., tuple[Tensor, Tensor]]) -> None:
    x, y, trunk = _setup()
    losses, z = losses_of(x, y, trunk)
    assert losses.shape == (B, M)
    assert task_split(losses, (z,)) is None


# ------------------------------------------------------------------------------- the strategy choice
def test_auto_resolves_by_device_mode_and_tasks() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_strategy("auto", cpu, 40, features=False) == "loop"  # the least memory traffic
    assert resolve_strategy("auto", gpu, 2, features=False) == "batched"  # the fewest launches
    assert resolve_strategy("auto", cpu, 4, features=True) == "loop"
    assert resolve_strategy("auto", cpu, 5, features=True) == "batched"
    assert resolve_strategy("auto", gpu, 2, features=True) == "batched"
    assert resolve_strategy("loop", gpu, 40, features=False) == "loop"
    with pytest.raises(ValueError, match="valid choices: auto, loop, batched"):
        resolve_strategy("vmap", cpu, 2, features=False)
    with pytest.raises(ValueError, match="unknown Jacobian strategy 'vmap'"):
        drmoo.Balancer("mgda", nn.Linear(2, 2).parameters(), 2, lr=0.1, jacobian_strategy="vmap")  # type: ignore[arg-type]


class _Net(nn.Module):
    def __init__(self, shared_head: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(3, D), nn.Tanh())
        self.heads: nn.Module = nn.Linear(D, M) if shared_head else _mlp_heads()

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        z = self.trunk(x)
        logits = self.heads(z) if isinstance(self.heads, nn.Linear) else torch.cat([h(z) for h in self.heads], 1)
        return F.binary_cross_entropy_with_logits(logits, y, reduction="none"), z


@pytest.mark.parametrize("shared_head", [False, True], ids=["separate heads", "shared head"])
def test_every_strategy_writes_the_same_grads_and_auto_splits_separate_heads(
        shared_head: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A features-mode Balancer step (MGDA, pref_lr = 0.5: w moves with the Gram) gives the same .grad with
    every strategy; "auto" takes the one-pass rows exactly where the heads are separate."""
    import drmoo.optim._features as features_engine

    passes = []
    one_pass = features_engine.split_task_jacobian
    monkeypatch.setattr(features_engine, "split_task_jacobian",
                        lambda *args, **kwargs: passes.append(1) or one_pass(*args, **kwargs))
    x, y, _ = _setup()
    written = {}
    for strategy in ("loop", "batched", "auto"):
        net = _Net(shared_head)
        balancer = drmoo.Balancer("mgda", net.trunk.parameters(), M, jacobian="features", lr=0.1, pref_lr=0.5,
                                  jacobian_strategy=strategy)
        assert balancer.algorithm.jacobian_strategy == strategy
        for _ in range(2):
            net.zero_grad()
            losses, z = net.losses(x, y)
            balancer.backward(losses, features=z)
        written[strategy] = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        assert len(written[strategy]) == len(list(net.parameters()))
    assert passes == ([] if shared_head else [1, 1])
    for strategy in ("batched", "auto"):
        for a, b in zip(written["loop"], written[strategy]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_cli_names_the_strategy_apart_from_the_jacobians_coordinates() -> None:
    """``drmoo train --jacobian-strategy auto|loop|batched`` (``--jacobian``, its former name, still parses);
    ``--hp jacobian=features`` stays the coordinates' setting."""
    from drmoo import cli

    parser = cli.build_parser()
    assert parser.parse_args(["train", "--jacobian-strategy", "auto"]).jacobian == "auto"
    assert parser.parse_args(["train", "--jacobian", "batched"]).jacobian == "batched"
    assert parser.parse_args(["train"]).jacobian == "loop"
    assert set(cli.JACOBIAN_STRATEGIES) == set(drmoo.jacobian.STRATEGIES)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--jacobian-strategy", "features"])
