"""Per-task gradients of the shared parameters, written straight into a flat [m, n] buffer.

Given per-sample losses ``[B, m]`` (with their graph) and the cotangents ``[B, m]`` of the DR dual
objective (the weights v/B), row i of the Jacobian is the gradient of the shared parameters of
sum_b cotangent[b, i] * losses[b, i], i.e. grad_theta L^i.  Two ways of computing the rows, and a choice
between them (``jacobian_strategy`` on the optimizers and the Balancer: ``"auto"``, ``"loop"``, ``"batched"``):

* ``loop`` - m backward passes over the one forward graph.  Task i's pass returns the shared
  parameters' gradients (``torch.autograd.grad``) and one multi-tensor copy (``torch._foreach_copy_``)
  writes them into row i.  Letting autograd accumulate into ``.grad`` views of the row instead
  costs a zeroed buffer and one ``add_`` per parameter tensor per pass (three memory passes and a
  kernel launch each, against two passes and a few launches).  The price: one pass's gradients
  (n entries) are all alive until the copy, where AccumulateGrad freed each after its add.
* ``batched`` - the m passes as one, under ``torch.func.vmap``, then one multi-tensor copy into the
  buffer: a number of kernel launches that does not grow with m (convolutions and norms have batching
  rules there; torch's ``is_grads_batched``, used before, looped them over the tasks: 2,780 ops per
  step at m = 40 on ResNet18, 937 now).  The fewest launches -- what a GPU needs -- but more memory,
  and on the CPU slower through convolutions (functorch batches them as grouped convolutions).
* ``auto`` (the default) - :func:`resolve_strategy`: parameters mode takes ``batched`` on a GPU and
  ``loop`` on the CPU (the least memory traffic); features mode takes the rows of separate heads from
  one ordinary pass when the graph has them (:mod:`drmoo._head_split`), else ``batched`` on a GPU or
  above 4 tasks, ``loop`` otherwise.  Never ``batched`` through a ``torch.compile``'d backward, which torch
  cannot run under vmap (:func:`without_vmap_over_compiled`: ``auto`` takes ``loop`` there, an explicit
  ``batched`` is refused).

With ``feed_heads`` every other leaf of the graph (the task-specific heads) also accumulates the
gradient of sum_i L^i in its ``.grad`` - head i sees only task i - in the same passes (``loop``) or
one extra pass (``batched``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.autograd.graph import Node

__all__ = ["STRATEGIES", "accumulate_into_grad", "check_strategy", "column_views", "copy_into_row", "feed_head_grads",
           "gradients_arriving_at", "graph_leaves", "head_leaves", "heads_above_features", "require_reached",
           "resolve_strategy", "task_jacobian", "without_vmap_over_compiled"]

STRATEGIES: tuple[str, ...] = ("auto", "loop", "batched")
# Features mode on the CPU: the rows above z by one vmapped pass above this many tasks, else per-task passes
# (measured on ResNet18's z, B = 32, d = 512, m Linear(512, 1) heads, one thread: loop 0.7 / 13.5 / ~460 ms at
# m = 2 / 8 / 40, batched 8.9 / 5.4 / 38 ms).
BATCHED_ABOVE_TASKS = 4


def check_strategy(strategy: str) -> str:
    """``strategy`` itself if it is one of :data:`STRATEGIES`; otherwise a ValueError naming the choices."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown Jacobian strategy {strategy!r}; valid choices: {', '.join(STRATEGIES)}")
    return strategy


def resolve_strategy(strategy: str, device: torch.device, num_tasks: int, *, features: bool) -> str:
    """``"loop"`` or ``"batched"`` for ``strategy`` (``"auto"``: see the module docstring; the others as given)."""
    if check_strategy(strategy) != "auto":
        return strategy
    if device.type != "cpu":  # launches dominate: the fewest
        return "batched"
    return "batched" if features and num_tasks > BATCHED_ABOVE_TASKS else "loop"


