"""``drmoo.Balancer``: any drmoo method's DR-balanced direction written into ``.grad``, for any torch optimizer.

.. code-block:: python

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)     # any torch optimizer, any groups
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), num_tasks=2, lam=0.8, optimizer=optimizer)
    for x, ys in loader:
        optimizer.zero_grad()
        losses = per_sample_losses(model(x), ys)                   # [B, m], one column per task
        balancer.backward(losses)       # trunk .grad = the method's direction; heads: their task's DR gradient
        optimizer.step()

One implementation.  The balancer holds an instance of the method's optimizer class (registered in
:func:`drmoo.optim.available`) in *direction mode*: ``backward`` runs that class's own ``step``,
which computes the per-task dual objectives, the Jacobian, the weights, and updates eta, w and the
method's state (MoCo's tracked Jacobian, FAMO's logits, SDMGrad's momentum, ...) exactly as
``step(closure)`` does -- only the theta write ``theta -= lr * d`` becomes ``.grad += d``.
Hence, with ``torch.optim.SGD(lr=lr)`` (no
momentum, no weight decay) and the balancer's ``lr`` equal to SGD's, the trajectory is the one of
the method's ``step`` with that lr, to rounding (tested for every method).

What ``lr`` means here.  theta's step size is the torch optimizer's.  The balancer's ``lr``
hyperparameter is the step size of the dual variables eta (the baselines' joint (theta, eta) step
and Double-Clip's eta step gamma * mu * (z (.) w) both use it); Double-Loop's eta has its own
``dual_lr`` and its ``lr`` is unused.  ``optimizer=opt`` gives the paper's coupling: every
``backward`` first sets it to the current lr of ``opt``'s parameter group that holds the shared
parameters, so a scheduler on ``opt`` schedules eta too.  Double-Loop's ``dual_lr`` follows it too,
in ratio: eta's step is ``dual_lr * lr_now / lr_start``, lr_start being the group's ``initial_lr``
(what a torch LR scheduler started from) or, without a scheduler, its lr when the balancer was
built -- so a scheduler that takes theta's lr to 0 stops eta as well.  ``lr=`` fixes it instead (schedule it,
if wanted, with a torch LR scheduler on :attr:`Balancer.algorithm`); with neither, the method's
default is used and the constructor warns.

Shared means shared.  A parameter passed as shared that only some tasks' losses reach (a head,
e.g. from ``model.parameters()``) would get w_i times its gradient; the first backward finds such
parameters in the Jacobian it computes anyway and refuses them, naming their shapes and tasks.
``allow_partial_shared=True`` accepts them (a deliberately partial sharing).  FAMO computes no
per-task Jacobian (one combined backward per step), so its first backward takes one more backward
per task to find them (once: not on later steps).

What ``.grad`` receives.  The shared parameters: the method's direction d (Double-Clip: the clipped
alpha * J^T w_t; Nash-MTL: clip * J^T alpha; the baselines: J^T w), *added* to any existing ``.grad``
as autograd accumulates.  Every other trainable leaf of the losses' graph (the heads): the gradient
of sum_i L^i, head i seeing only task i -- the same as ``step`` gives them.  (With ``jacobian="features"``
the direction is lifted through z to the shared parameters only: a trainable parameter below z that is not
shared gets nothing, and the first backward warns of it.)  A step that raises
leaves every ``.grad``, eta, w and the state as they were.

One batch or a closure.  ``backward(losses)`` (or ``backward((losses, sample_weight))``) is the
method's *single-batch form*: every batch the algorithm draws is this one -- Double-Clip as with
``resample=False``; MoDo's and SDMGrad's three batches and Double-Loop's ``inner_steps + 3`` batches
coincide (the Jacobians are computed on the one graph, which is kept until the last of them; MoDo's
and SDMGrad's draws share one eta, so their Jacobians are one matrix, computed once and reused: m
backward passes here, not 3m);
FAMO's logit update is its next-batch form (see :class:`drmoo.optim.FAMO`).  ``backward(closure)``
runs the method's multi-batch form instead: the closure is called as ``step`` calls it (fresh
batch per call).

Mixed precision.  Pass the losses *unscaled* (the dual objectives need their true values) and the
``torch.amp.GradScaler`` as ``backward(losses, scaler=scaler)``; then ``scaler.step(optimizer);
scaler.update()`` as usual.  The backward passes run on scaled cotangents (no fp16 underflow), the
method's quantities are computed from the unscaled gradients, and ``.grad`` (shared and heads) is
left scaled for ``scaler.step`` to unscale.  A non-finite step (an fp16 overflow) is then not an
error: nothing of the balancer changes, the ``.grad`` of every parameter it writes (shared and
heads) receive an Inf so that the scaler skips every optimizer's step (the heads may be in a second
optimizer) and lowers its scale, and ``stats["found_inf"]`` is 1.  An overflow in the heads'
gradients alone counts the same: the balancer and the scaler skip the same steps.

Data parallelism (torch.distributed, one process per device).  Every rank passes the losses of its
shard of the global batch (:func:`drmoo.distributed.shard`); ``backward`` -- the method's step in
direction mode -- all-reduces the dual statistics and the Jacobian (:mod:`drmoo.distributed`) and
sums the heads' gradients of the step over ranks, so that every ``.grad`` it writes is the global
batch's, the same on every rank, and the torch optimizer keeps the replicas identical.  The
balancer does its own communication: use the model as it is, or wrap it in
``DistributedDataParallel`` and run its forward and ``backward`` inside ``ddp_model.no_sync()``:
DDP's reducer must stay idle (where a backward pass accumulates into ``.grad``, e.g. FAMO's heads
pass, it would start a reduction of its own that never completes, and DDP raises at the next
forward).  Every rank must pass a shard of the same size (with the same m and shared parameters):
the first backward checks m and the shared shapes across ranks, and every backward the shard
sizes, raising a ValueError on every rank instead of a collective that aborts, hangs or silently
averages unequal shards.

Gradient accumulation.  ``backward(losses, accumulate=True)`` on every micro-batch but the last, then
``backward(losses)`` on the last, takes the method's step on the whole batch: the same ``.grad``
(shared parameters and heads), eta, w and state as one ``backward`` on the concatenated losses, one
dual step (``steps_taken`` + 1), micro-batches of any sizes.  Each micro-batch's part -- its dual means,
its m per-task gradients, its heads' gradients, all taken at the step's starting eta -- is reduced at
once and its graph freed; nothing is written into ``.grad`` before the last.  Cost: m backward passes
per micro-batch and one [m, n] buffer.  MGDA, MoDo, SDMGrad, MoCo,
Nash-MTL and FAMO accumulate; with ``jacobian="features"`` (MoCo aside) a micro-batch also keeps the m x m
Gram of its rows w.r.t. z, and its m per-task gradients are its rows lifted through the trunk (m trunk
backward passes instead of features mode's one), so that the step has the full batch's Gram and lift.
Double-Clip and Double-Loop (whose gradients are taken at an eta that depends on the whole batch's
losses) are refused with the reason.  A step that raises drops the micro-batches accumulated
for it.  A closure (``backward(closure)``, the multi-batch form) may return each batch it draws in
micro-batches instead, as for the optimizers' ``step(closure)`` (:data:`drmoo.optim.Closure`).
Without ``accumulate``, a second ``backward`` before the optimizer stepped, or a gradient
already put into the shared parameters' ``.grad`` by another backward (``loss.backward()``), is added
to silently by autograd's convention: the balancer warns (``drmoo.GradientAccumulationWarning``),
telling the cases apart from the tensors' version counters and a post-accumulate-grad hook on each
shared parameter, with no device read.

FSDP2.  The shared parameters may be a trunk wrapped by ``torch.distributed.fsdp.fully_shard`` (the heads
replicated, or sharded too: each head wrapped, or the root), in both modes and with every method but MoCo in
parameters mode.  Every pass through the trunk is an ordinary backward, which FSDP reduce-scatters into each
rank's shard of ``.grad``; nothing n-sized is gathered.  Sharded heads get their gradient (summed over the
global batch) from one more ordinary backward, through the heads only.  Features mode crosses the trunk once,
with the method's combined cotangent.
Parameters mode takes one backward per task: each rank keeps its shard's columns of J, every m x m product
(the Gram, the cross products) is the sum of the shards' local ones (one all-reduce), and each shard's
``.grad`` is its part of the direction.  Refused with one line naming the alternative: MoCo in parameters
mode (its tracked Jacobian would be per-rank state), gradient accumulation, a GradScaler, and FSDP1.

torch.compile.  A compiled model (``torch.compile(model)``) works as it is: the balancer walks the
autograd graph that the compiled forward builds and runs its backward passes through it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast, get_args, overload

import torch
from torch import Tensor

from ._grad_watch import GradientAccumulationWarning, GradWatch
from ._rate_coupling import RateCoupling
from .jacobian import graph_leaves
from .optim import NonFiniteStepError, available, create
from .optim._accumulate import Accumulation, accumulate_refusal, reduce_micro_batch, shared_versions
from .optim._base import MultiObjectiveOptimizer
from .optim._features import with_features
from .optim._fsdp import is_sharded
from .optim._hyperparameters import check_flag
from .optim._loss_scale import LossScale

LossesInput = Tensor | tuple[Tensor, Tensor] | Callable[[], Any]
"""What :meth:`Balancer.backward` takes: per-sample losses ``[B, m]`` (one column per task, with their
graph), a pair ``(losses, sample_weight)`` (importance weights ``[B, m]``), or a closure that draws a
fresh batch and returns either (with ``jacobian="features"``: ``(losses, z)`` or
``(losses, z, sample_weight)``)."""
SharedParams = Iterable[Tensor] | Iterable[dict[str, Any]]
"""The shared parameters, as torch optimizers take them: an iterable of tensors
(``model.trunk.parameters()``) or of parameter groups (dicts with ``"params"``)."""
# The registry names of drmoo.optim.available() (tests/typing checks that they agree).
MethodName = Literal["double-clip", "double-loop", "mgda", "modo", "moco", "sdmgrad", "nashmtl", "famo"]
"""The methods' registry names (:func:`drmoo.optim.available`), the ``method`` of :class:`Balancer`.  A
name held in a ``str`` (a config file's) becomes one through :func:`method_name`."""
JacobianMode = Literal["parameters", "features"]
"""The ``jacobian`` of :class:`Balancer`: the per-task gradients w.r.t. the shared parameters (the paper's)
or w.r.t. the representation z every head reads (see the ``jacobian`` argument)."""
JacobianStrategy = Literal["auto", "loop", "batched"]
"""The ``jacobian_strategy`` of :class:`Balancer` (:data:`drmoo.jacobian.STRATEGIES`): how the per-task gradients
are computed."""
SolverName = Literal["one_step", "min_norm"]
"""MGDA's ``solver``: one projected step of w per iteration (the paper's baseline) or the exact min-norm weights."""

# Methods whose single-batch form runs several backward passes over the one graph of the losses
# (one per batch of the multi-batch algorithm): the graph is kept for all but the last.
_GRAPH_PASSES = {"modo": 3, "sdmgrad": 3, "double-loop": 3}
# Methods whose lr is not eta's step size (Double-Loop's eta takes dual_lr): no warning about it.
_LR_UNUSED = {"double-loop"}


def method_name(name: str) -> MethodName:
    """``name`` checked and typed as a :data:`MethodName`: for a method's name held in a ``str``.

    ``drmoo.Balancer(name, ...)`` with ``name: str`` (read from a config file or a command line) fails
    type checking, since every overload of :class:`Balancer` takes one literal name;
    ``drmoo.Balancer(drmoo.method_name(name), ...)`` passes, with the hyperparameters every method
    shares (``lam``, ``divergence``, ``lr``, ...), and a wrong name fails here, at once.

    Args:
        name: a registry name of :func:`drmoo.optim.available`, e.g. ``"double-clip"``.

    Returns:
        ``name`` itself, typed as :data:`MethodName`.

    Raises:
        ValueError: ``name`` is no method's name (the message lists them).
    """
    names = get_args(MethodName)
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"unknown method {name!r}; valid choices: {', '.join(names)}")
    return cast(MethodName, name)


