"""What every drmoo optimizer shares: the closure protocol, input checks, per-task Jacobians, state.

The closure protocol.  ``optimizer.step(closure)`` calls ``closure()`` as often as its algorithm
needs; every call must draw a *fresh* batch and return the per-sample losses ``[B, m]`` (one column
per task) with their autograd graph - or a pair ``(losses, sample_weight)`` with importance weights
omega ``[B, m]`` >= 0 (e.g. CelebA's label balancing), which then enter every expectation of the
dual objective.  The optimizer, not the user, turns those losses into the DR dual objective, its
weights and its per-task gradients.  A batch too large for memory may come in micro-batches: the closure
returns an iterable of them (each its losses, or a callable computing them), and the step is the one
the whole batch gives (exact gradient accumulation, :mod:`drmoo.optim._micro_batches`).

Shared vs task-specific parameters.  The parameters handed to the optimizer are the *shared* ones
and go through the multi-objective update.  Every other trainable leaf that takes part in the losses
(e.g. one head per task; in features mode, one above z: a parameter below z that is not shared gets no
gradient, warned at the first step) receives, in its ``.grad``, the gradient of the sum of the task dual
objectives from the batch used for the parameter step - head i therefore sees task i only - and is
stepped by the user's own optimizer (paper: SGD, lr 1e-2) after ``step`` returns.  Zero those grads
before ``step`` as usual (a step adds to an existing ``.grad``, as ``backward`` does).  Under
torch.distributed they are the rank's shard's: sum them over ranks after ``step``
(:func:`drmoo.distributed.all_reduce_grads`); in direction mode the step sums them itself.

All or nothing.  A step that raises (non-finite losses or gradients, a bad closure) changes nothing:
not theta, eta, w or the method's state, and not the heads' ``.grad`` (the step's head gradients
are kept apart and added only once it succeeds).  Hyperparameters are checked when given -- in the
constructor, in ``add_param_group`` and in ``load_state_dict``, which also refuses a state saved by
another method or for another problem -- and again at every step (an LR scheduler or a
``param_groups`` write may have changed them).  A parameter given twice, a group of another dtype or
device, losses on another device and losses that reach none of the shared parameters are refused.

State.  The preference vector ``w`` (on the simplex) and the dual variables ``eta`` live in
``optimizer.state["drmoo"]`` so that ``state_dict()`` / ``load_state_dict()`` round-trip them.
An optimizer can also be copied whole: ``copy.deepcopy``, ``pickle`` and ``torch.save`` keep its
hyperparameters, state and configuration (not the per-step scratch: buffers are rebuilt on the next
step); copy it together with the model (``copy.deepcopy((model, optimizer))``) so that the copy's
parameters are the copied model's.

Two ways to apply a step.  :meth:`MultiObjectiveOptimizer.step` is the paper's algorithm: it writes
theta itself (``theta -= lr * d``).  Driven by :class:`drmoo.Balancer` (``direction_mode``), the same
code computes the same direction d -- and updates eta, w and the method's state with the group's
``lr`` -- but adds d to the shared parameters' ``.grad`` instead of writing theta, so that any torch
optimizer takes the theta step (with ``torch.optim.SGD(lr)`` exactly the one ``step`` takes).  Every
method writes theta through :meth:`MultiObjectiveOptimizer.apply_direction`, the one place where
the two modes differ (Double-Clip's fused ``gram_step`` has its own branch); and under
torch.distributed, direction mode also sums the step's head gradients over ranks when it commits

Where the parts live.  This class holds the step's protocol (the closure, the state, the checks that
stop a step, the all-or-nothing bookkeeping); how task gradients are taken is a Jacobian engine's
(:mod:`drmoo.optim._engine`: :mod:`~drmoo.optim._parameters` or :mod:`~drmoo.optim._features`), how
they are combined is the method's (one module each).  Hyperparameter checks
(:mod:`~drmoo.optim._hyperparameters`), ``state_dict`` validation (:mod:`~drmoo.optim._state_dict`),
the closure's output checks (:mod:`~drmoo.optim._losses`), the heads' gradients of a step
(:mod:`~drmoo.optim._head_grads`), cross-rank agreement (:mod:`~drmoo.optim._agreement`) and the
heads-as-shared check (:mod:`~drmoo.optim._shared_reach`) have their own modules.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from drmoo import distributed
from drmoo.jacobian import check_strategy, feed_head_grads
from drmoo_kernels import Divergence, backend_module, get_divergence, resolve_backend
from drmoo_kernels._checks import trusted_arguments, untrusted_arguments

from ._accumulate import Accumulation, accumulated_rows, full_batch
from ._agreement import (
    agree_on_losses,
    check_same_heads,
    check_same_problem,
    equal_shards,
    global_dual_forward,
    unequal_shards_error,
)
from ._engine import JacobianEngine
from ._features import FeaturesJacobian
from ._fsdp import (
    feed_sharded_heads,
    is_sharded,
    refuse_sharded,
    reshard_after_forward_without_grad,
    split_sharded_heads,
)
from ._guards import FiniteValues, NonFiniteStepError, StepGuard, finite_columns, finite_each, finite_entries
from ._head_grads import HeadGradients, fed_grads_finite
from ._hyperparameters import (
    BOOKKEEPING_KEYS,
    check_group_hyperparameters,
    check_groups_agree,
    check_hyperparameter,
    check_new_params,
    check_num_tasks,
    check_params_argument,
    recheck_hyperparameters,
    shared_device,
)
from ._loss_scale import LossScale, times
from ._losses import check_losses
from ._micro_batches import DrawnMicroBatches, draw_micro_batches, forget_micro_batches, is_micro_batches
from ._parameters import ParametersJacobian
from ._presets import Presets
from ._shared_reach import SharedReach
from ._state_dict import STATE_KEY, initial_state, owned_state, validate_state_dict
from .types import Closure, ParamsT  # the closure protocol (above), the shared parameters

__all__ = ["Closure", "MultiObjectiveOptimizer", "NonFiniteStepError", "ParamsT", "configure_jacobian"]

# The ways of taking per-task gradients (``jacobian=``), see configure_jacobian.
JACOBIANS: tuple[str, ...] = ("parameters", "features")

# Attributes that only live during one step or cache what the next step rebuilds: left out of a
# pickled / deep-copied optimizer (torch.optim.Optimizer keeps only defaults, state and
# param_groups; drmoo keeps its configuration too, see __getstate__) and reset on unpickling.
_SCRATCH_ATTRIBUTES = ("_head_grads", "_guard", "_ops", "batch_weight", "_hyperparameters_passed",
                       "_shared_reach", "_ranks_checked", "_heads_checked", "accumulation",
                       "drawn_micro_batches")


def configure_jacobian(optimizer: MultiObjectiveOptimizer, jacobian: str, strategy: str) -> JacobianEngine:
    """The engine for ``jacobian`` ("parameters": the paper's J_theta; "features": J_z), whose per-task
    gradients are taken by ``strategy`` (the constructor's ``jacobian_strategy``), for a method's
    constructor: ``self.jacobian_engine = configure_jacobian(self, jacobian, jacobian_strategy)``.

    A method that cannot be written in feature space says why in its class attribute
    ``FEATURES_REFUSAL`` and is refused here, at construction (never a silent fallback); likewise a method
    whose parameters-mode step cannot run on FSDP2-sharded shared parameters, in ``SHARDED_REFUSAL``.
    """
    # Checked by the property (drmoo.jacobian.check_strategy: a ValueError naming the value and the choices).
    # It is kept as an attribute, like the property set later, not as a hyperparameter: outside param_groups
    # and state_dict, so a resumed run may take another strategy (another device's) -- the strategies compute
    # the same gradients, up to rounding, so the choice is how this process runs, not the training state.
    optimizer.jacobian_strategy = strategy
    if jacobian not in JACOBIANS:
        raise ValueError(f"jacobian must be one of {', '.join(JACOBIANS)}; got {jacobian!r}")
    # FSDP (drmoo.optim._fsdp): a method whose parameters-mode step cannot run on the shards' columns says why
    # in its class attribute ``SHARDED_REFUSAL``.
    refuse_sharded(optimizer._shared_params(), jacobian, type(optimizer).__name__,
                   getattr(type(optimizer), "SHARDED_REFUSAL", None))
    if jacobian == "parameters":
        return ParametersJacobian()
    refusal = getattr(type(optimizer), "FEATURES_REFUSAL", None)
    if refusal:
        raise ValueError(f"{type(optimizer).__name__} cannot use jacobian='features': {refusal}")
    # How its rows above z are taken follows ``optimizer.jacobian_strategy`` ("auto" by default:
    # drmoo.jacobian.resolve_strategy and FeaturesJacobian.task_jacobian).
    return FeaturesJacobian(type(optimizer).__name__)


def _all_or_nothing(step: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``step``: the heads' gradients it feeds are kept aside and committed only if it returns.

    A step that raises (a NaN, a bad closure) leaves every ``.grad`` of the heads as it found it,
    as it leaves theta, eta and w (and the step count and stats).  Its NaN/Inf guards still unread at
    its end are read then (drmoo.optim._guards); a step that fails otherwise while a guard it met
    before has failed raises that guard's error, as if each guard had been read at once.  Nested calls
    (a subclass's step calling its parent's) share the outermost call's bookkeeping.
    """

    @functools.wraps(step)
    def all_or_nothing_step(self: MultiObjectiveOptimizer, *args: Any, **kwargs: Any) -> Any:
        if self._head_grads is not None:
            return step(self, *args, **kwargs)
        self.check_hyperparameters_now()
        head_grads = self._head_grads = HeadGradients()
        state = self.state[STATE_KEY]
        steps_before, stats_before = state["step"], self.stats
        guard = self._guard = StepGuard(self.capturable, self.device, steps_before)
        try:
            # The step hands the ops only what it checked itself (weights, parameters): the ops'
            # own value checks would cost a host read per call and break capturable steps.
            with trusted_arguments():
                result = step(self, *args, **kwargs)
            guard.settle()  # eager: the guards met after the step's last write to theta or its state
        except BaseException as error:
            head_grads.roll_back()
            state["step"], self.stats = steps_before, stats_before
            failure = _first_failure(guard) if isinstance(error, Exception) else None
            if failure is not None:  # a guard met before the error failed: the step stopped there
                raise failure from None
            raise
        else:
            # Direction mode under torch.distributed: the step's head gradients summed over ranks first
            # (see drmoo.optim._head_grads.sum_head_grads_over_ranks).
            head_grads.commit(guard.found_inf, sum_over_ranks=self.direction_mode, shared=self._shared_params())
            guard.count(self.state[STATE_KEY], self.stats, self.device)
        finally:
            self._head_grads = None
            self._guard = None
            self.jacobian_engine.end_step()
            forget_micro_batches(self)  # a closure's micro-batches live for the step that drew them
        return result

    return all_or_nothing_step


def _first_failure(guard: StepGuard) -> BaseException | None:
    """The error of the first failing guard the step has not read yet, if any (one host read)."""
    try:
        guard.settle()
    except Exception as failure:  # the guard's error, returned to be raised in place of the step's
        return failure
    return None


def overflow_hint(divergence: Divergence) -> str:
    """The likely cause of non-finite dual weights, for the error message (KL's exp overflows first)."""
    if divergence.name == "kl":
        return " (kl weights exp((loss - eta)/lam) overflow for large losses: raise lam or use cvar_smooth)"
    return ""


class MultiObjectiveOptimizer(Presets, torch.optim.Optimizer):
    """Base class: validated closure calls, per-task Jacobians (through its engine), w/eta state.

    Subclasses implement :meth:`step`.  The hyperparameters are global to the algorithm (the update
    direction couples every shared parameter), so parameter groups must agree on all of them; they
    are read from the first group, which is where LR schedulers write too.
    """

    # torch types ``state`` as {parameter: its state}; drmoo keeps its own entries (w, eta, the
    # counters) beside those, under the str key STATE_KEY.
    state: defaultdict[Any, Any]

    if TYPE_CHECKING:
        # Every method defines ``step`` with this signature (FAMO adds ``reevaluate``), not torch's
        # ``step(closure: Callable[[], float] | None) -> float | None``: declared here so that code
        # holding a MultiObjectiveOptimizer (from drmoo.optim.create, say) is checked against it.
        def step(self, closure: Closure | None = None) -> Tensor:  # type: ignore[override]
            """One iteration of the method; calls ``closure`` as its algorithm needs."""
            ...

    accumulation: Accumulation | None = None  # the Balancer's, in a step closing an accumulation (_accumulate)
    # Under torch.distributed, whether the ranks were checked to train the same problem and the same heads
    # (once per optimizer, at its first draw / first draw with a graph: _agree_across_ranks).
    _ranks_checked: bool = False
    _heads_checked: bool = False
    # The step's latest draw whose closure returned micro-batches, while the step uses it (_micro_batches).
    drawn_micro_batches: DrawnMicroBatches | None = None
    # Whether every batch a step draws is taken at the same (theta, eta) (MoDo, SDMGrad: yes; Double-Loop
    # draws at random inner iterates of eta): then draws over one graph give one Jacobian (jacobian_memo).
    DRAWS_SHARE_ONE_POINT: ClassVar[bool] = False
    # Whether a step forms the task Jacobian (every method but FAMO, whose step is one combined backward):
    # the heads-as-shared check reads it, and takes one backward per task where there is none.
    FORMS_JACOBIAN: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = _all_or_nothing(cls.__dict__["step"])  # type: ignore[method-assign]

    def __init__(self, params: ParamsT, num_tasks: int, defaults: dict[str, Any], backend: str | None) -> None:
        # The heads' gradients of the running step, kept apart until it succeeds (see _all_or_nothing); None
        # between steps.
        self._head_grads: HeadGradients | None = None
        # The NaN/Inf guards of the running step (capturable: its device-side found_inf, which every
        # write is masked by); None between steps.
        self._guard: StepGuard | None = None
        # Per parameter group, the hyperparameter values that passed check_hyperparameters_now last
        # (by identity: a value a scheduler or user did not replace is not checked again).
        self._hyperparameters_passed: list[dict[str, Any]] = []
        # Direction mode (drmoo.Balancer): the step adds its direction to the shared parameters'
        # .grad, times grad_scale (a GradScaler's scale), instead of writing theta, and sums the
        # heads' gradients over ranks under torch.distributed (drmoo.optim._head_grads).
        self.direction_mode = False
        self.grad_scale: LossScale = 1.0
        # How many more backward passes will run over the graph of the losses being used: a
        # Balancer given one batch hands the same losses to every draw of a multi-batch method
        # (MoDo, SDMGrad, Double-Loop), whose Jacobians must then keep the graph for the next one.
        self.graph_reuses = 0
        # For a DRAWS_SHARE_ONE_POINT method while graph_reuses > 0 (the Balancer's single-batch form):
        # the first draw's (losses, the point its cotangent was taken at, Jacobian).  A later draw over the
        # same graph at the same point (eta and the sample weights unchanged: the same cotangent, with no
        # value read) is the same matrix, so it is handed out again instead of running m more backward
        # passes (MoDo, SDMGrad: m backward passes instead of 3m).  Cleared by the Balancer after its step.
        self.jacobian_memo: tuple[Tensor, tuple[int, ...], Tensor] | None = None
        # A "shared" parameter that only some tasks reach is a head passed by mistake (its gradient
        # would be scaled by w_i): refused at the first Jacobian unless allowed (see
        # _refuse_partly_shared_params).  True keeps such parameters in the multi-objective update.
        self.allow_partial_shared = False
        self.check_trunk_gradients = True  # features mode's NaN/Inf test of the trunk (_engine.tests_trunk_gradients)
        self._shared_reach = SharedReach(num_tasks)
        # How the messages name where the losses came from: "the closure returned" for step(closure);
        # the Balancer names its own argument when it was given the losses themselves.
        self.losses_origin = "the closure returned"
        # How per-task gradients are taken (drmoo.optim._engine): w.r.t. the shared parameters (the paper's)
        # unless the method's constructor sets another engine (configure_jacobian).
        self.jacobian_engine: JacobianEngine = ParametersJacobian()
        self.num_tasks = check_num_tasks(num_tasks)
        defaults = dict(defaults)
        defaults["divergence"] = str(get_divergence(defaults["divergence"]))
        super().__init__(check_params_argument(params), defaults)
        shared = self._shared_params()  # one device and dtype: checked by add_param_group
        self.device = shared_device(shared)
        self.backend = resolve_backend(backend, self.device)
        self._ops = backend_module(self.backend)
        # importance weights omega [B, m] of the most recent closure call (None = uniform)
        self.batch_weight: Tensor | None = None
        # Gradient scaling for fp16 (as torch.amp.GradScaler does for losses): every backward runs on
        # cotangents times loss_scale, so small fp16 gradients do not underflow; the shared-parameter
        # gradients are divided back before use.  The heads' .grad stay scaled: divide them before
        # stepping the heads (the trainer does).  An overflow surfaces as NonFiniteStepError.
        self.loss_scale: LossScale = 1.0
        self._jacobian_strategy = "auto"
        self.stats: dict[str, Tensor] = {}
        self.state[STATE_KEY] = initial_state(num_tasks, method=type(self).__name__, device=self.device,
                                              parameters_dtype=shared[0].dtype)

    # -------------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the per-step scratch (torch's own keeps only defaults/state/param_groups,
        which left a copy without num_tasks, backend, ... and failing on its first step)."""
        # Hooks are dropped as torch drops them (they are process-local callables).
        return {key: value for key, value in self.__dict__.items()
                if key not in _SCRATCH_ATTRIBUTES and not key.startswith("_optimizer_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also called by torch's load_state_dict with only state and param_groups: then no scratch is reset.
        defaults = state.get("defaults", getattr(self, "defaults", {}))
        had_differentiable = "differentiable" in defaults
        super().__setstate__(state)
        if not had_differentiable:  # torch adds it; it is no drmoo hyperparameter (load_state_dict checks them)
            self.defaults.pop("differentiable", None)
        if "defaults" not in state:
            return
        self._head_grads = None
        self._guard = None
        self._shared_reach = SharedReach(self.num_tasks)
        self.batch_weight = None
        self._hyperparameters_passed = []
        self._ops = backend_module(self.backend)

    # ----------------------------------------------------------------------------------- params
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyperparameters are checked like the constructor's and must match the first group's.

        Args:
            param_group: ``{"params": ..., **hyperparameters}``, as for ``torch.optim.Optimizer``.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"a parameter group must be a dict, got {type(param_group).__name__}")
        params = check_new_params(self.param_groups, self._shared_params(), param_group.get("params"))
        checked = check_group_hyperparameters(type(self).__name__, self.defaults, param_group)
        checked["params"] = params
        super().add_param_group(checked)
        check_groups_agree(self.param_groups)

    def check_hyperparameters_now(self) -> None:
        """Check every group's hyperparameters again, as the constructor did: at each step.

        An LR scheduler (a lambda returning NaN or a negative factor) or a direct ``param_groups``
        write can change them after construction.  A few float checks per step; a tensor value
        (a scheduler may write one) is read only in eager steps, never in a capturable one.
        """
        recheck_hyperparameters(self.param_groups, self._hyperparameters_passed, self.capturable)

    @staticmethod
    def check_hyperparameter(key: str, value: Any) -> Any:
        """The validated (normalized) value of hyperparameter ``key``; raises ValueError naming it."""
        return check_hyperparameter(key, value)

    def _shared_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    @property
    def capturable(self) -> bool:
        """``capturable=True``: a step makes no host read (see :mod:`drmoo.optim`, "Capturable steps")."""
        return bool(self.param_groups[0].get("capturable", False))

    @property
    def jacobian_strategy(self) -> str:
        """How per-task gradients are computed: ``"auto"`` (default), ``"loop"`` (one backward per task) or
        ``"batched"`` (one vmapped backward): see :mod:`drmoo.jacobian`.  ``"auto"`` takes the fewest kernel
        launches on a GPU and the least memory traffic on the CPU, and in features mode the rows of
        separate heads from one ordinary pass."""
        return self._jacobian_strategy

    @jacobian_strategy.setter
    def jacobian_strategy(self, value: str) -> None:
        self._jacobian_strategy = check_strategy(value)

    @property
    def features_engine(self) -> FeaturesJacobian | None:
        """The features-mode engine (``jacobian="features"``), or None in parameters mode."""
        return self.jacobian_engine if isinstance(self.jacobian_engine, FeaturesJacobian) else None

    # ------------------------------------------------------------------------------------ state
    @property
    def w(self) -> Tensor:
        """Current preference vector (on the probability simplex)."""
        w: Tensor = self.state[STATE_KEY]["w"]
        return w

    @property
    def eta(self) -> Tensor:
        """Current dual variables, one per task."""
        eta: Tensor = self.state[STATE_KEY]["eta"]
        return eta

    @property
    def steps_taken(self) -> int:
        return int(self.state[STATE_KEY]["step"])

    @property
    def failing_iteration(self) -> str:
        """How a failing step's messages name it: the iteration being run, counted from 1 (the
        completed steps plus one), e.g. "iteration 1199 (counted from 1; 1198 completed before it)"."""
        done = self._guard.steps_before if self._guard is not None else self.steps_taken
        return f"iteration {done + 1} (counted from 1; {done} completed before it)"

    def hyper(self, key: str) -> Any:
        """A global hyperparameter (read from the first parameter group)."""
        return self.param_groups[0][key]

    @property
    def divergence(self) -> Divergence:
        return get_divergence(self.hyper("divergence"))

    def state_entries(self) -> dict[str, Any]:
        """The entries ``state["drmoo"]`` must have, with their current values (tensors or ints)."""
        own = self.state[STATE_KEY]
        return {key: own[key] for key in ("w", "eta", "step")}

    def validate_state_dict(self, state_dict: Any) -> None:
        """Raise ValueError naming the problem unless ``state_dict`` is this method's, for this problem:
        its hyperparameters and ``method`` entry, the number of tasks and shared parameters (every state
        tensor's shape), every state entry present, w on the simplex, eta finite (``drmoo.optim._state_dict``)."""
        shared_entries = sum(p.numel() for p in self._shared_params())
        validate_state_dict(state_dict, method=type(self).__name__, hyperparameters=set(self.defaults) - {"capturable"},
                            entries=self.state_entries(),
                            problem=f"num_tasks={self.num_tasks}, {shared_entries} shared entries")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by the same method for the same problem (validated first: see
        :meth:`validate_state_dict`).  ``capturable`` stays as constructed: it is a property of
        how this process runs the optimizer, not of the training state.

        Args:
            state_dict: a ``state_dict()`` of the same method for the same problem.
        """
        self.validate_state_dict(state_dict)
        capturable = self.defaults.get("capturable")
        dtypes = {key: value.dtype for key, value in self.state_entries().items() if isinstance(value, Tensor)}
        super().load_state_dict(state_dict)
        if capturable is not None:
            for group in self.param_groups:
                group["capturable"] = capturable
        self.state[STATE_KEY] = owned_state(self.state[STATE_KEY], method=type(self).__name__, device=self.device,
                                            dtypes=dtypes)

    # ---------------------------------------------------------------------------------- closure
    def draw_losses(self, closure: Closure | None, *, need_graph: bool) -> Tensor:
        """Call the closure once and check what it returned; raises naming the problem."""
        if closure is None:
            raise ValueError(
                f"{type(self).__name__}.step needs a closure that draws a fresh batch and returns "
                "per-sample losses [B, num_tasks]"
            )
        origin = self.losses_origin
        losses, weights = check_losses(_evaluate_closure(self, closure, need_graph), num_tasks=self.num_tasks,
                                       device=self.device, origin=origin, need_graph=need_graph)
        if weights is not None:  # (capturable: invalid weights skip the step)
            self._step_guard().invalid((torch.isfinite(weights) & (weights >= 0)).all(),
                                       f"{origin} sample weights that are negative, NaN or Inf")
        self.batch_weight = weights
        # A NaN must stop the step before anything is updated (read with the step's other guards), on
        # every rank: the flags are agreed on, so no rank waits forever in a collective.
        finite: Tensor | FiniteValues = finite_columns(losses)  # tested with the others, at the read
        if distributed.is_distributed():
            finite = _agree_across_ranks(self, losses, need_graph)
        self.require_finite(finite, lambda bad: (
            f"non-finite (NaN or Inf) per-sample losses for task(s) {bad} in {self.failing_iteration}; "
            "the step was abandoned and nothing was updated"))
        return losses

    def _collective_settings(self) -> dict[str, Any]:
        """What every rank must agree on before a step's collectives: the method, the Jacobian mode and the
        hyperparameters (they decide which collectives run, how many and of what size -- inner steps,
        resampling, features products -- and the replicas' updates)."""
        hyperparameters = {key: value for key, value in self.param_groups[0].items()
                           if key not in BOOKKEEPING_KEYS and key != "capturable" and not isinstance(value, Tensor)}
        mode = "features" if isinstance(self.jacobian_engine, FeaturesJacobian) else "parameters"
        return {"the method": type(self).__name__, "the Jacobian mode": mode, "the hyperparameters": hyperparameters}

    # ------------------------------------------------------------------------- checks and writes
    def _step_guard(self) -> StepGuard:
        """The running step's guards (outside a step, e.g. a method's helper called directly: read at once)."""
        return self._guard if self._guard is not None else StepGuard(False, self.device, self.steps_taken, True)

    def require_finite(self, flags: Tensor | FiniteValues, describe: Callable[[list[int]], str]) -> None:
        """Stop the step unless every flag (bool: "this part is finite") is True, or every value (FiniteValues)
        finite: eagerly a :class:`NonFiniteStepError` with ``describe(indices of the False flags)`` before
        anything is written (one host read for all the step's guards, :meth:`settle_guards`); capturable, no
        host read: the step's ``found_inf``, which masks every later write (:meth:`commit_`)."""
        self._step_guard().require(flags, describe)

    def settle_guards(self) -> None:
        """Eager: before a write that cannot be undone, read the step's pending guards (one host read)
        and raise the first failing one's error; capturable (or nothing pending): nothing to do."""
        if self._guard is not None:
            self._guard.settle_before_write()

    def read_with_guards(self, payload: Tensor) -> list[float]:
        """Eager: ``payload``'s values on the host, read together with the step's pending guards (raising the
        first failing one's error as :meth:`settle_guards` does): one host read for both."""
        return self._step_guard().settle_reading(payload)

    def vouch_finite(self, tensor: Tensor) -> None:
        """Eager: ``tensor`` was computed on the host and checked finite there: its own "finite" guards read
        nothing (:meth:`StepGuard.vouch_finite`)."""
        self._step_guard().vouch_finite(tensor)

    def deferred_writes(self) -> AbstractContextManager[None]:
        """Eager: the writes in this block, which the caller undoes itself if the step fails, read no guard."""
        return self._step_guard().deferred_writes()

    @property
    def failure_so_far(self) -> Tensor | None:
        """A 0-d bool on the device: the step is abandoned for what its guards found so far; None when
        there is nothing to tell (:attr:`~drmoo.optim._guards.StepGuard.failure_so_far`)."""
        return None if self._guard is None else self._guard.failure_so_far

    @property
    def found_inf(self) -> Tensor | None:
        """In a capturable step: the 0-d bool "this step is skipped" so far; None otherwise."""
        return None if self._guard is None else self._guard.found_inf

    def commit_(self, target: Tensor, value: Tensor) -> None:
        """``target <- value`` in place -- unless this capturable step is being skipped."""
        self._step_guard().commit_(target, value)

    # ------------------------------------------------------------------------------------ heads
    def set_aside_head_grads(self, heads: Iterable[Tensor]) -> None:
        """Before a backward feeds ``heads``: keep their ``.grad`` aside (added back once the step succeeds,
        restored if it fails: :class:`~drmoo.optim._head_grads.HeadGradients`); outside a step, nothing."""
        if self._head_grads is not None:
            self._head_grads.set_aside(heads)

    def check_head_grads(self, heads: Sequence[Tensor]) -> None:
        """The heads' gradients this step fed must be finite before anything is written
        (:func:`~drmoo.optim._head_grads.fed_grads_finite`; agreed on by every rank)."""
        finite = fed_grads_finite(heads)
        if finite is not None:
            self.require_finite(finite, lambda bad: (
                f"non-finite gradients of the task-specific parameters (the heads) in {self.failing_iteration}; "
                "the step was abandoned and nothing was updated"))

    # --------------------------------------------------------------------------------- jacobian
    def task_jacobian(self, losses: Tensor, cotangent: Tensor, slot: str, *, feed_heads: bool) -> Tensor:
        """Rows i = gradient of sum_b cotangent[b, i] * losses[b, i], by the engine (``jacobian_engine``).

        In parameters mode the rows are w.r.t. the shared parameters and land in a preallocated flat
        buffer ``slot`` (one per role, reused across steps) through :func:`drmoo.jacobian.task_jacobian`
        with strategy ``self.jacobian_strategy`` (``"loop"``: no copy, the parameters' ``.grad`` are
        views of the buffer; ``"batched"``: one vmapped backward); in features mode w.r.t. z.  With
        ``feed_heads`` every other leaf also accumulates its gradient (the heads' gradients for the
        user's optimizer); otherwise only the shared parameters are touched.
        """
        shared = self._shared_params()
        engine = self.jacobian_engine
        # (features: checks the graph either way)
        heads, sharded_heads = split_sharded_heads(engine.heads(losses, shared, feed_heads=feed_heads))
        self.set_aside_head_grads(heads)
        if sharded_heads:  # FSDP2-sharded heads: fed through FSDP's own backward, first (drmoo.optim._fsdp)
            feed_sharded_heads(self, losses, cotangent, sharded_heads)
        memoize = self.DRAWS_SHARE_ONE_POINT and not self.capturable
        memo, point = self.jacobian_memo, self._cotangent_point(cotangent)
        if memoize and memo is not None and memo[0] is losses and memo[1] == point:
            # The first draw's buffer itself (already unscaled and summed over ranks): the methods
            # that memoize (MoDo, SDMGrad) only read their Jacobians, so no copy of [m, n] is made.
            # The heads still get this draw's gradient, from a pass above them only.
            scaled = times(cotangent, self.loss_scale)
            feed_head_grads(losses, heads, scaled, retain_graph=self.take_graph_reuse())
            self.check_head_grads(accumulated_rows(self, heads, feed_heads))
            return memo[2]
        jacobian = engine.task_jacobian(self, losses, cotangent, slot, heads=heads, feed_heads=feed_heads)
        self.check_head_grads(accumulated_rows(self, heads, feed_heads, jacobian))
        self._refuse_partly_shared_params(jacobian)
        self.jacobian_memo = (losses, point, jacobian) if memoize and self.graph_reuses else None
        return jacobian

    def _cotangent_point(self, cotangent: Tensor) -> tuple[int, ...]:
        """Where a DRAWS_SHARE_ONE_POINT method's cotangent was taken -- eta and the sample weights, by
        storage and version (in-place writes bump it), and its shape -- as a key read on the host only."""
        weight, eta = self.batch_weight, self.eta
        return (eta.data_ptr(), eta._version, *cotangent.shape,
                *(() if weight is None else (weight.data_ptr(), weight._version)))

    def task_gram(self, jacobian: Tensor) -> Tensor:
        """J J^T of per-task rows through the ``gram`` op, as the global batch's (features rows: summed over ranks)."""
        return self.jacobian_engine.products_over_ranks(self.jacobian_engine.gram(self._ops, jacobian))

    def _pending_shared_reach(self) -> SharedReach | None:
        """The heads-as-shared check (:mod:`drmoo.optim._shared_reach`) while it still has to run: with two
        tasks or more, until every task has been seen, unless ``allow_partial_shared`` (a deliberately
        partial sharing).  Its count of checks done is scratch: a copied optimizer checks again.  It reads
        the host, and must not judge the gradients of a failing step: it reads the step's guards first."""
        reach = self._shared_reach
        return reach if reach.pending and not self.allow_partial_shared else None

    def _refuse_partly_shared_params(self, jacobian: Tensor) -> None:
        """Refuse a shared parameter that only some tasks reach (a head passed as shared), read off the
        Jacobian (no extra backward)."""
        if (reach := self._pending_shared_reach()) is not None:
            features = self.features_engine
            if features is None:
                reach.check_jacobian(self._shared_params(), jacobian, self.settle_guards)
            elif features.features is not None and not is_sharded(shared := self._shared_params()):
                # (FSDP2 shards are skipped: the graph below z holds FSDP's copies of them, not them)
                reach.check_features(shared, features.features, jacobian, self.settle_guards)

    def _refuse_partly_shared_params_by_backward(self, losses: Tensor, cotangent: Tensor) -> None:
        """The same for a method that forms no Jacobian (FAMO): one backward per task while it is pending."""
        if (reach := self._pending_shared_reach()) is not None:
            reach.check_by_backward(losses, cotangent, self._shared_params(), self.device, self.settle_guards)

    def dual_forward(self, losses: Tensor, eta: Tensor, lam: float, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """The ``dual_forward`` op on the latest batch (with its importance weights), over all ranks: the
        per-task objective, z and the loss cotangents of the global batch (:func:`~drmoo.optim._agreement.
        global_dual_forward`)."""
        return full_batch(self.accumulation,  # closing an accumulation: the full batch's (drmoo.optim._accumulate)
                          global_dual_forward(self._ops, losses, eta, lam, scale, self.divergence, self.batch_weight))

    def take_graph_reuse(self) -> bool:
        """Whether the backward about to run must keep the losses' graph (see ``graph_reuses``)."""
        if self.graph_reuses > 0:
            self.graph_reuses -= 1
            return True
        return False

    def apply_direction(self, jacobian: Tensor, w: Tensor, factor: Tensor | float = 1.0) -> None:
        """The method's theta step along d = factor * J^T w: ``theta -= lr * d`` (lr = the group's
        ``lr``; the ``combine`` op), or in direction mode ``.grad += grad_scale * d``; features rows are
        first lifted to theta by one backward pass through the trunk (the engine's ``apply``).

        In a capturable step the direction J^T w is formed first and zeroed if the step is
        skipped (0 * NaN would be NaN: scaling lr by 0 is not enough), then written by the same op.
        """
        self.jacobian_engine.apply(self, jacobian, w, factor)

    def check_dual(self, *dual_quantities: Tensor) -> None:
        """The dual step's outputs (z, weights' means) must be finite before anything is written."""
        self.require_finite(finite_each(*dual_quantities), lambda bad: (
            f"non-finite dual quantities (the worst-case weights f*'((loss - eta)/lam) overflowed) in "
            f"{self.failing_iteration}; the step was abandoned and nothing was "
            f"updated{overflow_hint(self.divergence)}"))

    def check_jacobian(self, gram: Tensor, role: str) -> None:
        """A non-finite Gram diagonal means a non-finite gradient entry (NaN/Inf propagate into it)."""
        self.require_finite(finite_entries(torch.diagonal(gram)), lambda bad: (
            f"non-finite gradients of the shared parameters for task(s) {bad} ({role}) in "
            f"{self.failing_iteration}; the step was abandoned and nothing was "
            f"updated{overflow_hint(self.divergence)}"))

    def _common_stats(self, objective: Tensor, balanced: Tensor, theta_norm: Tensor) -> dict[str, Tensor]:
        return {
            "w": self.w.detach().clone(),
            "eta": self.eta.detach().clone(),
            "dual_objective": objective.detach(),
            "balanced_grad_norm": balanced.detach().float(),
            "theta_grad_norm": theta_norm.detach().float(),
        }


def _evaluate_closure(optimizer: MultiObjectiveOptimizer, closure: Closure, need_graph: bool) -> Any:
    """What one call of ``closure`` returned, unpacked for the engine: one batch, or the batch its
    micro-batches make (drmoo.optim._micro_batches)."""
    with untrusted_arguments():  # the ops the closure calls check everything (see trusted_arguments)
        try:
            result = closure()
        finally:
            if not torch.is_grad_enabled():  # FSDP2 keeps a root's copies for a backward that will not come
                reshard_after_forward_without_grad()
    if is_micro_batches(result):  # the batch in parts: one batch of the method
        return draw_micro_batches(optimizer, result, need_graph=need_graph)
    forget_micro_batches(optimizer)  # an earlier draw's micro-batches are done with
    return optimizer.jacobian_engine.unpack(result, need_graph=need_graph)  # features: (losses, z[, weights])


def _agree_across_ranks(optimizer: MultiObjectiveOptimizer, losses: Tensor, need_graph: bool
                        ) -> Tensor | FiniteValues:
    """Under torch.distributed: the ranks' checks of one draw (the same problem once per optimizer, the same
    heads at the first draw with a graph, equal shards) and their agreed finite flags (drmoo.optim._agreement)."""
    if not getattr(optimizer, "_ranks_checked", False):
        check_same_problem(losses, optimizer._shared_params(), optimizer.num_tasks, optimizer._collective_settings())
        optimizer._ranks_checked = True
    if need_graph and not getattr(optimizer, "_heads_checked", False):
        check_same_heads(optimizer.jacobian_engine, losses, optimizer._shared_params(), optimizer.device)
        optimizer._heads_checked = True
    finite, rows = agree_on_losses(losses, finite_columns(losses).flags())
    if not optimizer.capturable:  # equal shards, checked with the guards (a capturable step trusts them)
        optimizer._step_guard().check(equal_shards(rows), lambda _: unequal_shards_error(rows))
    return finite


def batch_rows(optimizer: MultiObjectiveOptimizer, losses: Tensor) -> int:
    """The rows of the batch whose draw returned ``losses``: closing an accumulation (the last of several
    micro-batches), the whole batch's."""
    return int(losses.shape[0]) if optimizer.accumulation is None else optimizer.accumulation.total_rows