def compiled_backward_in(losses: Tensor, above: Sequence[Tensor] = ()) -> str | None:
    """The name of a ``torch.compile``'d backward node in the graph of ``losses`` (None if it has none),
    not looking below the tensors ``above`` (features mode: only the heads, above z, are vmapped)."""
    stops = {id(t.grad_fn) for t in above if t.grad_fn is not None}
    held = [t.grad_fn for t in above]  # their wrappers, so that the walk meets these very ids
    visited: dict[int, Any] = {}
    stack: list[Any] = [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited or id(node) in stops:
            continue
        visited[id(node)] = node
        name = node.name()
        if name.startswith("CompiledFunction"):  # AOTAutograd's autograd.Function (every torch.compile backend)
            return str(name)
        stack.extend(next_node for next_node, _ in node.next_functions)
    del held
    return None


def without_vmap_over_compiled(asked: str, resolved: str, losses: Tensor, above: Sequence[Tensor] = ()) -> str:
    """``resolved``, unless it is ``"batched"`` and the graph holds a compiled backward, which torch cannot run
    under vmap: then ``"loop"`` for ``asked == "auto"``, a ValueError naming the fix for an explicit ``"batched"``."""
    if resolved != "batched" or (compiled := compiled_backward_in(losses, above)) is None:
        return resolved
    if asked == "auto":
        return "loop"
    raise ValueError(
        f"jacobian_strategy='batched' runs the per-task backward passes under torch.func.vmap, and torch cannot "
        f"run a torch.compile'd backward there (these losses' graph holds one: {compiled}); use "
        "jacobian_strategy='loop', or 'auto', which picks it for compiled code"
    )


def graph_leaves(losses: Tensor) -> Iterator[Tensor]:
    """Every leaf tensor the autograd graph of ``losses`` reaches (each once, lazily, no backward)."""
    if losses.grad_fn is None:
        if losses.requires_grad:
            yield losses
        return
    # The visited nodes are held here, not just their ids.  A graph node's Python object is a
    # wrapper that torch may create on access and free when dropped (torch 2.11 does; 2.14 keeps
    # it alive); once freed, its id is reused by the next wrapper, which would then count as
    # "seen" and cut off its whole subtree -- the heads silently got no gradient on torch 2.11.
    visited: dict[int, Any] = {}
    stack: list[Node | None] = [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor):
            yield variable
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)


def head_leaves(losses: Tensor, shared: Sequence[Tensor]) -> list[Tensor]:
    """The trainable leaves the losses depend on, other than the shared parameters (the heads).

    Found by walking the autograd graph: a backward restricted to these leaves runs only the part
    of the graph between the losses and the heads, which is what makes "the heads get their raw
    gradient" cheap for the methods whose shared-parameter backward uses task weights.
    """
    shared_ids = {id(p) for p in shared}
    leaves: list[Tensor] = []
    leaf_ids: set[int] = set()
    for variable in graph_leaves(losses):
        if id(variable) not in shared_ids and id(variable) not in leaf_ids:
            leaf_ids.add(id(variable))
            leaves.append(variable)
    return leaves


