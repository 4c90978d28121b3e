"""Features mode's rows of J_z for one shared linear head, as outer products from one pass (drmoo._linear_head).

The rows must be the per-task passes' rows (exactly: those passes only add zeros), the step they drive the
one the loop strategy drives, and any graph that is not "element-wise loss of one linear layer of z" must be
left to the generic path.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import drmoo
from drmoo._linear_head import linear_head

TASKS, BATCH, D_Z = 5, 6, 4
LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "bce": lambda logits, y: F.binary_cross_entropy_with_logits(logits, y, reduction="none"),
    "squared": lambda logits, y: (logits - y) ** 2,
    "scaled-softplus": lambda logits, y: 0.5 * F.softplus(logits.double()).float() * y,
}


def _problem(bias: bool = True, seed: int = 0) -> tuple[nn.Module, nn.Linear, Tensor, Tensor]:
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(3, D_Z), nn.Tanh())
    head = nn.Linear(D_Z, TASKS, bias=bias)
    return trunk, head, torch.randn(BATCH, 3), torch.rand(BATCH, TASKS)


def _per_task_rows(losses: Tensor, z: Tensor, cotangent: Tensor) -> Tensor:
    rows = []
    for task in range(TASKS):
        masked = torch.zeros_like(cotangent)
        masked[:, task] = cotangent[:, task]
        rows.append(torch.autograd.grad(losses, z, masked, retain_graph=True)[0].reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_rows_are_the_per_task_passes_rows(loss: str, bias: bool) -> None:
    trunk, head, x, y = _problem(bias)
    z = trunk(x)
    losses = LOSSES[loss](head(z), y)
    found = linear_head(losses, [z])
    assert found is not None and found.weight is head.weight
    cotangent = torch.rand(BATCH, TASKS)
    out = torch.empty(TASKS, BATCH * D_Z)
    grads = found.rows_into(losses, cotangent, out, inputs=list(head.parameters()), retain_graph=True)
    torch.testing.assert_close(out, _per_task_rows(losses, z, cotangent), rtol=0, atol=0)
    want = torch.autograd.grad(losses, list(head.parameters()), cotangent, retain_graph=True)
    for got, expected in zip(grads, want):  # the heads' gradients come from the same pass
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_separate_heads_rows_are_the_per_task_passes_rows(loss: str) -> None:
    """m Linear(d, 1) joined by torch.cat: the same outer products, W their weights stacked."""
    trunk, _, x, y = _problem()
    heads = nn.ModuleList(nn.Linear(D_Z, 1, bias=task % 2 == 0) for task in range(TASKS))
    z = trunk(x)
    losses = LOSSES[loss](torch.cat([head(z) for head in heads], dim=1), y)
    found = linear_head(losses, [z])
    assert found is not None
    cotangent = torch.rand(BATCH, TASKS)
    out = torch.empty(TASKS, BATCH * D_Z)
    grads = found.rows_into(losses, cotangent, out, inputs=list(heads.parameters()), retain_graph=True)
    torch.testing.assert_close(out, _per_task_rows(losses, z, cotangent), rtol=0, atol=0)
    want = torch.autograd.grad(losses, list(heads.parameters()), cotangent, retain_graph=True)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_with_no_head_fed_the_pass_ends_at_the_heads_output(layout: str) -> None:
    """No inputs: the same rows, from a pass that runs nothing below the logits (no head's node, nothing at z)."""
    trunk, head, x, y = _problem()
    heads = nn.ModuleList(nn.Linear(D_Z, 1, bias=task % 2 == 0) for task in range(TASKS))
    z = trunk(x)
    logits = head(z) if layout == "shared" else torch.cat([h(z) for h in heads], dim=1)
    losses = LOSSES["bce"](logits, y)
    found = linear_head(losses, [z])
    assert found is not None
    below = [found.node] if layout == "shared" else [node for node, _ in found.node.next_functions]
    ran: list[object] = []
    handles = [node.register_prehook(lambda grads, node=node: ran.append(node)) for node in below]
    reached_z: list[Tensor] = []
    handles.append(z.register_hook(reached_z.append))
    cotangent = torch.rand(BATCH, TASKS)
    out = torch.empty(TASKS, BATCH * D_Z)
    try:
        grads = found.rows_into(losses, cotangent, out, inputs=[], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    assert grads == () and ran == [] and reached_z == []
    torch.testing.assert_close(out, _per_task_rows(losses, z, cotangent), rtol=0, atol=0)


# Passes through each head per Balancer step: the one that feeds the heads (Double-Loop's Y_tilde^T w is a
# gradient of z, one more pass through them).
HEAD_PASSES = {"modo": 1, "sdmgrad": 1, "mgda": 1, "double-loop": 2}


@pytest.mark.parametrize("method", sorted(HEAD_PASSES))
def test_a_balancer_step_runs_the_separate_heads_backward_only_where_needed(method: str) -> None:
    """The rows' passes that feed no head (MoDo's, SDMGrad's, Double-Loop's Y_bar) stop at the logits instead
    of going on through every head to z, a gradient of z that nothing reads."""
    trunk, _, x, y = _problem()
    heads = nn.ModuleList(nn.Linear(D_Z, 1) for _ in range(TASKS))
    extra = {"seed": 0} if method == "double-loop" else {}
    balancer = drmoo.Balancer(method, trunk.parameters(), TASKS, jacobian="features", lr=0.1, **extra)
    z = trunk(x)
    columns = [h(z) for h in heads]
    ran: list[object] = []
    handles = [column.grad_fn.register_prehook(lambda grads, node=column.grad_fn: ran.append(node))
               for column in columns]
    try:
        balancer.backward(LOSSES["bce"](torch.cat(columns, dim=1), y), features=z)
    finally:
        for handle in handles:
            handle.remove()
    assert len(ran) == HEAD_PASSES[method] * TASKS and len({id(node) for node in ran}) == TASKS
    assert all(h.weight.grad is not None for h in heads)


def test_a_balancer_step_is_the_loop_strategys() -> None:
    written = []
    for strategy in ("auto", "loop"):
        trunk, head, x, y = _problem()
        balancer = drmoo.Balancer("mgda", trunk.parameters(), TASKS, jacobian="features", lr=0.1,
                                  jacobian_strategy=strategy)
        z = trunk(x)
        balancer.backward(LOSSES["bce"](head(z), y), features=z)
        written.append([p.grad.clone() for p in (*trunk.parameters(), *head.parameters())])
    for got, want in zip(*written):
        # The same rows (tested above); their Gram from its factors differs from J J^T by rounding only
        # (<= gamma_(Bd+1) |J||J|^T: ~2e-6 relative here), which moves w, and the step, by that much at most.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_the_gram_from_the_factors_is_the_rows_gram(layout: str) -> None:
    """(G^T G) (.) (W W^T) = J J^T, within the rounding bound of the rows' own product: gamma_(Bd+1) |J||J|^T."""
    trunk, head, x, y = _problem()
    z = trunk(x)
    logits = head(z) if layout == "shared" else torch.cat([nn.Linear(D_Z, 1)(z) for _ in range(TASKS)], dim=1)
    losses = LOSSES["bce"](logits, y)
    found = linear_head(losses, [z])
    assert found is not None
    rows = torch.empty(TASKS, BATCH * D_Z)
    found.rows_into(losses, torch.rand(BATCH, TASKS), rows, inputs=[z], retain_graph=True)
    got = found.gram()
    assert torch.equal(got, got.T)
    exact = rows.double() @ rows.double().T
    unit = 2.0**-24
    depth = BATCH * D_Z + 1
    bound = depth * unit / (1 - depth * unit) * (rows.double().abs() @ rows.double().abs().T)
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_the_engine_takes_the_factors_only_for_the_rows_as_written() -> None:
    """Rows changed in place after they were written (a loss scale divided out) get the gram op instead."""
    from drmoo.optim import create
    from drmoo_kernels import backend_module

    trunk, head, x, y = _problem()
    optimizer = create("mgda", trunk.parameters(), TASKS, jacobian="features", lr=0.1)
    engine = optimizer.jacobian_engine
    z = trunk(x)
    losses = LOSSES["bce"](head(z), y)
    engine.features = (z,)
    rows = engine.task_jacobian(optimizer, losses, torch.rand(BATCH, TASKS), "J", heads=[])
    ops = backend_module("reference")
    assert engine._factored is not None and engine._factored[0] is rows  # the linear heads' rows, factored
    torch.testing.assert_close(engine.gram(ops, rows), ops.gram(rows))  # (float32 rounding apart)
    rows.mul_(2.0)  # the factors would now give a quarter of the rows' Gram
    torch.testing.assert_close(engine.gram(ops, rows), ops.gram(rows), rtol=0, atol=0)


def _mixing_loss(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    logits = head(z)
    return logits - logits.mean(dim=1, keepdim=True), z  # each column reads every logit


def _second_reader(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (head(z) - y) ** 2 + z.sum(dim=1, keepdim=True), z  # z reaches the losses twice


def _two_layers(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (head(torch.relu(z)) - y) ** 2, z  # the head does not read z itself


def _bias_from_z(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (torch.addmm(z[0, :1].expand(TASKS), z, head.weight.T) - y) ** 2, z  # a bias computed from z


def _computed_weight(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (F.linear(z, 2.0 * head.weight, head.bias) - y) ** 2, z  # W is not a leaf


def _a_hidden_layer(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    columns = [head(z)[:, :1]] + [nn.functional.linear(z, head.weight[task:task + 1]) for task in range(1, TASKS)]
    return (torch.cat(columns, dim=1) - y) ** 2, z  # separate columns, but not each a layer of z with a leaf weight


def _cat_of_wider_pieces(trunk: nn.Module, head: nn.Linear, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = trunk(x)
    return (torch.cat([head(z)[:, :2], head(z)[:, 2:]], dim=1) - y) ** 2, z  # pieces of width 2 and 3


@pytest.mark.parametrize("build", [_mixing_loss, _second_reader, _two_layers, _bias_from_z, _computed_weight,
                                   _a_hidden_layer, _cat_of_wider_pieces])
def test_other_graphs_are_left_to_the_generic_path(build: Callable[..., tuple[Tensor, Tensor]]) -> None:
    trunk, head, x, y = _problem()
    losses, z = build(trunk, head, x, y)
    assert linear_head(losses, [z]) is None
