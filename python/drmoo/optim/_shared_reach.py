"""The heads-as-shared check: a "shared" parameter that only some tasks reach is refused.

Such a parameter's Jacobian entries are exactly zero for the tasks that do not reach it, so a method's
direction gives it w_i times its task's gradient (a head's learning rate silently divided by about
m).  Parameter p counts as reached by task i when task i's gradient is nonzero on p.  A task whose
whole gradient is zero (all its sample weights zero, a zero-initialised head in front of it) tells
nothing and is left out; the check is repeated (up to :data:`SHARED_REACH_CHECKS` times) until every
task has been seen.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from drmoo import distributed
from drmoo._caller import user_stacklevel
from drmoo.jacobian import graph_leaves

# How many Jacobians at most are read for shared parameters that only some tasks reach (heads passed
# as shared): the first one whose every row is nonzero settles it (one pass over J, one host read).
SHARED_REACH_CHECKS = 10


class SharedReach:
    """The check's progress for one optimizer: how many tables it has judged (see the module docstring)."""

    def __init__(self, num_tasks: int) -> None:
        self.num_tasks = num_tasks
        self.checks_done = 0
        self.warned_unshared = False

    @property
    def pending(self) -> bool:
        """Whether the check still has to run (one task has nothing to compare; done once settled)."""
        return self.num_tasks >= 2 and self.checks_done < SHARED_REACH_CHECKS

    def check_jacobian(self, shared: Sequence[Tensor], jacobian: Tensor, settle: Callable[[], None]) -> None:
        """Judge the table read off ``jacobian`` (nothing when it is not w.r.t. the shared parameters).

        ``settle`` reads the step's NaN/Inf guards first (raising if one failed): the gradients of a failing
        step must not settle the check (a NaN row reaches every parameter)."""
        reached = reach_from_jacobian(shared, jacobian)
        if reached is not None:
            settle()
            self.checks_done = judge_shared_reach(shared, reached, self.num_tasks, self.checks_done)

    def check_features(self, shared: Sequence[Tensor], pieces: Sequence[Tensor], rows: Tensor,
                       settle: Callable[[], None]) -> None:
        """Judge the table read off features rows (:func:`reach_from_features`; ``settle``: as above), and warn
        once of trainable parameters below z that are not shared (features mode gives them no gradient)."""
        settle()
        reached, unshared = reach_from_features(shared, pieces, rows)
        if unshared and not self.warned_unshared:
            self.warned_unshared = True
            shapes = ", ".join(str(tuple(param.shape)) for param in unshared[:5])
            warnings.warn(
                f"{len(unshared)} trainable parameter(s) below the features z (shapes {shapes}"
                f"{', ...' if len(unshared) > 5 else ''}) are not among the shared parameters: jacobian=\"features\" "
                "lifts the direction to the shared parameters only, so they get no gradient and do not train. "
                "Pass them as shared parameters, or freeze them (requires_grad_(False))",
                UserWarning, stacklevel=user_stacklevel())
        self.checks_done = judge_shared_reach(shared, reached, self.num_tasks, self.checks_done)

    def check_by_backward(self, losses: Tensor, cotangent: Tensor, shared: Sequence[Tensor],
                          device: torch.device, settle: Callable[[], None]) -> None:
        """Judge the table taken by one backward per task (:func:`reach_by_backward`; ``settle``: as above)."""
        settle()
        reached = reach_by_backward(losses, cotangent, shared, self.num_tasks, device)
        self.checks_done = judge_shared_reach(shared, reached, self.num_tasks, self.checks_done)


def column_views_2d(shared: Sequence[Tensor], matrix: Tensor) -> list[Tensor]:
    """The [m, numel] column blocks of a per-task matrix [m, n], one per shared parameter (J's layout)."""
    blocks, offset = [], 0
    for param in shared:
        blocks.append(matrix[:, offset : offset + param.numel()])
        offset += param.numel()
    return blocks


def reach_from_jacobian(shared: Sequence[Tensor], jacobian: Tensor) -> Tensor | None:
    """[m, P] bool "task i reaches parameter p", read off a Jacobian w.r.t. the shared parameters
    (no extra backward); None when ``jacobian`` is not one (features rows)."""
    if jacobian.dim() != 2 or jacobian.shape[1] != sum(p.numel() for p in shared):
        return None
    with torch.no_grad():
        return torch.stack([view.any(dim=1) for view in column_views_2d(shared, jacobian != 0)], dim=1)


