"""The hyperparameters of every drmoo optimizer: one check per name, and the parameter groups' rules.

The constructors, ``add_param_group``, ``load_state_dict`` and every step apply the same check to a
name, so a parameter group cannot carry a value the constructor would refuse (lr = -1 would run
gradient ascent).  The groups share one algorithm (the update direction couples every shared
parameter), so they must agree on every hyperparameter, and hold each parameter once, all on one
device and dtype (they share one flat gradient buffer).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from drmoo_kernels import get_divergence
from drmoo_kernels._checks import check_positive as check_positive  # re-exported: the methods' modules use it

# An upper bound on m: the per-task Jacobian J is m x n in memory (m = 4096 tasks of a 1M-parameter
# trunk is 16 GiB in float32) and the methods' m x m work grows as m^2 to m^3; a larger count is a
# mistake (a sample count passed as num_tasks), not a problem to allocate for.
MAX_TASKS = 4096

# MGDA's ways of computing w (mgda.py); here, below MGDA, because the hyperparameter checks name them too.
SOLVERS = ("one_step", "min_norm")


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


def _check_optional_positive(name: str, value: Any) -> float | None:
    """None (the option is off) or a number > 0 (MGDA's clip constants)."""
    return None if value is None else check_positive(name, value)


# Every hyperparameter any drmoo optimizer has, and its check.
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
    **{key: _check_optional_positive for key in ("clip_c1", "clip_c2")},
}
# Hyperparameters that are on or off together: one of them None and the other set is refused.
PAIRED = (("clip_c1", "clip_c2"),)


def check_pairs(group: dict[str, Any]) -> None:
    """Each pair of :data:`PAIRED` in ``group`` is both None or both set (MGDA's clip needs both constants)."""
    for first, second in PAIRED:
        if first in group and (group[first] is None) != (group.get(second) is None):
            raise ValueError(f"{first} and {second} clip the step together: give both or neither "
                             f"(got {first}={group[first]!r}, {second}={group.get(second)!r})")
# Keys torch and its LR schedulers keep in parameter groups next to the hyperparameters.
BOOKKEEPING_KEYS = frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr", "base_lr", "base_momentum",
                              "max_momentum"})


def check_hyperparameter(key: str, value: Any) -> Any:
    """The validated (normalized) value of hyperparameter ``key``; raises ValueError naming it."""
    check = HYPERPARAMETER_CHECKS.get(key)
    return value if check is None else check(key, value)


def check_group_hyperparameters(method: str, known: dict[str, Any], param_group: dict[str, Any]) -> dict[str, Any]:
    """``param_group`` with every hyperparameter checked (normalized); a name not in ``known`` is refused."""
    checked = dict(param_group)
    for key, value in param_group.items():
        if key in BOOKKEEPING_KEYS:
            continue
        if key not in known:
            raise ValueError(f"{method} has no hyperparameter {key!r}; its hyperparameters: {', '.join(sorted(known))}")
        checked[key] = check_hyperparameter(key, value)
    check_pairs(checked)
    return checked


def recheck_hyperparameters(groups: list[dict[str, Any]], passed: list[dict[str, Any]], capturable: bool) -> None:
    """Check every group's hyperparameters again, as the constructor did (see
    ``MultiObjectiveOptimizer.check_hyperparameters_now``).

    ``passed`` holds, per group, the values that passed last time (by identity: a value a scheduler or
    user did not replace is not checked again); it is updated in place.  A tensor value (a scheduler may
    write one) is read only when not ``capturable``, and checked every time (it can change in place).
    """
    if len(passed) != len(groups):
        passed[:] = [{} for _ in groups]
    for index, group in enumerate(groups):
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
            if not isinstance(value, Tensor):
                seen[key] = value
        try:
            check_pairs(group)
        except ValueError as error:
            raise ValueError(f"parameter group {index}: {error} (set after construction -- by a param_groups "
                             "write; checked at every step, nothing was updated)") from None
        if "momentum" in group and ("base_momentum" in group or "max_momentum" in group):
            raise ValueError(
                f"parameter group {index}: an LR scheduler cycles 'momentum' (OneCycleLR or CyclicLR with "
                "cycle_momentum=True), but here it is SDMGrad's inner-SGD momentum, not a training momentum; give "
                "the scheduler cycle_momentum=False (nothing was updated)")
    if len(groups) > 1:
        check_groups_agree(groups)


def check_groups_agree(groups: list[dict[str, Any]]) -> None:
    """Every group carries the first group's value of each hyperparameter (tensor values are not compared)."""
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


def check_new_params(groups: Sequence[dict[str, Any]], shared: Sequence[Tensor], params: Any) -> list[Tensor]:
    """A new group's parameters as a list: each once, none already in one of ``groups``, and (those
    that require grad) on the device and in the dtype of ``shared`` (the ones already added) -- they
    share one flat gradient buffer, and a parameter given twice would get twice the update."""
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, (set, frozenset)) or params is None:
        raise TypeError("a parameter group's params must be a Tensor or an ordered sequence of Tensors "
                        f"(not {type(params).__name__}: its order would change between runs)")
    new_params: list[Tensor] = list(params)  # each checked to be a Tensor below
    known = {id(p): index for index, group in enumerate(groups) for p in group["params"]}
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
    together = [p for p in (*shared, *new_params) if p.requires_grad]
    devices = {p.device for p in together}
    dtypes = {p.dtype for p in together}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(
            "all shared parameters must have one device and dtype (they share one flat gradient "
            f"buffer); got devices {sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}"
        )
    return new_params


def check_params_argument(params: Any) -> Any:
    """The shared parameters as given, unless they are a mistake torch would name obscurely: a module itself
    ("'Linear' object is not iterable") or a generator already consumed ("an empty parameter list")."""
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            f"the shared parameters must be tensors, got the module {type(params).__name__} itself: pass its "
            "parameters, e.g. model.trunk.parameters()"
        )
    if isinstance(params, types.GeneratorType) and inspect.getgeneratorstate(params) == inspect.GEN_CLOSED:
        raise ValueError(
            f"the shared parameters are a generator that is already exhausted ({params.__qualname__}(), consumed "
            "by whatever iterated it first, e.g. another optimizer built from the same call): call "
            "model.trunk.parameters() again for each optimizer, or pass a list"
        )
    return params


def check_num_tasks(num_tasks: int) -> int:
    """The number of tasks m: an int in [1, MAX_TASKS]."""
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or not 1 <= num_tasks <= MAX_TASKS:
        raise ValueError(f"num_tasks must be an int in [1, {MAX_TASKS}], got {num_tasks!r}")
    return num_tasks


def shared_device(shared: Sequence[Tensor]) -> torch.device:
    """The device of the shared parameters (one, see :func:`check_new_params`): there must be some, with data."""
    if not shared:
        raise ValueError("the optimizer got no parameters that require grad")
    device = shared[0].device
    if device.type == "meta":
        raise ValueError(
            "the shared parameters are on the meta device (shapes without data, e.g. a model built under "
            "torch.device('meta')): materialize and initialize them first (model.to_empty(device=...) "
            "and the model's initialization), then build the optimizer / balancer"
        )
    return device