def column_views(shared: Sequence[Tensor], row: Tensor) -> list[Tensor]:
    """Views of the flat ``row`` [n], one per shared parameter, in its shape (the layout of a J row)."""
    views, offset = [], 0
    for param in shared:
        views.append(row[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
    return views


def copy_into_row(shared: Sequence[Tensor], row: Tensor, values: Sequence[Tensor | None]) -> None:
    """Write one tensor per shared parameter (None: zeros, e.g. an unused parameter's gradient)
    into its view of the flat ``row`` [n], with one multi-tensor copy."""
    views = column_views(shared, row)
    given = [(view, value) for view, value in zip(views, values) if value is not None]
    with torch.no_grad():
        if given:
            torch._foreach_copy_([view for view, _ in given], [value for _, value in given])
        for view, value in zip(views, values):
            if value is None:
                view.zero_()


def accumulate_into_grad(leaves: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """``leaf.grad += grad`` as autograd's AccumulateGrad does it (the first gradient is taken, in
    the leaf's layout; later ones are added in place); None (an unused leaf) leaves ``.grad`` as it is."""
    with torch.no_grad():
        for leaf, grad in zip(leaves, grads):
            if grad is None:
                continue
            if leaf.grad is None:
                leaf.grad = grad if grad.stride() == leaf.stride() else torch.empty_like(leaf).copy_(grad)
            else:
                leaf.grad.add_(grad)


def require_reached(grads: Sequence[Tensor | None]) -> None:
    """Refuse losses whose graph reaches none of the shared parameters (autograd's None gradients,
    known from the graph, not the values): they would be taken as zero gradients, a silent no-op."""
    if all(grad is None for grad in grads):
        raise ValueError(
            "the losses do not depend on the shared parameters (their autograd graph reaches none of them): "
            "compute the losses from the parameters given to the optimizer"
        )


def _backward_into(shared: Sequence[Tensor], row: Tensor, losses: Tensor, cotangent: Tensor, *,
                   retain_graph: bool, heads: Sequence[Tensor]) -> None:
    """One backward pass: the shared parameters' gradient is written into ``row`` (a [n] view, every
    entry), the ``heads``' gradients accumulate into their ``.grad``."""
    grads = torch.autograd.grad(losses, [*shared, *heads], grad_outputs=cotangent, retain_graph=retain_graph,
                                allow_unused=True)
    require_reached(grads[: len(shared)])
    copy_into_row(shared, row, grads[: len(shared)])
    accumulate_into_grad(heads, grads[len(shared):])


def task_jacobian(
    losses: Tensor,
    cotangent: Tensor,
    shared: Sequence[Tensor],
    out: Tensor,
    *,
    strategy: str = "loop",
    feed_heads: bool = True,
    retain_graph: bool = False,
    heads: Sequence[Tensor] | None = None,
) -> Tensor:
    """Fill ``out`` [m, n] with the per-task gradients of ``shared``; returns ``out``.

    ``retain_graph``: keep the losses' graph after the last pass (another backward over it follows).
    ``heads``: the leaves to feed (with ``feed_heads``), when the caller knows them; by default every
    leaf of the graph other than ``shared`` (:func:`head_leaves`).  ``shared`` may also be the
    representation z (features mode): its rows are then the gradients with respect to z, and the
    heads the leaves above z (:func:`heads_above_features`).
    """
    num_tasks = losses.shape[1]
    strategy = without_vmap_over_compiled(strategy, resolve_strategy(strategy, out.device, num_tasks, features=False),
                                          losses, shared)
    n = sum(p.numel() for p in shared)
    if tuple(out.shape) != (num_tasks, n):
        raise ValueError(f"Jacobian buffer has shape {tuple(out.shape)}, expected ({num_tasks}, {n})")
    cotangent = cotangent.to(losses.dtype)
    if not feed_heads:
        heads = []
    elif heads is None:
        heads = head_leaves(losses, shared)
    if strategy == "loop":
        for task in range(num_tasks):
            task_cotangent = torch.zeros_like(cotangent)
            task_cotangent[:, task] = cotangent[:, task]
            _backward_into(shared, out[task], losses, task_cotangent, retain_graph=retain_graph or task < num_tasks - 1,
                           heads=heads)
        return out

    # batched: grad_outputs[i] is the cotangent restricted to column i; the m passes run as one under
    # torch.func.vmap (module docstring).  vmap returns tensors only: the parameters the losses do not
    # reach (known from the graph) are left out of the pass and written as zeros.
    eye = torch.eye(num_tasks, dtype=cotangent.dtype, device=cotangent.device)
    batched_cotangent = eye[:, None, :] * cotangent[None, :, :]
    reached = _reached(losses, shared)
    require_reached([param if ok else None for param, ok in zip(shared, reached)])
    inputs = [param for param, ok in zip(shared, reached) if ok]
    keep_graph = retain_graph or bool(heads)

    def task_pass(task_cotangent: Tensor) -> tuple[Tensor, ...]:
        return torch.autograd.grad(losses, inputs, grad_outputs=task_cotangent, retain_graph=keep_graph,
                                   materialize_grads=True)

    grads = iter(torch.func.vmap(task_pass)(batched_cotangent))
    blocks, values, offset = [], [], 0
    with torch.no_grad():
        for param, ok in zip(shared, reached):
            block = out[:, offset : offset + param.numel()]
            offset += param.numel()
            if ok:
                blocks.append(block)
                values.append(next(grads).reshape(num_tasks, -1))
            else:  # a parameter the losses do not reach: a zero gradient
                block.zero_()
        torch._foreach_copy_(blocks, values)
    feed_head_grads(losses, heads, cotangent, retain_graph=retain_graph)  # one more pass, for the heads only
    return out


def _reached(losses: Tensor, shared: Sequence[Tensor]) -> list[bool]:
    """Whether the graph of ``losses`` reaches each of ``shared`` (a leaf: among the graph's leaves; a
    tensor with a graph of its own, e.g. the features z, counts as reached: its caller checked it)."""
    leaves = {id(leaf) for leaf in graph_leaves(losses)}
    return [param.grad_fn is not None or id(param) in leaves for param in shared]


def feed_head_grads(losses: Tensor, heads: Sequence[Tensor], cotangent: Tensor, *, retain_graph: bool) -> None:
    """One backward pass restricted to ``heads`` (it only traverses the graph above them): their
    gradients of sum_b,i cotangent[b, i] * losses[b, i] accumulate into their ``.grad``."""
    if heads:
        grads = torch.autograd.grad(losses, heads, grad_outputs=cotangent.to(losses.dtype), retain_graph=retain_graph,
                                    allow_unused=True)
        accumulate_into_grad(heads, grads)


def _send_nothing_below(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    return tuple(None if grad is None else torch.zeros_like(grad) for grad in grad_outputs)


@contextmanager
def gradients_arriving_at(features: Sequence[Tensor]) -> Iterator[None]:
    """While active, a backward pass w.r.t. the pieces of z takes each piece's gradient as it arrives there:
    the *partial* gradient, before the piece's own tensor hooks.  The lift then applies both once.

    Partials: when one piece is computed from another (z2 = f(z), features=(z, z2): heads reading two stages
    of the trunk), autograd's gradient w.r.t. z also carries what reaches z through z2, and the lift sends
    z2's row down through f again: that path would count twice.  Each piece's node gets a pre-hook that
    sends zeros below it -- autograd has already taken the piece's gradient (captured before the node runs),
    and nothing more reaches the pieces under it -- so row i is [dL^i/dz, dL^i/dz2] with the other piece
    held fixed (the rows the one-pass head split takes), and the lift's backward through the trunk adds the
    path through f exactly once.  A piece under which no other lies is not run at all.

    Hooks: a hook registered on a piece (``z.register_hook(lambda g: -g)``, a gradient reversal) would run
    on every row (m times, and on the head split's empty edges with None) and again in the lift.  It is set
    aside here, so that it transforms the one gradient that goes down into the trunk, as in parameters mode.
    """
    nodes: dict[int, Any] = {}  # held: see graph_leaves on wrapper lifetimes
    for piece in features:
        if piece.grad_fn is not None:
            nodes.setdefault(id(piece.grad_fn), piece.grad_fn)
    handles = [node.register_prehook(_send_nothing_below) for node in nodes.values()]
    # A tensor's hooks live in its _backward_hooks dict, which its node reads when it runs: emptied here.
    set_aside = [(hooks, dict(hooks)) for piece in features if (hooks := piece._backward_hooks)]
    for hooks, _ in set_aside:
        hooks.clear()
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for hooks, saved in set_aside:
            hooks.update(saved)


def heads_above_features(losses: Tensor, features: Sequence[Tensor], shared: Sequence[Tensor]) -> list[Tensor]:
    """The trainable leaves between ``losses`` and the representation ``features`` (the heads), found
    by walking the graph of ``losses`` down to z and no further; refuses a graph in which z is not
    the only way down to the trunk.  Structural: no backward pass, no tensor value read.

    Raises ValueError naming the problem when a piece of z is not reached (the losses do not depend
    on it: z of another batch or of another forward), when the losses and z come out of one autograd
    node (a model compiled as one ``torch.compile`` graph: z is internal to it), when the losses reach
    another output of the node that made z, or a shared parameter, without passing through z (a head
    that reads the trunk's parameters or an intermediate of the trunk directly: its gradient would
    be left out of the features Jacobian).
    """
    # z's nodes (and the outputs of each that are pieces of z); the wrappers are held here so that
    # the node objects met in the walk are these very objects (see graph_leaves on wrapper lifetimes).
    z_nodes: dict[int, tuple[Any, set[int]]] = {}
    z_leaves: dict[int, int] = {}  # id(leaf piece) -> its index in features
    for index, piece in enumerate(features):
        node = piece.grad_fn
        if node is None:
            z_leaves[id(piece)] = index
        else:
            z_nodes.setdefault(id(node), (node, set()))[1].add(piece.output_nr)
    start = losses.grad_fn
    if start is None:
        raise ValueError("the losses have no autograd graph: they cannot depend on the features z")
    if id(start) in z_nodes:
        raise ValueError(
            "the losses and the features z come out of one autograd node (e.g. trunk and heads compiled as one "
            "torch.compile graph, in which z is internal): compile the trunk and the heads separately, so that z "
            "is the trunk's output"
        )
    shared_ids = {id(p) for p in shared}
    reached: set[tuple[int, int]] = set()
    bypassed: Tensor | None = None  # a shared parameter reached without passing through z
    heads: list[Tensor] = []
    head_ids: set[int] = set()
    visited: dict[int, Any] = {}
    stack = [start]
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor):
            if id(variable) in z_leaves:
                reached.add((id(variable), 0))
            elif id(variable) in shared_ids:
                bypassed = variable if bypassed is None else bypassed  # reported after the walk (see below)
            elif id(variable) not in head_ids:
                head_ids.add(id(variable))
                heads.append(variable)
            continue
        for next_node, output_nr in node.next_functions:
            if next_node is None:
                continue
            entry = z_nodes.get(id(next_node))
            if entry is None:
                stack.append(next_node)
            elif output_nr in entry[1]:
                reached.add((id(next_node), output_nr))  # z: below it is the trunk, not walked
            else:
                raise ValueError(
                    "the losses read an output of the trunk's last operation that is not among the features z "
                    "(pass every tensor the heads read from the trunk as z, e.g. a tuple)"
                )
    for index, piece in enumerate(features):
        key = (id(piece), 0) if piece.grad_fn is None else (id(piece.grad_fn), piece.output_nr)
        if key not in reached:
            raise ValueError(
                f"the losses do not depend on features[{index}] (shape {tuple(piece.shape)}): z must be the trunk's "
                "output that the heads read to compute these losses (not z of another batch or another forward)"
            )
    if bypassed is not None:
        raise ValueError(
            f"the losses reach a shared parameter (shape {tuple(bypassed.shape)}) without passing through the "
            "features z: a head reads the trunk's parameters (or an intermediate of the trunk) directly. With "
            "jacobian='features' every path from the losses to the shared parameters must go through z"
        )
    return heads