def reach_from_features(shared: Sequence[Tensor], pieces: Sequence[Tensor],
                        rows: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The same [m, P] table in features mode, from the rows w.r.t. z ([m, sum of the pieces' numel]) and the
    graph below each piece of z: task i reaches parameter p when its row is nonzero on a piece whose graph
    reaches p (a walk of the trunk's graph, no backward).  Also the ``nn.Parameter`` leaves below z that are
    not shared (they get no gradient in features mode)."""
    index_of = {id(param): index for index, param in enumerate(shared)}
    below = torch.zeros(len(pieces), len(shared), dtype=torch.bool)
    unshared: dict[int, Tensor] = {}
    for k, piece in enumerate(pieces):
        for leaf in graph_leaves(piece):
            index = index_of.get(id(leaf))
            if index is not None:
                below[k, index] = True
            elif isinstance(leaf, torch.nn.Parameter):
                unshared[id(leaf)] = leaf
    with torch.no_grad():
        blocks = torch.split(rows, [piece.numel() for piece in pieces], dim=1)
        reads = torch.stack([(block != 0).any(dim=1) for block in blocks])  # [pieces, m]: task i reads piece k
        if distributed.is_distributed():  # each rank's rows hold its own samples' columns
            reads = distributed.all_reduce_sum_(reads.to(torch.float32)) > 0
        reached = (reads.T.to(torch.float32) @ below.to(reads.device, torch.float32)) > 0
    return reached, list(unshared.values())


def reach_by_backward(losses: Tensor, cotangent: Tensor, shared: Sequence[Tensor], num_tasks: int,
                      device: torch.device) -> Tensor:
    """The same table for a method that forms no Jacobian (FAMO's one combined backward).

    Each task's gradient w.r.t. the shared parameters is taken alone (one backward per task, keeping
    the graph) and reduced at once to "nonzero on parameter p", so the memory is one task's gradient,
    not a Jacobian: m backward passes on the steps where the check is pending, nothing afterwards.
    """
    rows = []
    for task in range(num_tasks):
        grads = torch.autograd.grad(losses[:, task], shared, grad_outputs=cotangent[:, task].to(losses.dtype),
                                    retain_graph=True, allow_unused=True)
        with torch.no_grad():
            rows.append(torch.stack([torch.zeros((), dtype=torch.bool, device=device) if grad is None
                                     else (grad != 0).any().to(device) for grad in grads]))
        del grads
    reached = torch.stack(rows)
    if distributed.is_distributed():  # the shards' gradients sum to the global batch's
        reached = distributed.all_reduce_sum_(reached.to(torch.float32)) > 0
    return reached


def judge_shared_reach(shared: Sequence[Tensor], reached: Tensor, num_tasks: int, checks_done: int) -> int:
    """Raise if a shared parameter is reached by some informative tasks only (``reached``: [m, P] bool);
    otherwise the new count of checks done (:data:`SHARED_REACH_CHECKS` once every task has been seen)."""
    with torch.no_grad():
        informative = reached.any(dim=1)
        table = reached[informative].tolist()
    tasks = [task for task, ok in enumerate(informative.tolist()) if ok]
    for index, param in enumerate(shared):
        reaching = [task for task, row in zip(tasks, table) if row[index]]
        if reaching and len(reaching) < len(tasks):
            raise ValueError(
                f"shared parameter {index} (shape {tuple(param.shape)}) is reached only by the losses of "
                f"task(s) {reaching} of {num_tasks}: it looks like a task-specific head.  Pass only the "
                "parameters every task uses (e.g. model.trunk.parameters()) as the shared parameters -- each "
                "head then gets its own task's gradient in .grad; given as shared, its gradient would be "
                "scaled by that task's weight w_i.  If the parameter is meant to be shared by some tasks "
                "only, pass allow_partial_shared=True to drmoo.Balancer (or set "
                "optimizer.allow_partial_shared = True on a drmoo optimizer)"
            )
    # Done once every task has been seen (or after a few Jacobians); a refused step checks again.
    return SHARED_REACH_CHECKS if len(tasks) == num_tasks else checks_done + 1
