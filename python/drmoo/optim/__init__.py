"""drmoo optimizers: drop-in ``torch.optim``-style multi-objective optimizers on the DR dual.

One file per method.  ``available()`` maps the registry names to classes; ``create(name, params,
num_tasks, **overrides)`` builds one by name.

Capturable steps.  Every optimizer takes ``capturable: bool = False``, with the meaning it has in
``torch.optim.Adam``: with ``capturable=True`` a steady-state ``step()`` makes no host read -- no
``.item()``, ``bool(tensor)``, ``float(tensor)``, ``.tolist()``, no Python branch on a tensor's value
-- so the host never waits for the device, and the step can be captured in a CUDA graph.

* Non-finite values.  Eagerly (the default) a NaN/Inf in the losses, the dual quantities or the
  gradients raises :class:`NonFiniteStepError` before anything is written, naming what was not
  finite.  The checks are not read one by one: a step reads them all at once, with ONE host read, at
  its first write of theta or of its state (or at its end); only a failing step reads which one failed.
  Capturable, the same checks are OR-ed into a 0-d bool on the device ("found_inf", as in
  ``torch.amp.GradScaler``), and every write of the step -- theta, eta, w, the method's state --
  is masked by it: a non-finite step is skipped on the device and writes nothing.  The heads' grads
  receive zeros from a skipped step.  ``stats["found_inf"]`` (0-d float, 1 if this step was
  skipped) and ``stats["skipped_steps"]`` / ``state["drmoo"]["skipped_steps"]`` (0-d int64, the
  running count, in ``state_dict``) report it.  Negative or non-finite importance weights also
  skip the step instead of raising.
* Counters.  ``state["drmoo"]["step"]`` (``steps_taken``) counts calls of ``step`` in capturable
  mode, skipped ones included (successful steps = step - skipped_steps); Nash-MTL's weight-update
  schedule (``update_every``) follows it.  Double-Loop draws its inner indices from a host-side
  ``random.Random`` (in ``state_dict``), which a skipped step consumes all the same.
* CUDA graphs.  Host-side decisions are frozen into a captured graph: Nash-MTL with
  ``update_every > 1`` needs one graph per branch, and Double-Loop's captured indices would repeat
  on every replay (do not capture it).  Keep the heads' ``.grad`` allocated (zero them in place) so
  that the graph's memory stays static.
* Small writes.  ``t[i] = 1.0`` on a CUDA tensor ``t`` (a 0-d target) is a synchronising host
  copy (seen on an H200, torch 2.11, in MGDA's active set); the solvers write ``t[i:i+1].fill_``.
* Cost.  The theta update forms J^T w in a buffer before writing it (a skipped step must not write
  0 * NaN), and FAMO restores theta on the device after its re-evaluation; otherwise the step does
  the same work as the eager one and follows the same trajectory up to rounding.

Gradient accumulation.  A closure may return its batch in micro-batches: an iterable (a generator, say)
of ``MicroBatch`` -- each one's per-sample losses, or a callable that computes them -- instead of one
``Losses`` (see ``Closure``).  The step is then the one it takes on the batch they make together (the
same theta, eta, w, state and heads' ``.grad``, to rounding), with one micro-batch's graph in memory at a
time for callables (two for losses: the next one's forward pass runs before the current one is known not
to be the last).  Every closure call is one batch, so MoDo's and SDMGrad's three draws and FAMO's
re-evaluation keep their meaning.  MGDA, MoDo, SDMGrad, MoCo, Nash-MTL and FAMO accumulate (MoCo aside in
``jacobian="features"``, where a step's later draws return the first draw's iterable itself: its one
batch), capturable steps included (one host read per step, none when capturable); Double-Clip and
Double-Loop (their gradients are taken at an eta the whole batch decides) and FSDP-sharded parameters are
refused, naming the reason and what to do.
"""

from __future__ import annotations

import inspect
from typing import Any

from ._base import MultiObjectiveOptimizer
from ._features_rate import FeaturesRateWarning
from ._guards import NonFiniteStepError
from .double_clip import DoubleClipMGDA
from .double_loop import DoubleLoopMGDA
from .famo import FAMO
from .mgda import MGDA
from .moco import MoCo
from .modo import MoDo
from .nashmtl import NashMTL
from .sdmgrad import SDMGrad
from .types import Closure, Losses, MicroBatch, ParamsT

__all__ = [
    "FAMO",
    "MGDA",
    "Closure",
    "DoubleClipMGDA",
    "DoubleLoopMGDA",
    "FeaturesRateWarning",
    "Losses",
    "MicroBatch",
    "MoCo",
    "MoDo",
    "MultiObjectiveOptimizer",
    "NashMTL",
    "NonFiniteStepError",
    "ParamsT",
    "SDMGrad",
    "available",
    "create",
]

_REGISTRY: dict[str, type[MultiObjectiveOptimizer]] = {
    "double-clip": DoubleClipMGDA,
    "double-loop": DoubleLoopMGDA,
    "mgda": MGDA,
    "modo": MoDo,
    "moco": MoCo,
    "sdmgrad": SDMGrad,
    "nashmtl": NashMTL,
    "famo": FAMO,
}


def available() -> dict[str, type[MultiObjectiveOptimizer]]:
    """``{registry name: optimizer class}`` for every method drmoo implements."""
    return dict(_REGISTRY)


def create(name: str, params: ParamsT, num_tasks: int, **overrides: Any) -> MultiObjectiveOptimizer:
    """Build the optimizer registered as ``name`` (see :func:`available`).

    Args:
        name: a registry name, e.g. ``"double-clip"``.
        params: the shared parameters (or parameter groups), as for the class itself.
        num_tasks: the number of tasks m.
        overrides: keyword arguments of that class's constructor: hyperparameters, e.g. ``lr=1e-3``, and
            ``capturable``, ``backend``, ``jacobian``, ``jacobian_strategy``
            (``"auto"`` | ``"loop"`` | ``"batched"``, see :mod:`drmoo.jacobian`).
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid choices: {', '.join(_REGISTRY)}") from None
    accepted = _keyword_arguments(cls)
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        owners = {key: [other for other, c in _REGISTRY.items() if key in _keyword_arguments(c)] for key in unknown}
        whose = "; ".join(f"{key!r} is a hyperparameter of {', '.join(owners[key])}" for key in unknown if owners[key])
        raise TypeError(
            f"{name} has no hyperparameter {', '.join(map(repr, unknown))}; valid: {', '.join(accepted)}"
            + (f" ({whose})" if whose else "")
        )
    return cls(params, num_tasks, **overrides)


def _keyword_arguments(cls: type[MultiObjectiveOptimizer]) -> list[str]:
    """The keyword arguments of ``cls``'s constructor after the parameters and m: its hyperparameters and
    ``capturable``, ``backend``, ``jacobian``, ``jacobian_strategy`` (sorted)."""
    parameters = inspect.signature(cls.__init__).parameters
    return sorted(set(parameters) - {"self", "params", "num_tasks"})
