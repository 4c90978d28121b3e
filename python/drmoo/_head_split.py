"""Per-task rows of J_z in ONE backward pass, for separate heads (the features-mode ``"auto"`` strategy).

Features mode needs J_z[i] = d (sum_b c[b, i] L[b, i]) / dz for every task i.  The generic ways pay for the
heads m times over when every task has its own head and the columns are joined by ``torch.cat``: a
per-task pass walks every head's backward (the cotangent is zero on the other columns, but autograd runs
them), and one vmapped pass sends the whole batched cotangent [m, B, 1] through every head and sums m
gradients [m, B, d] at z -- Theta(m^2 B d) work for rows of Theta(m B d).

When the graph above z says that task i's loss column is computed by a subgraph of its own, each head's
contribution to dz IS its task's row, and one ordinary backward pass produces all of them: it only has to
be caught before autograd sums the heads' contributions at z.  :func:`task_split` reads that structure
off the graph (no backward, no tensor value read):

* from the losses [B, m] down, a chain of element-wise nodes (the per-sample loss, ``- y``, ``** 2``,
  a cast, ...: each with one input on the path, of the losses' own shape [B, m], so no column reads
  another);
* then a ``torch.cat`` along the task dimension of m pieces of width 1 (``[B, 1]`` each), or a
  ``torch.stack`` of m pieces ``[B]`` along it -- task i's column is piece i;
* below piece i, the nodes down to z (its head) shared with no other piece: a parameter, a hidden layer
  or an intermediate used by two heads makes the split refuse.

:func:`split_task_jacobian` then runs one backward of sum_b,i c[b, i] L[b, i] with a hook on each node
that reads z: the hook keeps the gradient the node sends to z as its task's row and sends nothing on to
z (so autograd does not sum them), one multi-tensor copy writes the rows into the Jacobian's buffer, and
the heads' own gradients come out of the same pass.  Each row
gets exactly the values the per-task passes compute (the other tasks' heads only ever added zeros), in
Theta(m B d) work and one pass -- as one shared ``Linear(d, m)`` head gets from the vmapped pass.
Anything else (a shared head, a loss mixing the tasks' columns, heads sharing a layer) returns None from
:func:`task_split`, and the caller takes the generic path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["TaskSplit", "elementwise_chain", "split_task_jacobian", "task_split"]

# Autograd nodes whose output entry (b, i) depends on the same entry of their one input on the path only,
# whatever their other inputs (targets, weights that need no grad): the per-sample losses and the
# element-wise arithmetic a loss is written with.
ELEMENTWISE_NODES = frozenset({
    "AbsBackward0", "AddBackward0", "AddBackward1", "BinaryCrossEntropyBackward0",
    "BinaryCrossEntropyWithLogitsBackward0", "ClampBackward1", "ClampMaxBackward0", "ClampMinBackward0",
    "DivBackward0", "DivBackward1", "ExpBackward0", "HuberLossBackward0", "L1LossBackward0", "Log1pBackward0",
    "LogBackward0", "LogSigmoidBackward0", "MseLossBackward0", "MulBackward0", "MulBackward1", "NegBackward0",
    "PowBackward0", "PowBackward1", "ReluBackward0", "RsubBackward0", "RsubBackward1", "SigmoidBackward0",
    "SmoothL1LossBackward0", "SoftMarginLossBackward0", "SoftplusBackward0", "SqrtBackward0", "SubBackward0",
    "SubBackward1", "TanhBackward0", "ToCopyBackward0",
})


@dataclass
class TaskSplit:
    """For each task, the (node, edge index, piece of z) triples through which its head reads z."""

    readers: list[list[tuple[Any, int, int]]]


def _shape(node: Any, output_nr: int) -> list[int] | None:
    """The shape of output ``output_nr`` of the forward op behind ``node`` (None where torch does not say)."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None or output_nr >= len(metadata):
        return None
    return list(metadata[output_nr].shape)


def _saved_dim(node: Any) -> int | None:
    """The ``dim`` a cat/stack node saved, as a signed int (torch reports ``dim=-1`` as 2**64 - 1)."""
    dim = getattr(node, "_saved_dim", None)
    if not isinstance(dim, int):
        return None
    return dim - 2**64 if dim >= 2**63 else dim


def elementwise_chain(losses: Tensor, is_z: Callable[[Any, int], bool]) -> tuple[list[Any], Any] | None:
    """From ``losses``' node [B, m] down its chain of element-wise nodes (:data:`ELEMENTWISE_NODES`, each with one
    input on the path, of the losses' shape): (the chain's nodes, the first node below it), or None when a node
    has two inputs on the path (or none), its input is broadcast along the tasks, or is z (``is_z(node,
    output_nr)``)."""
    shape = list(losses.shape)
    node: Any = losses.grad_fn
    chain: list[Any] = []
    if node is None:
        return None
    while node.name() in ELEMENTWISE_NODES:
        if _shape(node, 0) != shape:
            return None
        edges = {(id(n), nr): (n, nr) for n, nr in node.next_functions if n is not None}
        if len(edges) != 1:
            return None  # two inputs on the path (or none): not a plain element-wise chain
        ((below, output_nr),) = edges.values()
        if is_z(below, output_nr) or _shape(below, output_nr) != shape:
            return None  # the input is broadcast along the tasks, or is z itself
        chain.append(node)
        node = below
    return chain, node


