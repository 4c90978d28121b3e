"""A saved optimizer state checked before it is loaded, and owned once it is.

``load_state_dict`` refuses a state saved by another method, for another problem (another number of
tasks or of shared parameters), with invalid hyperparameters, missing entries, w off the simplex or
non-finite dual variables -- before anything is loaded, with a message naming the problem.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._hyperparameters import BOOKKEEPING_KEYS, check_groups_agree, check_hyperparameter, check_pairs

# The key of drmoo's own entries (w, eta, the counters) in ``optimizer.state``, beside torch's per-parameter ones.
STATE_KEY = "drmoo"


def _non_negative(value: Tensor, step: int) -> str:
    return "" if bool((value >= 0).all()) else "must be >= 0 (a second moment)"


def _step_count(value: Tensor, step: int) -> str:
    whole = bool((value == value.round()).all())
    return "" if whole and bool(((value >= 0) & (value <= step)).all()) else \
        f"must be a whole number from 0 to the optimizer's step count {step}"


def _positive(value: Tensor, step: int) -> str:
    return "" if bool((value > 0).all()) else "must be > 0 (its logarithm is taken)"


def _flag(value: Tensor, step: int) -> str:
    return "" if bool(((value == 0) | (value == 1)).all()) else "must be 0 or 1"


# What the values of a method's own state entries (``state["drmoo"]``, beyond their shape and
# finiteness) must satisfy to have been written by the method: a forged state that breaks one would
# resume into NaN (a negative second moment's square root, the log of a negative distance) or a wrong
# bias correction.  Each check returns "" or how the value is wrong; the entries are FAMO's Adam on its
# task logits and its pending logit update.
ENTRY_CHECKS = {"adam_exp_avg_sq": _non_negative, "adam_steps": _step_count, "pending_distance": _positive,
                "pending": _flag}


def initial_state(num_tasks: int, *, method: str, device: torch.device,
                  parameters_dtype: torch.dtype) -> dict[str, Any]:
    """A new optimizer's ``state["drmoo"]``: w uniform, eta zero, no step taken, none skipped.

    w and eta in float32 (float64 when the parameters are float64): they are tiny, and the dual
    variables need the precision whatever the model's dtype.
    """
    dtype = torch.float64 if parameters_dtype == torch.float64 else torch.float32
    return {
        "w": torch.full((num_tasks,), 1.0 / num_tasks, device=device, dtype=dtype),
        "eta": torch.zeros(num_tasks, device=device, dtype=dtype),
        "step": 0,
        "method": method,  # load_state_dict refuses another method's state
        # steps skipped on the device by capturable=True (a NaN/Inf met; nothing written)
        "skipped_steps": torch.zeros((), dtype=torch.int64, device=device),
    }


def validate_state_dict(state_dict: Any, *, method: str, hyperparameters: set[str], entries: dict[str, Any],
                        problem: str) -> None:
    """Raise ValueError naming the problem unless ``state_dict`` is ``method``'s, for this problem.

    Args:
        state_dict: what was handed to ``load_state_dict``.
        method: the loading optimizer's class name.
        hyperparameters: the names of its hyperparameters (``capturable`` left out).
        entries: the entries ``state["drmoo"]`` must have, with the loading optimizer's current values
            (a saved tensor must have the current one's shape, a saved int be an int >= 0).
        problem: how a shape mismatch's message names the loading optimizer's problem (m, n).
    """
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
        state_dict.get("param_groups"), list
    ):
        raise ValueError("not an optimizer state_dict (expected a dict with 'state' and 'param_groups')")
    saved = state_dict["state"].get(STATE_KEY)
    if not isinstance(saved, dict):
        raise ValueError(f"state_dict has no {STATE_KEY!r} entry: it was not saved by a drmoo optimizer")
    saved_by = saved.get("method", method)
    if saved_by != method:
        raise ValueError(f"state_dict was saved by {saved_by}, not by {method}: it cannot continue this run")
    _check_groups(state_dict["param_groups"], method, hyperparameters)
    for key, current in entries.items():
        if key not in saved:
            raise ValueError(f"state_dict has no {key!r} entry: it was not saved by {method} (or is damaged)")
        value = saved[key]
        if isinstance(current, Tensor):
            if not isinstance(value, Tensor):
                raise ValueError(f"state_dict's {key} must be a tensor, got {type(value).__name__}")
            if value.is_meta:  # its checks below would fail reading values it does not have
                raise ValueError(f"state_dict's {key} is on the meta device: it holds no values (a state built "
                                 "without data); load one saved from an optimizer that stepped or was constructed")
            if tuple(value.shape) != tuple(current.shape):
                raise ValueError(f"state_dict's {key} has shape {tuple(value.shape)}, but this {method} ({problem}) "
                                 f"expects {tuple(current.shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"state_dict's {key} has NaN or Inf entries")
        elif isinstance(current, int) and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"state_dict's {key} must be an int >= 0, got {value!r}")
    w = saved["w"].double()
    if bool((w < 0).any()) or abs(float(w.sum()) - 1.0) > 1e-6:
        raise ValueError(f"state_dict's w is not on the probability simplex: {w.tolist()}")
    step = saved["step"] if isinstance(saved.get("step"), int) else 0
    for key, check in ENTRY_CHECKS.items():
        if key in entries and isinstance(saved[key], Tensor) and (problem := check(saved[key].double(), step)):
            raise ValueError(f"state_dict's {key} {problem}")
    _check_skipped_steps(saved.get("skipped_steps"), step)


def _check_skipped_steps(skipped: Any, step: int) -> None:
    """``state["drmoo"]["skipped_steps"]`` (absent in states saved before it existed): a 0-d integer
    tensor counting steps among the ``step`` taken, so from 0 to ``step``."""
    if skipped is None:
        return
    if (not isinstance(skipped, Tensor) or skipped.numel() != 1 or skipped.is_floating_point()
            or skipped.is_complex() or skipped.dtype == torch.bool or skipped.is_meta):
        raise ValueError(f"state_dict's skipped_steps must be a 0-d integer tensor, got {_described(skipped)}")
    if not 0 <= int(skipped) <= step:
        raise ValueError(f"state_dict's skipped_steps is {int(skipped)}, but it counts steps among the {step} taken "
                         f"(from 0 to {step})")


def _described(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _check_groups(groups: Any, method: str, hyperparameters: set[str]) -> None:
    """The saved parameter groups carry exactly ``method``'s hyperparameters, valid and in agreement."""
    if not groups or not all(isinstance(group, dict) for group in groups):
        raise ValueError("state_dict's param_groups must be a non-empty list of dicts")
    for group in groups:
        # capturable is this process's (load_state_dict keeps the constructed one), but a saved value
        # that is no flag is not a state any optimizer wrote
        if "capturable" in group and not isinstance(group["capturable"], bool):
            raise ValueError(f"state_dict's capturable must be True or False, got {group['capturable']!r}")
        keys = set(group) - BOOKKEEPING_KEYS - {"capturable"}
        if keys != hyperparameters:
            missing, unexpected = sorted(hyperparameters - keys), sorted(keys - hyperparameters)
            raise ValueError(
                f"state_dict's hyperparameters are not {method}'s (missing: {missing or 'none'}; not {method}'s: "
                f"{unexpected or 'none'}): it was saved by another method"
            )
        for key in keys:
            try:
                check_hyperparameter(key, group[key])
            except (TypeError, ValueError) as error:
                raise ValueError(f"state_dict has an invalid hyperparameter: {error}") from None
        try:
            check_pairs(group)
        except ValueError as error:
            raise ValueError(f"state_dict has invalid hyperparameters: {error}") from None
    check_groups_agree(groups)


def owned_state(loaded: dict[str, Any], *, method: str, device: torch.device,
                dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """The loaded ``state["drmoo"]`` as this optimizer's own: torch copies non-parameter state by reference
    and moves none of it, so every tensor is copied onto ``device`` in the loading optimizer's dtype
    (``dtypes``; a host-side RNG state stays on the CPU), and ``method`` names the loader."""
    owned = {
        key: value.detach().to(device="cpu" if key == "rng_state" else device,
                               dtype=dtypes.get(key, value.dtype), copy=True)
        if isinstance(value, Tensor) else value
        for key, value in loaded.items()
    }
    owned["method"] = method
    return owned