def _reaches(losses: Tensor, params: Iterable[Tensor]) -> bool:
    """Whether the autograd graph of ``losses`` leads to any of ``params`` (one walk, stops at the first)."""
    wanted = {id(p) for p in params}
    if losses.grad_fn is None:
        return id(losses) in wanted
    return any(id(leaf) in wanted for leaf in graph_leaves(losses))


def _refuse_scaled_losses(losses: Any, scaler: torch.amp.GradScaler | None) -> None:
    """Refuse ``scaler.scale(losses)``: the losses' values set the DR weights, so they must be the unscaled
    ones (the scale is applied to the backward passes instead).  Known from the graph, no value read: the
    losses' last op multiplies by the very scale tensor of the ``scaler`` given."""
    tensor = losses[0] if isinstance(losses, tuple) and losses else losses
    scale = getattr(scaler, "_scale", None)
    node = getattr(tensor, "grad_fn", None)
    if scale is None or node is None or node.name() != "MulBackward0":
        return
    if getattr(node, "_saved_other", None) is scale or getattr(node, "_saved_self", None) is scale:
        raise ValueError(
            "Balancer.backward takes the unscaled losses and the scaler itself: pass "
            "backward(losses, scaler=scaler), not scaler.scale(losses) (the losses' values set the DR weights; "
            "the balancer applies the scale to its backward passes)"
        )