def task_split(losses: Tensor, features: Sequence[Tensor]) -> TaskSplit | None:
    """The per-task structure of the graph between ``losses`` [B, m] and z (module docstring), or None."""
    if losses.dim() != 2 or losses.grad_fn is None:
        return None
    rows, num_tasks = losses.shape
    pieces: dict[tuple[int, int], int] = {}  # (id(node), output_nr) of each piece of z -> its index
    leaf_pieces: dict[int, int] = {}  # id(leaf piece) -> its index (a z that is a leaf: AccumulateGrad nodes)
    # z's node wrappers are held while their ids are keys: torch 2.11 frees a wrapper as soon as it is
    # dropped, and the walk's wrappers then never had z's ids (see graph_leaves on wrapper lifetimes).
    z_nodes: list[Any] = []
    for index, tensor in enumerate(features):
        node = tensor.grad_fn
        if node is None:
            leaf_pieces[id(tensor)] = index
        else:
            z_nodes.append(node)
            pieces[(id(node), tensor.output_nr)] = index

    def piece_of(node: Any, output_nr: int) -> int | None:
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            return leaf_pieces.get(id(variable))
        return pieces.get((id(node), output_nr))

    # The element-wise chain at the top.  (Node wrappers are held in `above`: see graph_leaves on their ids.)
    walked = elementwise_chain(losses, lambda below, output_nr: piece_of(below, output_nr) is not None)
    if walked is None:
        return None
    chain, node = walked
    above: dict[int, Any] = {id(link): link for link in chain}
    name = node.name()
    if name not in ("CatBackward0", "StackBackward0") or _saved_dim(node) not in (1, -1):
        return None
    if len(node.next_functions) != num_tasks:
        return None
    above[id(node)] = node
    column = [rows, 1] if name == "CatBackward0" else [rows]
    readers: list[list[tuple[Any, int, int]]] = []
    for head, output_nr in node.next_functions:
        mine: dict[int, Any] = {}
        reads: list[tuple[Any, int, int]] = []
        if head is not None:
            if _shape(head, output_nr) != column or piece_of(head, output_nr) is not None:
                return None  # a piece of another width (one head for several tasks), or z itself as a column
            stack: list[Any] = [head]
            while stack:
                current = stack.pop()
                if id(current) in mine:
                    continue
                if id(current) in above:
                    return None  # shared with another task's head, or with the chain above
                mine[id(current)] = current
                for edge, (below, nr) in enumerate(current.next_functions):
                    if below is None:
                        continue
                    piece = piece_of(below, nr)
                    if piece is not None:
                        reads.append((current, edge, piece))
                    else:
                        stack.append(below)
        above.update(mine)
        readers.append(reads)
    return TaskSplit(readers)


def split_task_jacobian(losses: Tensor, cotangent: Tensor, features: Sequence[Tensor], out: Tensor,
                        split: TaskSplit, *, heads: Sequence[Tensor], retain_graph: bool) -> tuple[Tensor | None, ...]:
    """Fill ``out`` [m, sum of z's numel] with the rows of J_z by one backward pass (module docstring).

    Returns the gradients of ``heads`` of sum_b,i cotangent[b, i] losses[b, i] (None: a head not reached).
    """
    offsets, offset = [], 0
    for tensor in features:
        offsets.append(offset)
        offset += tensor.numel()
    caught: dict[tuple[int, int], list[Tensor]] = {}  # (task, piece of z) -> what its head sent to that piece

    def catch(task: int, edge: int, piece: int) -> Any:
        def hook(grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]) -> Any:
            grad = grad_inputs[edge]
            if grad is None:
                return None
            caught.setdefault((task, piece), []).append(grad)
            return tuple(None if index == edge else g for index, g in enumerate(grad_inputs))

        return hook

    handles = [node.register_hook(catch(task, edge, piece))
               for task, reads in enumerate(split.readers) for node, edge, piece in reads]
    try:
        grads = torch.autograd.grad(losses, [*features, *heads], grad_outputs=cotangent.to(losses.dtype),
                                    retain_graph=retain_graph, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    blocks, values = [], []
    with torch.no_grad():
        for task in range(len(split.readers)):
            for piece, start in enumerate(offsets):
                block = out[task, start: start + features[piece].numel()].view(features[piece].shape)
                parts = caught.get((task, piece))
                if parts is None:  # a head that does not read this piece: a zero row block
                    block.zero_()
                    continue
                total = parts[0]
                for part in parts[1:]:  # a head that reads the piece more than once
                    total = total + part
                blocks.append(block)
                values.append(total)
        if blocks:
            torch._foreach_copy_(blocks, values)  # one multi-tensor copy for all the rows
    return grads[len(features):]
