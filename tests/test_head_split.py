"""Features mode's one-pass rows for separate heads (drmoo._head_split): found where the graph has them,
refused where it does not, and the very rows (and head gradients) the per-task passes compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


# ------------------------------------------------------------------------------ the rounding error model
# Where two strategies run different kernels (the vmapped pass batches its GEMMs and element-wise ops), their
# rows are compared against a bound derived from the standard model fl(a op b) = (a op b)(1 + d), |d| <= u
# (u = 2^-24 in float32), not a hand-picked rtol.  Both strategies differentiate the same forward (the same
# stored float32 values: z, the heads' activations and logits, the cotangent c), so each computes the same
# exact row r, and a chain of K roundings over sums of products gives |fl(r) - r| <= gamma_K * A, with
# gamma_K = K u / (1 - K u) and A the row computed with every term in absolute value (Higham, "Accuracy and
# Stability of Numerical Algorithms", 3.1-3.5): a product of factors each with relative error gamma_a, summed
# k at a time, has relative error gamma_{a + k} in the sum of the absolute terms.  Hence
# |r_a - r_b| <= 2 gamma_K A.  K counts the roundings on the longest path of each head's backward:
#   exp(t)           2 (correctly rounded to 1 ulp <= 2u: libm's expf, Sleef's u10)
#   sigmoid(x)       4 (1 / (1 + exp(-x)): exp, the add, the reciprocal; exp's error scaled by 1 - sigmoid <= 1)
#   BCE-with-logits  (sigmoid(x) - y) * g: sigmoid's 4, the subtraction, the product: 6, terms sigmoid and |y|
#   (x - y)^2        g * (2 (x - y)): 1 (the factor 2 is exact), term 2|x - y|
#   cross-entropy    g - exp(log p) * sum(g): exp 2, the product, the subtraction: 4 (sum(g) has one non-zero
#                    term, exact), terms |g| at the target and p * |sum g|
#   Linear backward  g @ W over k outputs: k (k = 1: one product)
#   tanh backward    g * (1 - t * t): 3, terms |g| (1 + t^2)
#   z * z backward   g * z on each edge, then their sum: 2
# (A is computed in float64 from the float32 forward values; their own rounding moves it by O(u), the bound
# by O(u^2): negligible.)
U32 = 2.0**-24


def gamma(roundings: int) -> float:
    return roundings * U32 / (1 - roundings * U32)


def assert_rows_within(got: Tensor, want: Tensor, magnitude: Tensor, roundings: int) -> None:
    """|got - want| <= 2 gamma_K A entry by entry (A = ``magnitude``, float64, the rows' shape)."""
    bound = 2 * gamma(roundings) * magnitude
    excess = (got.double() - want.double()).abs() - bound
    worst = int(excess.argmax())
    assert bool((excess <= 0).all()), (
        f"rows differ by {(got.double() - want.double()).abs().flatten()[worst].item():.3e} at entry {worst}, over "
        f"the bound 2 gamma_{roundings} A = {bound.flatten()[worst].item():.3e}")


def _bce_slope(logits: Tensor, y: Tensor, c: Tensor) -> tuple[Tensor, int]:
    """|c| (sigmoid(x) + |y|) [B, M]: BCE-with-logits' backward in absolute terms, and its roundings."""
    return c.double().abs() * (torch.sigmoid(logits).double() + y.double().abs()), 6


def _mlp_rows(heads: Any, z: Tensor, slope: Tensor) -> tuple[Tensor, int]:
    """A [M, B*D] through Linear(D, 3) - Tanh - Linear(3, 1) heads given each head's output slope [B, M]:
    ((slope * |W2|) * (1 + t^2)) @ |W1|; the roundings above the slope: 1 + 3 + 3."""
    rows = []
    for task, head in enumerate(heads):
        first, _, last = head
        hidden = torch.tanh(first(z)).double()  # the forward's float32 activations
        through = slope[:, task, None] * last.weight.double().abs() * (1 + hidden**2)
        rows.append((through @ first.weight.double().abs()).reshape(-1))
    return torch.stack(rows), 7


def _linear_rows(weights: Tensor, slope: Tensor) -> Tensor:
    """A [M, B*D] through one linear map per task (row i of ``weights`` [M, D]): slope[b, i] |W[i, d]|."""
    return (slope.t()[:, :, None] * weights.double().abs()[:, None, :]).reshape(weights.shape[0], -1)


def _magnitude_cat_bce(z: Tensor, y: Tensor, heads: Any, c: Tensor) -> tuple[Tensor, int]:
    slope, roundings = _bce_slope(torch.cat([h(z) for h in heads], 1), y, c)
    return _linear_rows(torch.cat([h.weight for h in heads]), slope), roundings + 1


def _magnitude_cat_squared_cast(z: Tensor, y: Tensor, heads: Any, c: Tensor) -> tuple[Tensor, int]:
    slope = 2 * c.double().abs() * (torch.cat([h(z) for h in heads], 1) - y).double().abs()  # the casts: exact
    rows, roundings = _mlp_rows(heads, z, slope)
    return rows, 1 + roundings


def _magnitude_stack_cross_entropies(z: Tensor, y: Tensor, heads: Any, c: Tensor) -> tuple[Tensor, int]:
    rows = []
    for task, head in enumerate(heads):
        p = torch.softmax(head(z), 1).double()
        target = F.one_hot(y[:, task].long(), p.shape[1]).double()
        rows.append(((c[:, task, None].double().abs() * (target + p)) @ head.weight.double().abs()).reshape(-1))
    return torch.stack(rows), 4 + 3


def _magnitude_head_reads_z_twice(z: Tensor, y: Tensor, heads: Any, c: Tensor) -> tuple[Tensor, int]:
    # |x|'s backward multiplies by sign(x): exact; then g * W (1), g * z on both edges and their sum (2).
    rows = _linear_rows(torch.cat([h.weight for h in heads]), c.double().abs())
    return rows * 2 * z.double().abs().reshape(1, -1), 3


ROW_MAGNITUDES = {
    "cat + bce": _magnitude_cat_bce,
    "cat - y, squared, cast": _magnitude_cat_squared_cast,
    "stack of cross-entropies": _magnitude_stack_cross_entropies,
    "a head reads z twice": _magnitude_head_reads_z_twice,
}


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
    # The per-task passes and the split compute every row by the same ops in the same order (task i's pass
    # sends exact zeros through the other heads), and so every head's gradient: head i's comes out of task
    # i's pass, or of the split's one pass, by the same kernels on the same values; the other passes add
    # exact zeros to it (x + 0 = x).  Equal, then, not close.
    assert torch.equal(split_rows, loop_rows)
    for a, b in zip(split_heads, loop_heads):
        assert a is not None and b is not None and torch.equal(a, b)
    # The vmapped pass runs other kernels (batched GEMMs and element-wise ops): within the rounding model's bound.
    magnitude, roundings = ROW_MAGNITUDES[case](features, y, heads, cotangent)
    assert bool((split_rows.double().abs() <= magnitude * (1 + gamma(roundings))).all())  # A bounds |r|
    assert_rows_within(batched_rows, split_rows, magnitude, roundings)
    # The hooks are gone: a later pass over the same graph sends the heads' gradients on to z again.
    again, _ = _rows_and_head_grads(losses, z, params, 2 * cotangent, "loop")
    assert torch.equal(again, 2 * loop_rows)


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_the_rounding_bound_catches_a_row_off_by_more(case: str) -> None:
    """The derived bound can fail: a row entry moved by 1e-5 of its value (which the comparison it replaced,
    torch.testing.assert_close's float32 defaults with their atol 1e-5, let through), or by 1.5 times the
    bound, is caught."""
    make_heads, losses_of = SPLIT_CASES[case]
    x, y, trunk = _setup()
    heads = make_heads()
    features = trunk(x)
    losses = losses_of(features, y, heads)
    cotangent = torch.rand(B, M)
    rows, _ = _rows_and_head_grads(losses, (features,), list(heads.parameters()), cotangent, "split")
    magnitude, roundings = ROW_MAGNITUDES[case](features, y, heads, cotangent)
    entry = int(rows.abs().argmax())
    for shift in (1e-5 * rows.flatten()[entry].abs().item(), 3 * gamma(roundings) * magnitude.flatten()[entry].item()):
        moved = rows.clone()
        moved.view(-1)[entry] += shift
        with pytest.raises(AssertionError, match="over the bound"):
            assert_rows_within(moved, rows, magnitude, roundings)


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


def _net_row_magnitude(net: Any, z: Tensor, y: Tensor, c: Tensor) -> tuple[Tensor, int]:
    """A and K (the rounding model above) for _Net's rows: BCE, then its MLP heads or its shared Linear(D, M)."""
    with torch.no_grad():
        if isinstance(net.heads, nn.Linear):  # one GEMM over the M outputs for every row: M roundings
            slope, roundings = _bce_slope(net.heads(z), y, c)
            return _linear_rows(net.heads.weight, slope), roundings + M
        slope, roundings = _bce_slope(torch.cat([h(z) for h in net.heads], 1), y, c)
        rows, more = _mlp_rows(net.heads, z, slope)
        return rows, roundings + more


@pytest.mark.parametrize("shared_head", [False, True], ids=["separate heads", "shared head"])
def test_every_strategy_writes_the_same_grads_and_auto_splits_separate_heads(
        shared_head: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A features-mode Balancer step (MGDA, pref_lr = 0.5: w moves with the Gram) gives the same .grad with
    every strategy; "auto" takes the one-pass rows exactly where the heads are separate.

    "auto" runs the loop's ops in the loop's order (the split's rows and head gradients are the loop's, bit
    for bit: test_one_pass_gives_the_per_task_rows_and_head_grads; a shared head at M = 4 on the CPU resolves
    to "loop"), so its .grad are equal.  "batched" differs from "loop" in the rows' rounding only: each of its
    Jacobians is within the rounding model's bound of the loop's rows for the same call, and a loop run
    handed the batched run's rows writes the batched run's .grad exactly."""
    import drmoo.optim._features as features_engine

    passes = []
    one_pass = features_engine.split_task_jacobian
    monkeypatch.setattr(features_engine, "split_task_jacobian",
                        lambda *args, **kwargs: passes.append(1) or one_pass(*args, **kwargs))
    per_task = features_engine.task_jacobian
    batched_rows: list[Tensor] = []
    handed: list[Tensor] = []  # rows a loop run is given in place of its own
    x, y, _ = _setup()
    net = _Net(shared_head)

    def checked_task_jacobian(losses: Tensor, cotangent: Tensor, z: tuple[Tensor, ...], out: Tensor, *,
                              strategy: str, **kwargs: Any) -> Tensor:
        rows = per_task(losses, cotangent, z, out, strategy=strategy, **kwargs)
        if strategy == "batched":
            loop_rows = per_task(losses, cotangent, z, torch.empty_like(out), strategy="loop", feed_heads=False,
                                 retain_graph=True)
            assert_rows_within(rows, loop_rows, *_net_row_magnitude(net, z[0], y, cotangent))
            batched_rows.append(rows.clone())
        elif handed:
            rows.copy_(handed.pop(0))
        return rows

    monkeypatch.setattr(features_engine, "task_jacobian", checked_task_jacobian)
    written = {}
    for strategy in ("loop", "batched", "auto", "loop given the batched rows"):
        net = _Net(shared_head)
        if strategy == "loop given the batched rows":
            handed[:] = batched_rows
        balancer = drmoo.Balancer("mgda", net.trunk.parameters(), M, jacobian="features", lr=0.1, pref_lr=0.5,
                                  jacobian_strategy=strategy.split()[0])
        assert balancer.algorithm.jacobian_strategy == strategy.split()[0]
        for _ in range(2):
            net.zero_grad()
            losses, z = net.losses(x, y)
            balancer.backward(losses, features=z)
        written[strategy] = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        assert len(written[strategy]) == len(list(net.parameters()))
    assert passes == ([] if shared_head else [1, 1])
    assert len(batched_rows) == 2 and not handed
    for got, want in (("auto", "loop"), ("loop given the batched rows", "batched")):
        assert all(torch.equal(a, b) for a, b in zip(written[got], written[want])), (got, want)


def test_the_cli_names_the_strategy_apart_from_the_jacobians_coordinates() -> None:
    """``drmoo train --jacobian-strategy auto|loop|batched`` (``--jacobian``, its former name, is refused with
    the new spelling: tests/test_cli_options.py); ``--hp jacobian=features`` stays the coordinates' setting."""
    from drmoo import cli

    parser = cli.build_parser()
    assert parser.parse_args(["train", "--jacobian-strategy", "auto"]).jacobian_strategy == "auto"
    assert parser.parse_args(["train"]).jacobian_strategy == "loop"
    assert set(cli.JACOBIAN_STRATEGIES) == set(drmoo.jacobian.STRATEGIES)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--jacobian-strategy", "features"])
