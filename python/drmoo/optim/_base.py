"""What every drmoo optimizer shares: the closure protocol, input checks, per-task Jacobians, state.

The closure protocol.  ``optimizer.step(closure)`` calls ``closure()`` as often as its algorithm
needs; every call must draw a *fresh* batch and return the per-sample losses ``[B, m]`` (one column
per task) with their autograd graph - or a pair ``(losses, sample_weight)`` with importance weights
omega ``[B, m]`` >= 0 (e.g. CelebA's label balancing), which then enter every expectation of the
dual objective.  The optimizer, not the user, turns those losses into the DR dual objective, its
weights and its per-task gradients.

Shared vs task-specific parameters.  The parameters handed to the optimizer are the *shared* ones
and go through the multi-objective update.  Every other trainable leaf that takes part in the losses
(e.g. one head per task) receives, in its ``.grad``, the gradient of the sum of the task dual
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
them, so that every ``.grad`` it leaves is the global batch's.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from drmoo import distributed
from drmoo.distributed import all_reduce_max
from drmoo.jacobian import STRATEGIES, column_views, feed_head_grads, head_leaves, task_jacobian
from drmoo_kernels import Divergence, backend_module, get_divergence, resolve_backend
from drmoo_kernels._checks import check_positive as check_positive  # re-exported: the methods' modules use it
from drmoo_kernels._checks import trusted_arguments, untrusted_arguments

from ._features import FeaturesJacobian

# The closure protocol (above): per-sample losses, or (losses, sample_weight); in features mode
# (losses, z) or (losses, z, sample_weight).
Closure = Callable[[], Tensor | tuple[Tensor, ...]]
ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]

STATE_KEY = "drmoo"
# MGDA's ways of computing w (mgda.py); here, below MGDA, because the hyperparameter checks name them too.
SOLVERS = ("one_step", "min_norm")

# An upper bound on m: the per-task Jacobian J is m x n in memory (m = 4096 tasks of a 1M-parameter
# trunk is 16 GiB in float32) and the methods' m x m work grows as m^2 to m^3; a larger count is a
# mistake (a sample count passed as num_tasks), not a problem to allocate for.
MAX_TASKS = 4096

# How many Jacobians at most are read for shared parameters that only some tasks reach (heads passed
# as shared): the first one whose every row is nonzero settles it (one pass over J, one host read).
_SHARED_REACH_CHECKS = 10

# Attributes that only live during one step or cache what the next step rebuilds: left out of a
# pickled / deep-copied optimizer (torch.optim.Optimizer keeps only defaults, state and
# param_groups; drmoo keeps its configuration too, see __getstate__) and reset on unpickling.
_SCRATCH_ATTRIBUTES = ("_head_grads_before", "_found_inf", "_ops", "_buffers", "batch_weight",
                       "_hyperparameters_passed", "_shared_reach_checked", "_ranks_checked")


class NonFiniteStepError(ValueError):
    """A step met a NaN/Inf (losses, dual quantities or gradients) and was abandoned: nothing changed.

    A ``ValueError``, so callers that treat it as bad input keep working; mixed-precision training
    catches it to skip an overflowing step, as a gradient scaler would.
    """


def column_views_2d(shared: Sequence[Tensor], matrix: Tensor) -> list[Tensor]:
    """The [m, numel] column blocks of a per-task matrix [m, n], one per shared parameter (J's layout)."""
    blocks, offset = [], 0
    for param in shared:
        blocks.append(matrix[:, offset : offset + param.numel()])
        offset += param.numel()
    return blocks


def check_count(name: str, value: int) -> int:
    """An int >= 1 (iteration counts, intervals)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_fraction(name: str, value: float, meaning: str = "a factor") -> float:
    """A number in [0, 1) (averaging / momentum factors)."""
    number = check_positive(name, value, allow_zero=True)
    if number >= 1.0:
        raise ValueError(f"{name} must be in [0, 1) ({meaning}), got {value!r}")
    return number


def check_flag(name: str, value: bool) -> bool:
    """A bool (a string such as "false" would otherwise count as True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_divergence(name: str, value: str) -> str:
    try:
        return str(get_divergence(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from None


def _check_solver(name: str, value: str) -> str:
    if value not in SOLVERS:
        raise ValueError(f"{name} must be one of {', '.join(SOLVERS)}; got {value!r}")
    return value


def _check_loss_floor(name: str, value: Any) -> tuple[float, ...]:
    """One finite number (stored as a 1-tuple, broadcast to every task) or one per task."""
    floors = (value,) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    try:
        floors = tuple(float(f) for f in floors)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or one number per task, got {value!r}") from None
    if not floors or any(f != f or abs(f) == float("inf") for f in floors):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return floors


# Every hyperparameter any drmoo optimizer has, and its check: the constructors and
# ``add_param_group`` / ``load_state_dict`` apply the same rule, so a parameter group cannot carry
# a value the constructor would refuse (lr = -1 would run gradient ascent).
HYPERPARAMETER_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    **{key: lambda name, value: check_positive(name, value, allow_zero=True)
       for key in ("lr", "pref_lr", "rho", "dual_lr", "logit_decay", "sdm_lambda")},
    **{key: check_positive for key in ("lam", "c1", "c2", "f1", "f2", "dual_scale", "max_norm", "famo_eps", "tol")},
    **{key: check_count for key in ("inner_steps", "update_every", "solver_iters", "max_iter")},
    "ema": lambda name, value: check_fraction(name, value, "the weight of the old tracking estimate"),
    "momentum": lambda name, value: check_fraction(name, value, "the momentum of the inner SGD"),
    **{key: check_flag for key in ("resample", "normalize", "capturable")},
    "divergence": _check_divergence,
    "solver": _check_solver,
    "loss_floor": _check_loss_floor,
}
# Keys torch and its LR schedulers keep in parameter groups next to the hyperparameters.
BOOKKEEPING_KEYS = frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr", "base_lr", "base_momentum",
                              "max_momentum"})


def _all_or_nothing(step: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``step``: the heads' gradients it feeds are kept aside and committed only if it returns.

    A step that raises (a NaN, a bad closure) leaves every ``.grad`` of the heads as it found it,
    as it leaves theta, eta and w.  Nested calls (a subclass's step calling its parent's) share the
    outermost call's bookkeeping.
    """

    @functools.wraps(step)
    def all_or_nothing_step(self: MultiObjectiveOptimizer, *args: Any, **kwargs: Any) -> Any:
        if self._head_grads_before is not None:
            return step(self, *args, **kwargs)
        self.check_hyperparameters_now()
        self._head_grads_before = {}
        if self.capturable:
            self._found_inf = torch.zeros((), dtype=torch.bool, device=self.device)
        try:
            # The step hands the ops only what it checked itself (weights, parameters): the ops'
            # own value checks would cost a host read per call and break capturable steps.
            with trusted_arguments():
                result = step(self, *args, **kwargs)
        except BaseException:
            self._roll_back_head_grads()
            raise
        else:
            self._commit_head_grads()
            self._count_skipped_step()
        finally:
            self._head_grads_before = None
            self._found_inf = None
            if self.features_engine is not None:
                self.features_engine.end_step()
        return result

    return all_or_nothing_step


class MultiObjectiveOptimizer(torch.optim.Optimizer):
    """Base class: validated closure calls, per-task Jacobians into flat buffers, w/eta state.

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


    # Named paper settings of the method: preset name -> constructor keyword arguments.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    # Whether every batch a step draws is taken at the same (theta, eta) (MoDo, SDMGrad: yes; Double-Loop
    # draws at random inner iterates of eta): then draws over one graph give one Jacobian (jacobian_memo).
    DRAWS_SHARE_ONE_POINT: ClassVar[bool] = False
    # Whether a step forms the task Jacobian (every method but FAMO, whose step is one combined backward):
    # the heads-as-shared check reads it, and takes one backward per task where there is none.
    FORMS_JACOBIAN: ClassVar[bool] = True

    @classmethod
    def preset(cls, name: str) -> dict[str, Any]:
        """Constructor keyword arguments of a named paper setting (``cls.PRESETS``), e.g.
        ``DoubleClipMGDA(params, m, **DoubleClipMGDA.preset("multimnist"))``.

        Args:
            name: a key of ``cls.PRESETS``; another name raises ValueError listing them.
        """
        try:
            return dict(cls.PRESETS[name])
        except KeyError:
            known = ", ".join(cls.PRESETS) or "none"
            raise ValueError(f"{cls.__name__} has no preset {name!r}; known presets: {known}") from None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = _all_or_nothing(cls.__dict__["step"])  # type: ignore[method-assign]

    def __init__(self, params: ParamsT, num_tasks: int, defaults: dict[str, Any], backend: str | None) -> None:
        # {id: (head, its .grad before the step)} while a step runs (see _all_or_nothing), else None
        self._head_grads_before: dict[int, tuple[Tensor, Tensor | None]] | None = None
        # While a capturable step runs: a 0-d bool on the device, "this step met a NaN/Inf" (the
        # checks OR into it instead of raising; every write is masked by it).  None otherwise.
        self._found_inf: Tensor | None = None
        # Per parameter group, the hyperparameter values that passed check_hyperparameters_now last
        # (by identity: a value a scheduler or user did not replace is not checked again).
        self._hyperparameters_passed: list[dict[str, Any]] = []
        # Direction mode (drmoo.Balancer): the step adds its direction to the shared parameters'
        # .grad, times grad_scale (a GradScaler's scale), instead of writing theta, and sums the
        # heads' gradients over ranks under torch.distributed (_sum_head_grads_over_ranks).
        self.direction_mode = False
        self.grad_scale: float = 1.0
        # How many more backward passes will run over the graph of the losses being used: a
        # Balancer given one batch hands the same losses to every draw of a multi-batch method
        # (MoDo, SDMGrad, Double-Loop), whose Jacobians must then keep the graph for the next one.
        self.graph_reuses = 0
        # For a DRAWS_SHARE_ONE_POINT method while graph_reuses > 0 (the Balancer's single-batch form):
        # the first draw's (losses, cotangent, Jacobian).  A later draw over the same graph with the same
        # cotangent is the same matrix, so it is handed out again instead of running m more backward
        # passes (MoDo, SDMGrad: m backward passes instead of 3m).  Cleared by the Balancer after its step.
        self.jacobian_memo: tuple[Tensor, Tensor, Tensor] | None = None
        # A "shared" parameter that only some tasks reach is a head passed by mistake (its gradient
        # would be scaled by w_i): refused at the first Jacobian unless allowed (see
        # _refuse_partly_shared_params).  True keeps such parameters in the multi-objective update.
        self.allow_partial_shared = False
        # How the messages name where the losses came from: "the closure returned" for step(closure);
        # the Balancer names its own argument when it was given the losses themselves.
        self.losses_origin = "the closure returned"
        # jacobian="features" (drmoo.optim._features): per-task gradients w.r.t. the representation z;
        # None: the paper's, w.r.t. the shared parameters.  Set by the method's constructor.
        self.features_engine: FeaturesJacobian | None = None
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or not 1 <= num_tasks <= MAX_TASKS:
            raise ValueError(f"num_tasks must be an int in [1, {MAX_TASKS}], got {num_tasks!r}")
        defaults = dict(defaults)
        defaults["divergence"] = str(get_divergence(defaults["divergence"]))
        super().__init__(params, defaults)
        self.num_tasks = num_tasks
        shared = self._shared_params()  # one device and dtype: checked by add_param_group
        if not shared:
            raise ValueError("the optimizer got no parameters that require grad")
        self.device = shared[0].device
        if self.device.type == "meta":
            raise ValueError(
                "the shared parameters are on the meta device (shapes without data, e.g. a model built under "
                "torch.device('meta')): materialize and initialize them first (model.to_empty(device=...) "
                "and the model's initialization), then build the optimizer / balancer"
            )
        self.backend = resolve_backend(backend, self.device)
        self._ops = backend_module(self.backend)
        self._buffers: dict[str, Tensor] = {}
        # importance weights omega [B, m] of the most recent closure call (None = uniform)
        self.batch_weight: Tensor | None = None
        # Gradient scaling for fp16 (as torch.amp.GradScaler does for losses): every backward runs on
        # cotangents times loss_scale, so small fp16 gradients do not underflow; the shared-parameter
        # gradients are divided back before use.  The heads' .grad stay scaled: divide them before
        # stepping the heads (the trainer does).  An overflow surfaces as NonFiniteStepError.
        self.loss_scale: float = 1.0
        self._jacobian_strategy = "loop"
        self.stats: dict[str, Tensor] = {}
        # w and eta in float32 (float64 when the parameters are float64): they are tiny, and the
        # dual variables need the precision whatever the model's dtype.
        state_dtype = torch.float64 if shared[0].dtype == torch.float64 else torch.float32
        self.state[STATE_KEY] = {
            "w": torch.full((num_tasks,), 1.0 / num_tasks, device=self.device, dtype=state_dtype),
            "eta": torch.zeros(num_tasks, device=self.device, dtype=state_dtype),
            "step": 0,
            "method": type(self).__name__,  # load_state_dict refuses another method's state
            # steps skipped on the device by capturable=True (a NaN/Inf met; nothing written)
            "skipped_steps": torch.zeros((), dtype=torch.int64, device=self.device),
        }

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
        self._head_grads_before = None
        self._found_inf = None
        self.batch_weight = None
        self._hyperparameters_passed = []
        self._buffers = {}
        self._ops = backend_module(self.backend)

    # ----------------------------------------------------------------------------------- params
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyperparameters are checked like the constructor's and must match the first group's.

        Args:
            param_group: ``{"params": ..., **hyperparameters}``, as for ``torch.optim.Optimizer``.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"a parameter group must be a dict, got {type(param_group).__name__}")
        checked = dict(param_group)
        checked["params"] = self._check_new_params(param_group.get("params"))
        for key, value in param_group.items():
            if key in BOOKKEEPING_KEYS:
                continue
            if key not in self.defaults:
                known = ", ".join(sorted(self.defaults))
                raise ValueError(f"{type(self).__name__} has no hyperparameter {key!r}; its hyperparameters: {known}")
            checked[key] = self.check_hyperparameter(key, value)
        super().add_param_group(checked)
        self._check_groups_agree(self.param_groups)

    def check_hyperparameters_now(self) -> None:
        """Check every group's hyperparameters again, as the constructor did: at each step.

        An LR scheduler (a lambda returning NaN or a negative factor) or a direct ``param_groups``
        write can change them after construction.  A few float checks per step; a tensor value
        (a scheduler may write one) is read only in eager steps, never in a capturable one.
        """
        capturable = self.capturable
        passed = self._hyperparameters_passed
        if len(passed) != len(self.param_groups):
            passed[:] = [{} for _ in self.param_groups]
        for index, group in enumerate(self.param_groups):
            seen = passed[index]
            for key, value in group.items():
                if seen.get(key, seen) is value:  # the very object that passed last time (floats are immutable)
                    continue
                check = HYPERPARAMETER_CHECKS.get(key)
                if check is None or (capturable and isinstance(value, Tensor)):
                    continue
                try:
                    check(key, value)
                except (TypeError, ValueError) as error:
                    raise ValueError(
                        f"parameter group {index}: {error} (set after construction -- by an LR scheduler or a "
                        "param_groups write; checked at every step, nothing was updated)"
                    ) from None
                if not isinstance(value, Tensor):  # a tensor can change in place: checked every time
                    seen[key] = value
        if len(self.param_groups) > 1:
            self._check_groups_agree(self.param_groups)

    @staticmethod
    def check_hyperparameter(key: str, value: Any) -> Any:
        """The validated (normalized) value of hyperparameter ``key``; raises ValueError naming it."""
        check = HYPERPARAMETER_CHECKS.get(key)
        return value if check is None else check(key, value)

    def _check_new_params(self, params: Any) -> list[Tensor]:
        """The group's parameters as a list: each once, none already in another group, and (those
        that require grad) on the device and in the dtype of the ones already added -- they share one
        flat gradient buffer, and a parameter given twice would get twice the update."""
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)) or params is None:
            raise TypeError("a parameter group's params must be a Tensor or an ordered sequence of Tensors "
                            f"(not {type(params).__name__}: its order would change between runs)")
        new_params: list[Tensor] = list(params)  # each checked to be a Tensor below
        known = {id(p): index for index, group in enumerate(self.param_groups) for p in group["params"]}
        seen: set[int] = set()
        for param in new_params:
            if not isinstance(param, Tensor):
                raise TypeError(f"optimizer parameters must be Tensors, got {type(param).__name__}")
            if id(param) in seen:
                raise ValueError(
                    f"a parameter (shape {tuple(param.shape)}) appears twice in one parameter group; each "
                    "parameter must be given once (twice would apply its update twice)"
                )
            if id(param) in known:
                raise ValueError(
                    f"a parameter (shape {tuple(param.shape)}) is already in parameter group {known[id(param)]}; "
                    "each parameter must be given once (twice would apply its update twice)"
                )
            seen.add(id(param))
        shared = [p for p in (*self._shared_params(), *new_params) if p.requires_grad]
        devices = {p.device for p in shared}
        dtypes = {p.dtype for p in shared}
        if len(devices) > 1 or len(dtypes) > 1:
            raise ValueError(
                "all shared parameters must have one device and dtype (they share one flat gradient "
                f"buffer); got devices {sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}"
            )
        return new_params

    @staticmethod
    def _check_groups_agree(groups: list[dict[str, Any]]) -> None:
        first = groups[0]
        for group in groups[1:]:
            for key, value in group.items():
                if key in BOOKKEEPING_KEYS or key not in first or isinstance(value, Tensor):
                    continue
                if first[key] != value:
                    raise ValueError(
                        f"hyperparameter {key!r} differs between parameter groups ({first[key]!r} vs "
                        f"{value!r}); drmoo optimizers need the same hyperparameters in every group"
                    )

    def _shared_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    @property
    def capturable(self) -> bool:
        """``capturable=True``: a step makes no host read (see :mod:`drmoo.optim`, "Capturable steps")."""
        return bool(self.param_groups[0].get("capturable", False))

    @property
    def jacobian_strategy(self) -> str:
        """How per-task gradients are computed: ``"loop"`` (default) or ``"batched"``."""
        return self._jacobian_strategy

    @jacobian_strategy.setter
    def jacobian_strategy(self, value: str) -> None:
        if value not in STRATEGIES:
            raise ValueError(f"unknown Jacobian strategy {value!r}; valid choices: {', '.join(STRATEGIES)}")
        self._jacobian_strategy = value

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
        done = self.steps_taken
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
        """Raise ValueError naming the problem unless ``state_dict`` is this method's, for this problem.

        Checks that it is a drmoo optimizer state of the same method (its hyperparameter names and
        its ``method`` entry), the same number of tasks and shared parameters (every state tensor's
        shape), with valid hyperparameters, every state entry present, w on the simplex and the
        dual variables finite -- before anything is loaded.
        """
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
            state_dict.get("param_groups"), list
        ):
            raise ValueError("not an optimizer state_dict (expected a dict with 'state' and 'param_groups')")
        saved = state_dict["state"].get(STATE_KEY)
        if not isinstance(saved, dict):
            raise ValueError(f"state_dict has no {STATE_KEY!r} entry: it was not saved by a drmoo optimizer")
        method = saved.get("method", name)
        if method != name:
            raise ValueError(f"state_dict was saved by {method}, not by {name}: it cannot continue this run")
        groups = state_dict["param_groups"]
        if not groups or not all(isinstance(group, dict) for group in groups):
            raise ValueError("state_dict's param_groups must be a non-empty list of dicts")
        expected = set(self.defaults) - {"capturable"}
        for group in groups:
            keys = set(group) - BOOKKEEPING_KEYS - {"capturable"}
            if keys != expected:
                missing, unexpected = sorted(expected - keys), sorted(keys - expected)
                raise ValueError(
                    f"state_dict's hyperparameters are not {name}'s (missing: {missing or 'none'}; not {name}'s: "
                    f"{unexpected or 'none'}): it was saved by another method"
                )
            for key in keys:
                try:
                    self.check_hyperparameter(key, group[key])
                except (TypeError, ValueError) as error:
                    raise ValueError(f"state_dict has an invalid hyperparameter: {error}") from None
        self._check_groups_agree(groups)
        for key, current in self.state_entries().items():
            if key not in saved:
                raise ValueError(f"state_dict has no {key!r} entry: it was not saved by {name} (or is damaged)")
            value = saved[key]
            if isinstance(current, Tensor):
                if not isinstance(value, Tensor):
                    raise ValueError(f"state_dict's {key} must be a tensor, got {type(value).__name__}")
                if tuple(value.shape) != tuple(current.shape):
                    raise ValueError(
                        f"state_dict's {key} has shape {tuple(value.shape)}, but this {name} (num_tasks="
                        f"{self.num_tasks}, {sum(p.numel() for p in self._shared_params())} shared entries) "
                        f"expects {tuple(current.shape)}"
                    )
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"state_dict's {key} has NaN or Inf entries")
            elif isinstance(current, int) and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"state_dict's {key} must be an int >= 0, got {value!r}")
        w = saved["w"].double()
        if bool((w < 0).any()) or abs(float(w.sum()) - 1.0) > 1e-6:
            raise ValueError(f"state_dict's w is not on the probability simplex: {w.tolist()}")

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
        # Non-parameter state is copied by reference and not moved by torch: own it, place it on
        # this optimizer's device in this optimizer's dtypes.
        own = self.state[STATE_KEY]
        self.state[STATE_KEY] = {
            key: value.detach().to(device="cpu" if key == "rng_state" else self.device,
                                   dtype=dtypes.get(key, value.dtype), copy=True)
            if isinstance(value, Tensor) else value
            for key, value in own.items()
        }
        self.state[STATE_KEY]["method"] = type(self).__name__

    # ---------------------------------------------------------------------------------- closure
    def draw_losses(self, closure: Closure | None, *, need_graph: bool) -> Tensor:
        """Call the closure once and check what it returned; raises naming the problem."""
        if closure is None:
            raise ValueError(
                f"{type(self).__name__}.step needs a closure that draws a fresh batch and returns "
                "per-sample losses [B, num_tasks]"
            )
        origin = self.losses_origin
        with untrusted_arguments():  # the ops the closure calls check everything (see trusted_arguments)
            result = closure()
        if self.features_engine is not None:  # (losses, z[, sample_weight]): z is kept for the step
            result = self.features_engine.unpack(result, need_graph=need_graph)
        losses, weights = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
        m = self.num_tasks
        if not isinstance(losses, Tensor):
            raise TypeError(
                f"the closure must return a Tensor of per-sample losses [B, {m}], got {type(losses).__name__}"
            )
        if losses.dim() != 2:
            raise ValueError(
                f"{origin} losses of shape {tuple(losses.shape)}; expected per-sample losses "
                f"[B, {m}] (one column per task, not averaged over the batch)"
            )
        if losses.shape[1] != m:
            raise ValueError(
                f"{origin} losses for {losses.shape[1]} tasks (shape {tuple(losses.shape)}), "
                f"but num_tasks={m} was given"
            )
        if losses.shape[0] == 0:
            raise ValueError(f"{origin} an empty batch (B = 0); the dual objective needs samples")
        if losses.device != self.device:
            raise ValueError(
                f"{origin} losses on {losses.device}, but the shared parameters are on {self.device}; "
                "compute the losses on the parameters' device"
            )
        if not losses.is_floating_point():
            raise TypeError(f"per-sample losses must be floating point, got {losses.dtype}")
        if need_graph and not losses.requires_grad:
            raise ValueError(
                f"{origin} losses with no autograd graph (computed under torch.no_grad(), "
                "detached, or from parameters that do not require grad); the optimizer needs their "
                "gradients"
            )
        if weights is not None:
            if not isinstance(weights, Tensor) or tuple(weights.shape) != tuple(losses.shape):
                shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
                raise ValueError(
                    f"{origin} sample weights of shape {shape}; they must match the losses "
                    f"{tuple(losses.shape)} (one importance weight per sample and task)"
                )
            if weights.device != losses.device:
                raise ValueError(f"{origin} sample weights on {weights.device}, but the losses are "
                                 f"on {losses.device}")
            weights = weights.detach()
            valid = (torch.isfinite(weights) & (weights >= 0)).all()
            if self._found_inf is not None:  # capturable: invalid weights skip the step
                self._found_inf.logical_or_(~valid)
            elif not bool(valid):
                raise ValueError(f"{origin} sample weights that are negative, NaN or Inf")
        self.batch_weight = weights
        # Eager: one host sync per closure call, a NaN must stop the step before anything is
        # updated (on every rank: the flags are agreed on, so no rank waits forever in a collective).
        finite = torch.isfinite(losses.detach()).all(dim=0)
        if distributed.is_distributed():
            finite = self._agree_across_ranks(losses, finite)
        self.require_finite(finite, lambda bad: (
            f"non-finite (NaN or Inf) per-sample losses for task(s) {bad} in {self.failing_iteration}; "
            "the step was abandoned and nothing was updated"))
        return losses

    def _agree_across_ranks(self, losses: Tensor, finite: Tensor) -> Tensor:
        """Under torch.distributed: the losses' finite flags agreed on by every rank, after checking
        that the ranks run the same problem on equal shards (a ValueError on every rank otherwise).

        Once per optimizer: m, B and the shared parameters' shapes and dtype, with one fixed-size
        collective (ranks that disagree on them would otherwise reach collectives of different
        sizes: a gloo abort or a hang).  At every call: B, in the flags' own collective -- the global
        statistics are means of the ranks' means, which is the global batch's only for equal shards.
        """
        shared = self._shared_params()
        if not getattr(self, "_ranks_checked", False):
            distributed.check_same_on_every_rank({
                "the number of tasks m": self.num_tasks,
                "the number of rows B of the losses (the shard size)": losses.shape[0],
                "the number of shared parameters": len(shared),
                "the shared parameters' shapes and dtype": distributed.fingerprint(
                    [(tuple(p.shape), str(p.dtype)) for p in shared]),
            }, device=losses.device)
            self._ranks_checked = True
        rows = losses.shape[0]
        flags = torch.cat([(~finite).to(torch.int64),
                           torch.tensor([rows, -rows], dtype=torch.int64, device=finite.device)])
        flags = all_reduce_max(flags)
        if not self.capturable:  # (a host read; eager steps read the flags right after anyway)
            most, fewest = flags[-2:].tolist()
            if most != -fewest:
                raise ValueError(distributed.unequal_shards_message(-fewest, most))
        return flags[:-2] == 0

    # ------------------------------------------------------------------------- checks and writes
    def require_finite(self, flags: Tensor, describe: Callable[[list[int]], str]) -> None:
        """Stop the step unless every flag is True (bool tensor: "this part is finite").

        Eager (``capturable=False``): one host read; a False flag raises
        :class:`NonFiniteStepError` with ``describe(indices of the False flags)`` before anything
        is written.  Capturable: no host read; the flags are OR-ed, negated, into the step's
        device-side ``found_inf`` and every later write is masked by it (:meth:`commit_`).
        """
        if self._found_inf is not None:
            self._found_inf.logical_or_(~flags.all())
            return
        if not bool(flags.all()):
            bad = [i for i, ok in enumerate(flags.reshape(-1).tolist()) if not ok]
            raise NonFiniteStepError(describe(bad))

    @property
    def found_inf(self) -> Tensor | None:
        """In a capturable step: the 0-d bool "this step is skipped" so far; None otherwise."""
        return self._found_inf

    def commit_(self, target: Tensor, value: Tensor) -> None:
        """``target <- value`` in place -- unless this capturable step is being skipped."""
        with torch.no_grad():
            if self._found_inf is None:
                target.copy_(value)
            else:
                target.copy_(torch.where(self._found_inf, target, value.to(target.dtype)))

    def _count_skipped_step(self) -> None:
        state = self.state[STATE_KEY]
        if "skipped_steps" not in state:  # a state loaded from before the counter existed
            state["skipped_steps"] = torch.zeros((), dtype=torch.int64, device=self.device)
        found_inf = self._found_inf
        if found_inf is not None:
            state["skipped_steps"].add_(found_inf.to(torch.int64))
        if self.stats:
            self.stats["found_inf"] = (found_inf.float() if found_inf is not None
                                       else torch.zeros((), dtype=torch.float32, device=self.device))
            self.stats["skipped_steps"] = state["skipped_steps"].clone()

    # ------------------------------------------------------------------------------------ heads
    def set_aside_head_grads(self, heads: Iterable[Tensor]) -> None:
        """Before a backward feeds ``heads``: keep their current ``.grad`` aside and start from None.

        The step's head gradients then accumulate from zero; :meth:`_commit_head_grads` adds the
        kept gradients back once the step succeeds, :meth:`_roll_back_head_grads` restores them if
        it fails.  Outside a step (no bookkeeping) this does nothing.
        """
        kept = self._head_grads_before
        if kept is None:
            return
        for head in heads:
            if id(head) not in kept:
                kept[id(head)] = (head, head.grad)
                head.grad = None

    def _commit_head_grads(self) -> None:
        """The step succeeded: add the kept gradients back (a skipped capturable step adds 0).

        In direction mode under torch.distributed the step's head gradients are first summed over
        ranks (see :meth:`_sum_head_grads_over_ranks`), so that the kept gradients are added to the
        global batch's.
        """
        kept = self._head_grads_before
        assert kept is not None
        found_inf = self._found_inf
        if found_inf is not None:
            with torch.no_grad():
                for head, _ in kept.values():
                    if head.grad is not None:
                        head.grad = torch.where(found_inf, torch.zeros_like(head.grad), head.grad)
        if self.direction_mode:
            self._sum_head_grads_over_ranks(head for head, _ in kept.values())
        for head, before in kept.values():
            if before is None:
                continue
            if head.grad is not None:
                with torch.no_grad():
                    before.add_(head.grad)  # accumulate in place, as autograd does into an existing .grad
            head.grad = before

    def _sum_head_grads_over_ranks(self, fed: Iterable[Tensor]) -> None:
        """Direction mode under torch.distributed: the heads' gradients of this step, summed over ranks.

        Each rank fed its heads from its shard (the cotangents are already divided by the world
        size, :meth:`dual_forward`), and DistributedDataParallel reduces none of them (its hooks do
        not fire for ``torch.autograd.grad``, and a DDP model runs the step inside ``no_sync()``):
        unsummed, every rank's torch optimizer would step its heads on its own shard and the
        replicas would drift apart.  The shared parameters, also kept aside in direction mode, are
        left out: their direction comes from the Jacobian, already summed in :meth:`task_jacobian`.
        Only direction mode sums here: after ``step(closure)`` the caller steps the heads and sums
        them itself (:func:`drmoo.distributed.all_reduce_grads`, as the trainer does), so each head
        gradient is summed exactly once on either path.  The order of ``fed`` is the graph's, the
        same on every rank, as the collective needs.
        """
        if not distributed.is_distributed():
            return
        shared = {id(param) for param in self._shared_params()}
        distributed.all_reduce_grads([head for head in fed if id(head) not in shared])

    def _roll_back_head_grads(self) -> None:
        assert self._head_grads_before is not None
        for head, before in self._head_grads_before.values():
            head.grad = before

    # --------------------------------------------------------------------------------- jacobian
    def _buffer(self, name: str) -> Tensor:
        shared = self._shared_params()
        n = sum(p.numel() for p in shared)
        buf = self._buffers.get(name)
        if buf is None or buf.shape != (self.num_tasks, n):
            buf = torch.empty(self.num_tasks, n, device=self.device, dtype=shared[0].dtype)
            self._buffers[name] = buf
        return buf

    def task_jacobian(self, losses: Tensor, cotangent: Tensor, slot: str, *, feed_heads: bool) -> Tensor:
        """Rows i = gradient of the shared parameters of sum_b cotangent[b, i] * losses[b, i].

        The rows land in the preallocated flat buffer ``slot`` (one per role, reused across steps)
        through :func:`drmoo.jacobian.task_jacobian` with strategy ``self.jacobian_strategy``
        (``"loop"``: no copy, the parameters' ``.grad`` are views of the buffer; ``"batched"``: one
        vmapped backward).  With ``feed_heads`` every other leaf also accumulates its gradient (the
        heads' gradients for the user's optimizer); otherwise only the shared parameters are touched.
        """
        shared = self._shared_params()
        features = self.features_engine
        if features is not None:  # the leaves above z, after checking the losses read the trunk only through z
            above_z = features.heads(losses, shared)
            heads = above_z if feed_heads else []
        else:
            heads = head_leaves(losses, shared) if feed_heads else []
        self.set_aside_head_grads(heads)
        scale = self.loss_scale
        scaled = cotangent * scale if scale != 1.0 else cotangent
        memoize = self.DRAWS_SHARE_ONE_POINT and not self.capturable  # (the match test below reads the host)
        memo = self.jacobian_memo
        if memoize and memo is not None and memo[0] is losses and torch.equal(memo[1], cotangent):
            # The first draw's buffer itself (already unscaled and summed over ranks): the methods
            # that memoize (MoDo, SDMGrad) only read their Jacobians, so no copy of [m, n] is made.
            # The heads still get this draw's gradient, from a pass above them only.
            feed_head_grads(losses, heads, scaled, retain_graph=self.take_graph_reuse())
            self.check_head_grads(heads)
            return memo[2]
        if features is not None:  # rows w.r.t. z: each rank keeps its samples' columns (task_gram sums)
            jacobian = features.task_jacobian(self, losses, scaled, slot, heads=heads)
        else:
            jacobian = task_jacobian(losses, scaled, shared, self._buffer(slot), strategy=self.jacobian_strategy,
                                     feed_heads=feed_heads, retain_graph=self.take_graph_reuse())
        if scale != 1.0:
            jacobian.div_(scale)
        if features is None:
            jacobian = distributed.all_reduce_sum_(jacobian)  # shard Jacobians -> the global batch's
        self.check_head_grads(heads)
        self._refuse_partly_shared_params(jacobian)
        self.jacobian_memo = (losses, cotangent.clone(), jacobian) if memoize and self.graph_reuses else None
        return jacobian

    def task_gram(self, jacobian: Tensor) -> Tensor:
        """J J^T of per-task rows through the ``gram`` op; features rows: summed over ranks."""
        gram = self._ops.gram(jacobian)
        return gram if self.features_engine is None else self.features_engine.sum_over_ranks(gram)

    def check_head_grads(self, heads: Sequence[Tensor]) -> None:
        """The heads' gradients this step fed must be finite before anything is written.

        The shared parameters' Jacobian is checked through its Gram matrix, but the heads' ``.grad``
        come from their own backward: an Inf there (a GradScaler's overflow in the heads only) must
        abandon the step too, or the balancer would advance eta, w and its count while the scaler
        skips the optimizer's step.  The heads' ``.grad`` hold this step's gradients only (set aside
        by :meth:`set_aside_head_grads`).
        """
        fed = [head.grad for head in heads if head.grad is not None]
        if not fed:
            return
        finite = torch.stack([torch.isfinite(grad).all() for grad in fed])
        if distributed.is_distributed():  # every rank abandons the step, or none
            finite = all_reduce_max((~finite.all()).to(torch.int32).reshape(1)) == 0
        self.require_finite(finite, lambda bad: (
            f"non-finite gradients of the task-specific parameters (the heads) in {self.failing_iteration}; "
            "the step was abandoned and nothing was updated"))

    def _shared_reach_pending(self) -> bool:
        """Whether the heads-as-shared check (``_refuse_partly_shared_params``) still has to run."""
        checks_done = getattr(self, "_shared_reach_checked", 0)
        return checks_done < _SHARED_REACH_CHECKS and not getattr(self, "allow_partial_shared", False)

    def _refuse_partly_shared_params(self, jacobian: Tensor) -> None:
        """Refuse a shared parameter that only some tasks reach (a head passed as shared), once.

        Such a parameter's row entries are exactly zero for the tasks that do not reach it, so the
        method's direction gives it w_i times its task's gradient (a head's learning rate silently
        divided by about m).  Read off the first Jacobian (no extra backward): parameter p counts as
        reached by task i when row i is nonzero on p's columns.  A task whose whole row is zero (all
        its sample weights zero, a zero-initialised head in front of it) tells nothing and is left
        out; the check is repeated (up to ``_SHARED_REACH_CHECKS`` Jacobians) until every task has
        been seen.  ``allow_partial_shared = True`` keeps such parameters (a deliberately partial sharing).
        A method that forms no Jacobian (FAMO) reads the same table from
        :meth:`_refuse_partly_shared_params_by_backward`.
        """
        if not self._shared_reach_pending():
            return
        shared = self._shared_params()
        if self.num_tasks < 2 or jacobian.dim() != 2 or jacobian.shape[1] != sum(p.numel() for p in shared):
            return  # one task, or not a Jacobian with respect to the shared parameters themselves
        with torch.no_grad():
            reached = torch.stack([view.any(dim=1) for view in column_views_2d(shared, jacobian != 0)], dim=1)
        self._judge_shared_reach(shared, reached)

    def _refuse_partly_shared_params_by_backward(self, losses: Tensor, cotangent: Tensor) -> None:
        """The heads-as-shared check for a method that forms no Jacobian (FAMO's one combined backward).

        Each task's gradient w.r.t. the shared parameters is taken alone (one backward per task,
        keeping the graph) and reduced at once to "nonzero on parameter p", so the memory is one
        task's gradient, not a Jacobian.  This costs m backward passes on the steps where the check
        is pending -- the first, unless a task's gradient is all zero -- and nothing afterwards.
        """
        if not self._shared_reach_pending() or self.num_tasks < 2:
            return
        shared = self._shared_params()
        rows = []
        for task in range(self.num_tasks):
            grads = torch.autograd.grad(losses[:, task], shared, grad_outputs=cotangent[:, task].to(losses.dtype),
                                        retain_graph=True, allow_unused=True)
            with torch.no_grad():
                rows.append(torch.stack([torch.zeros((), dtype=torch.bool, device=self.device) if grad is None
                                         else (grad != 0).any().to(self.device) for grad in grads]))
            del grads
        reached = torch.stack(rows)
        if distributed.is_distributed():  # the shards' gradients sum to the global batch's
            reached = distributed.all_reduce_sum_(reached.to(torch.float32)) > 0
        self._judge_shared_reach(shared, reached)

    def _judge_shared_reach(self, shared: Sequence[Tensor], reached: Tensor) -> None:
        """Raise if a shared parameter is reached by some informative tasks only (``reached``: [m, P] bool)."""
        with torch.no_grad():
            informative = reached.any(dim=1)
            table = reached[informative].tolist()
        tasks = [task for task, ok in enumerate(informative.tolist()) if ok]
        checks_done = getattr(self, "_shared_reach_checked", 0)
        # Done once every task has been seen (or after a few Jacobians); a refused step checks again.
        passed = _SHARED_REACH_CHECKS if len(tasks) == self.num_tasks else checks_done + 1
        for index, param in enumerate(shared):
            reaching = [task for task, row in zip(tasks, table) if row[index]]
            if reaching and len(reaching) < len(tasks):
                raise ValueError(
                    f"shared parameter {index} (shape {tuple(param.shape)}) is reached only by the losses of "
                    f"task(s) {reaching} of {self.num_tasks}: it looks like a task-specific head.  Pass only the "
                    "parameters every task uses (e.g. model.trunk.parameters()) as the shared parameters -- each "
                    "head then gets its own task's gradient in .grad; given as shared, its gradient would be "
                    "scaled by that task's weight w_i.  If the parameter is meant to be shared by some tasks "
                    "only, pass allow_partial_shared=True to drmoo.Balancer (or set "
                    "optimizer.allow_partial_shared = True on a drmoo optimizer)"
                )
        self._shared_reach_checked = passed

    def dual_forward(self, losses: Tensor, eta: Tensor, lam: float, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """The ``dual_forward`` op on the latest batch (with its importance weights), over all ranks.

        Returns the per-task objective, z and the loss cotangents.  Under torch.distributed the
        objective and z are averaged over ranks and the cotangents divided by the world size, so
        that they are those of the global batch (see :mod:`drmoo.distributed`).
        """
        objective, z, cotangent = self._ops.dual_forward(losses, eta, lam, scale, self.divergence, self.batch_weight)
        if distributed.is_distributed():
            distributed.all_reduce_mean(objective, z)
            cotangent = cotangent / distributed.world_size()
        return objective, z, cotangent

    def take_graph_reuse(self) -> bool:
        """Whether the backward about to run must keep the losses' graph (see ``graph_reuses``)."""
        if self.graph_reuses > 0:
            self.graph_reuses -= 1
            return True
        return False

    def apply_direction(self, jacobian: Tensor, w: Tensor, factor: Tensor | float = 1.0) -> None:
        """The method's theta step along d = factor * J^T w: ``theta -= lr * d`` (lr = the group's
        ``lr``; the ``combine`` op), or in direction mode ``.grad += grad_scale * d``.

        In a capturable step the direction J^T w is formed first and zeroed if the step is
        skipped (0 * NaN would be NaN: scaling lr by 0 is not enough), then written by the same op.
        """
        if self.features_engine is not None:  # rows w.r.t. z: one backward through the trunk gives d_theta
            lifted = self.features_engine.apply(self, jacobian, w, factor)
            if lifted is None:  # direction mode: written into .grad by the lift
                return
            jacobian, w, factor = lifted[None, :], torch.ones(1, dtype=w.dtype, device=w.device), 1.0
        if self.direction_mode:
            self._add_direction_to_grad(jacobian, w, factor)
            return
        lr = self.hyper("lr") if isinstance(factor, float) and factor == 1.0 else self.hyper("lr") * factor
        with torch.no_grad():
            if self._found_inf is None:
                self._ops.combine(jacobian, w, self._shared_params(), lr)
                return
            acc = torch.float64 if jacobian.dtype == torch.float64 else torch.float32
            # A persistent buffer: backends that cache per-address launch plans (triton) reuse theirs.
            direction = self._buffers.get("direction")
            if direction is None or direction.dtype != acc or direction.shape != (1, jacobian.shape[1]):
                direction = torch.empty(1, jacobian.shape[1], dtype=acc, device=jacobian.device)
                self._buffers["direction"] = direction
            torch.matmul(w.to(acc)[None, :], jacobian.to(acc), out=direction)
            direction.masked_fill_(self._found_inf, 0.0)
            one = torch.ones(1, dtype=acc, device=direction.device)
            self._ops.combine(direction, one, self._shared_params(), lr)

    def _add_direction_to_grad(self, jacobian: Tensor, w: Tensor, factor: Tensor | float) -> None:
        """Direction mode: every shared parameter's ``.grad`` += grad_scale * factor * (J^T w), as
        autograd accumulates (the step's contribution is kept apart like the heads' and committed
        only if the step succeeds; a skipped capturable step adds zeros)."""
        shared = self._shared_params()
        acc = torch.float64 if jacobian.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            direction = w.to(acc) @ jacobian.to(acc)  # [n], a fresh tensor: the .grad views keep it
            scale = factor * self.grad_scale if self.grad_scale != 1.0 else factor
            if not (isinstance(scale, float) and scale == 1.0):
                direction.mul_(scale)
            if self._found_inf is not None:
                direction.masked_fill_(self._found_inf, 0.0)
            self.set_aside_head_grads(shared)
            for param, view in zip(shared, column_views(shared, direction)):
                param.grad = view if view.dtype == param.dtype else view.to(param.dtype)

    def _overflow_hint(self) -> str:
        if self.divergence.name == "kl":
            return " (kl weights exp((loss - eta)/lam) overflow for large losses: raise lam or use cvar_smooth)"
        return ""

    def check_dual(self, *dual_quantities: Tensor) -> None:
        """The dual step's outputs (z, weights' means) must be finite before anything is written."""
        finite = torch.stack([torch.isfinite(q).all() for q in dual_quantities])
        self.require_finite(finite, lambda bad: (
            f"non-finite dual quantities (the worst-case weights f*'((loss - eta)/lam) overflowed) in "
            f"{self.failing_iteration}; the step was abandoned and nothing was updated{self._overflow_hint()}"))

    def check_jacobian(self, gram: Tensor, role: str) -> None:
        """A non-finite Gram diagonal means a non-finite gradient entry (NaN/Inf propagate into it)."""
        self.require_finite(torch.isfinite(torch.diagonal(gram)), lambda bad: (
            f"non-finite gradients of the shared parameters for task(s) {bad} ({role}) in "
            f"{self.failing_iteration}; the step was abandoned and nothing was updated{self._overflow_hint()}"))

    def _common_stats(self, objective: Tensor, balanced: Tensor, theta_norm: Tensor) -> dict[str, Tensor]:
        return {
            "w": self.w.detach().clone(),
            "eta": self.eta.detach().clone(),
            "dual_objective": objective.detach(),
            "balanced_grad_norm": balanced.detach().float(),
            "theta_grad_norm": theta_norm.detach().float(),
        }