def _scaler_scale(scaler: torch.amp.GradScaler | None, device: torch.device) -> LossScale:
    """The GradScaler's current scale: the float 1.0 without one (or disabled), else a 0-d tensor on
    ``device``, never read on the host (the step's one host read stays its guards')."""
    if scaler is None:
        return 1.0
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not scaler.is_enabled():
        return 1.0
    # scaler.scale() (public) also creates the scaler's state on our device, which
    # scaler.step() requires ("did not use scaler.scale(loss)" otherwise); 1 * scale, on the device.
    one = torch.ones((), dtype=torch.float32, device=device)
    return scaler.scale(one)


class Balancer:
    """A drmoo method that writes its DR-balanced direction into ``.grad`` (see the module docstring).

    Args:
        method: a registry name of :func:`drmoo.optim.available` (``"double-clip"``, ``"mgda"``, ...).
        shared_params: the shared parameters (an iterable of tensors, or parameter groups): those
            every task's losses depend on (the trunk), not the heads.
        num_tasks: m, the number of columns of the per-sample losses.
        optimizer: the torch optimizer that steps the shared parameters; eta's step size then
            follows the current lr of its group that holds them (its scheduler included;
            Double-Loop's ``dual_lr`` in ratio, see the module docstring).  Not together with ``lr``.
        allow_partial_shared: accept shared parameters that only some tasks reach (refused by
            default: a head passed as shared would get w_i times its gradient).
        jacobian: ``"parameters"`` (the default, the paper's: the per-task gradients w.r.t. the
            shared parameters, m backward passes through the trunk) or ``"features"`` (w.r.t. the
            representation z that every head reads, passed as ``backward(losses, features=z)``: m
            passes through the heads and one through the trunk, for many tasks).  What changes:
            the Gram, the weights and every norm are taken in z's coordinates.  MGDA, MoDo,
            SDMGrad, Double-Loop and FAMO still move theta by the exact gradient of sum_i c_i L^i
            and their rates carry over; Double-Clip, Nash-MTL (and MGDA with ``clip_c1``) read a
            norm taken in z in theta's step length, so their ``lr`` must be chosen for features
            mode -- they warn once (:class:`drmoo.optim.FeaturesRateWarning`) unless built with
            ``features_rate_chosen=True``.  MoCo refuses it.
        jacobian_strategy: how the per-task gradients are computed (:mod:`drmoo.jacobian`):
            ``"auto"`` (the fewest kernel launches on a GPU, the least memory traffic on the CPU, and
            in features mode the rows of separate heads from one pass), ``"loop"`` (one backward
            per task) or ``"batched"`` (one vmapped backward); the algorithm's
            ``jacobian_strategy`` attribute, which may also be set later.
        check_trunk_gradients: features mode only: test the trunk's gradients for NaN/Inf before
            they are written to ``.grad`` (the default: a non-finite step then changes nothing and raises
            :class:`drmoo.optim.NonFiniteStepError`).  The test reads every trunk gradient once, 3-5 %
            of a small-m ResNet18 step on a CPU; ``False`` writes them unread, as a plain
            ``backward`` does (a NaN made inside the trunk then reaches ``.grad``), while the losses,
            the gradients w.r.t. z and the dual quantities are still checked.  Under a GradScaler
            the test runs either way (an overflow is the scaler's signal to skip the step).  The
            algorithm's ``check_trunk_gradients`` attribute, which may also be set later.
        **hparams: the method's hyperparameters, as its optimizer class takes them (``lam``,
            ``divergence``, ``lr`` -- eta's step size here --, ``capturable``, ``backend``, ...);
            typed per method for type checkers.
    """

    # One signature per method (typing.overload): a type checker rejects an unknown method, a
    # hyperparameter the method does not have and a value of the wrong type (lam="0.8").  The
    # defaults are the method's class's (``...`` here); tests/typing checks these lists against the
    # classes' constructors.
    @overload
    def __init__(self, method: Literal["double-clip"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., pref_lr: float = ..., rho: float = ..., c1: float = ..., c2: float = ...,
                 f1: float = ..., f2: float = ..., lam: float = ..., divergence: str = ..., dual_scale: float = ...,
                 resample: bool = ...,
                 features_rate_chosen: bool = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["double-loop"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., dual_lr: float = ..., pref_lr: float = ..., rho: float = ...,
                 inner_steps: int = ..., lam: float = ..., divergence: str = ..., seed: int | None = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["mgda"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., pref_lr: float = ..., rho: float = ..., lam: float = ..., divergence: str = ...,
                 solver: SolverName = ..., max_iter: int = ..., tol: float = ...,
                 clip_c1: float | None = ..., clip_c2: float | None = ...,
                 features_rate_chosen: bool = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["modo"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., pref_lr: float = ..., rho: float = ..., lam: float = ..., divergence: str = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["moco"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., pref_lr: float = ..., rho: float = ..., ema: float = ..., lam: float = ...,
                 divergence: str = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["sdmgrad"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., pref_lr: float = ..., rho: float = ..., sdm_lambda: float = ...,
                 inner_steps: int = ..., momentum: float = ..., normalize: bool = ..., lam: float = ...,
                 divergence: str = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["nashmtl"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., max_norm: float = ..., update_every: int = ..., solver_iters: int = ...,
                 lam: float = ..., divergence: str = ...,
                 features_rate_chosen: bool = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    @overload
    def __init__(self, method: Literal["famo"], shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: JacobianMode = "parameters", jacobian_strategy: JacobianStrategy = "auto",
                 check_trunk_gradients: bool = True,
                 lr: float = ..., pref_lr: float = ..., logit_decay: float = ...,
                 loss_floor: float | Sequence[float] = ..., famo_eps: float = ..., lam: float = ...,
                 divergence: str = ...,
                 capturable: bool = False, backend: str | None = None) -> None: ...
    def __init__(self, method: str, shared_params: SharedParams, num_tasks: int, *,
                 optimizer: torch.optim.Optimizer | None = None, allow_partial_shared: bool = False,
                 jacobian: str = "parameters", jacobian_strategy: str = "auto", check_trunk_gradients: bool = True,
                 **hparams: Any) -> None:
        if method not in available():
            raise ValueError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
        if jacobian != "parameters":
            # JACOBIAN MODE HOOK: "features" (the Jacobian with respect to the trunk's output) is handed to
            # the method's class as its ``jacobian`` hyperparameter; a class without it refuses it by name.
            hparams["jacobian"] = jacobian
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if optimizer is not None and "lr" in hparams:
            raise ValueError(
                "give either optimizer= (eta's step size follows the optimizer's learning rate, scheduler "
                "included) or lr= (a fixed step size for eta), not both"
            )
        self.method = method
        # (a bad jacobian_strategy: a ValueError naming the choices, from the constructor)
        self._algorithm = create(method, shared_params, num_tasks, jacobian_strategy=jacobian_strategy, **hparams)
        self._algorithm.direction_mode = True
        self._algorithm.allow_partial_shared = check_flag("allow_partial_shared", allow_partial_shared)
        self._algorithm.check_trunk_gradients = check_flag("check_trunk_gradients", check_trunk_gradients)
        self._optimizer = optimizer
        # The micro-batches of the step being accumulated (backward(..., accumulate=True)), None between steps;
        # and what tells a gradient added to the direction without anyone meaning it (drmoo._grad_watch).
        self._accumulation: Accumulation | None = None
        self._grad_watch = GradWatch(self._algorithm._shared_params())
        self._rates = None if optimizer is None else RateCoupling(method, self._algorithm, optimizer)
        if optimizer is None and "lr" not in hparams and method not in _LR_UNUSED:
            warnings.warn(
                f"drmoo.Balancer({method!r}): eta's step size is the method's default "
                f"lr={self._algorithm.hyper('lr')!r}, not your optimizer's learning rate; pass optimizer=<the torch "
                "optimizer that steps the shared parameters> (eta then follows its learning rate and scheduler) "
                "or lr=<a fixed step size>", UserWarning, stacklevel=2,
            )

    # ------------------------------------------------------------------------------ accessors
    @property
    def algorithm(self) -> MultiObjectiveOptimizer:
        """The method's optimizer object (direction mode): its ``param_groups`` hold the
        hyperparameters; a torch LR scheduler on it schedules eta's step size ``lr``."""
        return self._algorithm

    @property
    def num_tasks(self) -> int:
        return self._algorithm.num_tasks

    @property
    def w(self) -> Tensor:
        """The method's preference vector (on the simplex)."""
        return self._algorithm.w

    @property
    def eta(self) -> Tensor:
        """The dual variables, one per task."""
        return self._algorithm.eta

    @property
    def stats(self) -> dict[str, Tensor]:
        """The last backward's statistics (as the method's ``step`` reports them)."""
        return self._algorithm.stats

    @property
    def steps_taken(self) -> int:
        return self._algorithm.steps_taken

    def state_dict(self) -> dict[str, Any]:
        """eta, w, the step count, the method's own state and hyperparameters (the method's optimizer
        ``state_dict``: a balancer and a ``step`` optimizer of the same method can load each other's)."""
        return self._algorithm.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this method for the same problem (validated before anything changes).

        Args:
            state_dict: a ``state_dict()`` of a Balancer of the same method for the same problem.

        Raises ValueError while micro-batches are accumulated (``accumulate=True``): they were taken at
        the current eta and w, which loading would replace.
        """
        if self._accumulation is not None:
            raise ValueError(
                f"{self._accumulation.micro_batches} micro-batch(es) are accumulated for a step taken at the current "
                "eta and w: close the step (backward without accumulate=True) before load_state_dict"
            )
        self._algorithm.load_state_dict(state_dict)
        if self._rates is not None:
            self._rates.loaded()

    def __repr__(self) -> str:
        return f"Balancer({self.method!r}, num_tasks={self.num_tasks}, steps_taken={self.steps_taken})"

    # ------------------------------------------------------------------------------- backward
    def backward(self, losses: LossesInput, *, scaler: torch.amp.GradScaler | None = None,
                 features: Tensor | tuple[Tensor, ...] | None = None, accumulate: bool = False) -> Tensor:
        """Write the method's direction into the shared parameters' ``.grad`` (and the heads' DR
        gradients into theirs), updating eta, w and the method's state.

        Args:
            losses: per-sample losses ``[B, m]`` with their graph, or ``(losses, sample_weight)``
                (importance weights >= 0, ``[B, m]``) -- the single-batch form; or a closure that
                draws a fresh batch per call and returns either -- the method's multi-batch form.
            scaler: a ``torch.amp.GradScaler`` whose scale multiplies the backward passes and
                ``.grad`` (see the module docstring, "Mixed precision"); the losses stay unscaled.
            features: with ``jacobian="features"`` (required then, with losses): z, the trunk's output
                that every head reads (a tensor or a tuple of tensors); the closure form returns
                ``(losses, z)`` or ``(losses, z, sample_weight)`` instead.
            accumulate: this is a micro-batch of a larger batch and more follow: its part of the step is
                reduced and kept (nothing is written into ``.grad``, eta and w do not move); the next
                ``backward`` without ``accumulate`` takes its last micro-batch and the method's step on the
                whole batch -- the same ``.grad``, eta, w and state as one ``backward`` on the concatenated
                losses, with one dual step (see "Gradient accumulation" in the module docstring).

        Returns the per-task dual objectives of the step (detached), as the method's ``step`` does (a
        micro-batch's own, with ``accumulate``).
        Raises ValueError/TypeError naming the problem for bad losses, and
        :class:`drmoo.optim.NonFiniteStepError` for NaN/Inf (without a scaler); nothing changes then.
        """
        algorithm = self._algorithm
        finding = self._grad_watch.finding()
        if finding is not None:
            warnings.warn(finding, GradientAccumulationWarning, stacklevel=2)
        scale = _scaler_scale(scaler, self._algorithm.device)
        _refuse_scaled_losses(losses, scaler)
        if check_flag("accumulate", accumulate):
            return self._reduce_micro_batch(losses, features, scale, scaler)
        drawn: list[Any] = []  # what every draw of this step returned (the overflow marker finds the heads in it)
        pending = self._accumulation
        if pending is not None:
            self._close_accumulation(pending, losses)
            self._accumulation = None  # the step closing an accumulation drops it, whether it succeeds or raises
            if pending.found_inf:  # a micro-batch overflowed under the scaler: the whole step is skipped
                assert scaler is not None
                self._hand_overflow_to(scaler, [losses])
                return torch.full((self.num_tasks,), float("nan"))
            algorithm.accumulation = pending
        if isinstance(losses, (Tensor, tuple)):
            self._check_losses(losses)
            given = with_features(losses, features, algorithm.features_engine is not None)
            drawn.append(given)
            closure: Callable[[], Any] = lambda: given  # noqa: E731
            graph_reuses = _GRAPH_PASSES.get(self.method, 1) - 1
            algorithm.losses_origin = "Balancer.backward was given"
        elif callable(losses):
            with_features(None, features, algorithm.features_engine is not None)  # the closure returns z
            user_closure = losses

            def closure() -> Any:
                result = user_closure()
                drawn.append(result)
                return result

            graph_reuses = 0
        else:
            raise TypeError(
                f"Balancer.backward takes per-sample losses [B, {self.num_tasks}] (a Tensor), a pair "
                f"(losses, sample_weight) or a closure; got {type(losses).__name__}"
            )
        if self._rates is not None:
            self._rates.follow()
        algorithm.loss_scale = algorithm.grad_scale = scale
        algorithm.graph_reuses = graph_reuses
        try:
            # A step that raises has already restored every .grad (the optimizer's all-or-nothing step).
            objectives = algorithm.step(closure)
        except NonFiniteStepError:
            if scaler is None or not scaler.is_enabled():
                raise
            self._hand_overflow_to(scaler, drawn)
            return torch.full((self.num_tasks,), float("nan"))
        finally:
            algorithm.loss_scale = algorithm.grad_scale = 1.0
            algorithm.graph_reuses = 0
            algorithm.jacobian_memo = None
            algorithm.accumulation = None
            algorithm.losses_origin = "the closure returned"
        self._grad_watch.note_own()
        return objectives

    # ---------------------------------------------------------------------- gradient accumulation
    def _reduce_micro_batch(self, losses: LossesInput, features: Tensor | tuple[Tensor, ...] | None, scale: LossScale,
                            scaler: torch.amp.GradScaler | None) -> Tensor:
        """``backward(losses, accumulate=True)``: reduce this micro-batch into the pending accumulation
        (``drmoo.optim._accumulate.reduce_micro_batch``); nothing else changes."""
        algorithm = self._algorithm
        if not isinstance(losses, (Tensor, tuple)):
            raise TypeError(
                "backward(..., accumulate=True) takes a micro-batch's per-sample losses [B, m] (or (losses, "
                f"sample_weight)), not {type(losses).__name__}: a closure draws the method's own batches"
            )
        refusal = accumulate_refusal(algorithm)
        if refusal is not None:
            raise ValueError(refusal)
        self._check_losses(losses)
        given = with_features(losses, features, algorithm.features_engine is not None)
        versions = shared_versions(algorithm._shared_params())
        pending = self._accumulation if self._accumulation is not None else Accumulation(versions)
        self._check_unstepped(pending)
        algorithm.losses_origin = "Balancer.backward was given"
        algorithm.loss_scale = algorithm.grad_scale = scale
        try:
            objectives = reduce_micro_batch(algorithm, given, pending)
        except NonFiniteStepError:
            if scaler is None or not scaler.is_enabled():
                raise
            pending.found_inf = True  # the step that closes the accumulation is skipped, as the scaler skips it
            objectives = torch.full((self.num_tasks,), float("nan"))
        finally:
            algorithm.loss_scale = algorithm.grad_scale = 1.0
            algorithm.losses_origin = "the closure returned"
        self._accumulation = pending
        return objectives

    def _close_accumulation(self, pending: Accumulation, losses: LossesInput) -> None:
        """Before the step that takes the last micro-batch: the same problem, no optimizer step in between."""
        if not isinstance(losses, (Tensor, tuple)):
            raise TypeError(
                f"{pending.micro_batches} micro-batch(es) were accumulated (accumulate=True): the backward that "
                f"closes the step takes the last micro-batch's losses, not {type(losses).__name__}"
            )
        self._check_losses(losses)
        self._check_unstepped(pending)
        pending.close_with((losses[0] if isinstance(losses, tuple) else losses).shape[0])

    def _check_unstepped(self, pending: Accumulation) -> None:
        """Refuse a micro-batch after the shared parameters changed since the accumulation's first one."""
        if shared_versions(self._algorithm._shared_params()) != pending.versions:
            raise ValueError(
                f"the shared parameters changed since the first of the {pending.micro_batches} micro-batch(es) "
                "accumulated for this step (an optimizer step in between?): call backward(losses) without "
                "accumulate=True on the last micro-batch, then optimizer.step()"
            )

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer whose learning rate eta's step size follows (``optimizer=``), or None."""
        return self._optimizer

    def _check_losses(self, losses: Tensor | tuple[Tensor, Tensor]) -> None:
        """Refuse what the method would misread, before anything runs: the shape, a graph that does
        not reach the shared parameters.  (Values -- NaN/Inf, bad weights -- are checked by the step.)"""
        m = self.num_tasks
        if isinstance(losses, tuple):
            if len(losses) != 2:
                raise ValueError(
                    f"a tuple given to Balancer.backward must be (losses, sample_weight), got {len(losses)} items"
                )
            losses = losses[0]
        if not isinstance(losses, Tensor):
            raise TypeError(f"losses must be a Tensor of per-sample losses [B, {m}], got {type(losses).__name__}")
        if losses.dim() != 2 or losses.shape[1] != m:
            raise ValueError(
                f"losses must be per-sample losses of shape [B, {m}] (one column per task, not averaged over "
                f"the batch); got shape {tuple(losses.shape)}"
            )
        if not losses.is_floating_point():  # an integer tensor holds no graph, a complex one is no objective
            raise ValueError(f"losses must be floating point (per-sample losses with their graph), got {losses.dtype}")
        device = self._algorithm.device
        if losses.device != device:
            raise ValueError(
                f"losses are on {losses.device}, but the balancer's shared parameters are on {device}: compute "
                "the losses with the model on the parameters' device"
                + (" (meta tensors hold no data: materialize the model first)" if losses.device.type == "meta" else "")
            )
        if not losses.requires_grad:
            raise ValueError(
                "losses have no autograd graph (computed under torch.no_grad(), detached, or from parameters "
                "that do not require grad); the balancer needs their gradients"
            )
        shared = self._algorithm._shared_params()
        # FSDP2's forward computes with all-gathered copies of sharded parameters (drmoo.optim._fsdp): the losses
        # never reach the shards themselves; features mode's one backward through the trunk checks that it reached.
        if not is_sharded(shared) and not _reaches(losses, shared):
            raise ValueError(
                "the losses do not depend on the balancer's shared parameters: pass the parameters the "
                "losses are computed from (e.g. model.trunk.parameters()) to drmoo.Balancer"
                + (" (or, if the model was wrapped by FSDP or fully_shard after the balancer was built: FSDP "
                   "replaced those parameters; build the balancer after fully_shard, from the sharded parameters)"
                   if torch.distributed.is_available() and torch.distributed.is_initialized() else "")
            )

    def _hand_overflow_to(self, scaler: torch.amp.GradScaler, drawn: list[Any]) -> None:
        """A non-finite step under a GradScaler: the balancer changed nothing; an Inf in the ``.grad``
        of every parameter the step would have written makes ``scaler.step`` skip each optimizer and
        ``scaler.update`` back off.

        Every one, not just one shared parameter: with the heads in a second torch optimizer (torch's
        multi-optimizer AMP loop) that optimizer's ``scaler.step`` must find an Inf too -- with no
        gradient at all it fails ("No inf checks were recorded for this optimizer").  The heads are
        the trainable leaves of the graphs of the losses this step drew.
        """
        algorithm = self._algorithm
        shared = algorithm._shared_params()
        targets = {id(param): param for param in shared}
        for result in drawn:
            losses = result[0] if isinstance(result, tuple) and result else result
            if isinstance(losses, Tensor) and losses.requires_grad:
                for leaf in graph_leaves(losses):
                    targets.setdefault(id(leaf), leaf)
        with torch.no_grad():
            for param in targets.values():
                if not param.requires_grad or param.numel() == 0:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.view(-1)[:1].fill_(float("inf"))
        algorithm.stats = {"found_inf": torch.ones((), dtype=torch.float32)}
