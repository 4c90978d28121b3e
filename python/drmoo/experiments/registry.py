"""The deep experiments that ``drmoo train / eval / compare`` run, by ``--experiment`` name.

The dependency runs one way.  An experiment's module builds its :class:`Experiment` record and calls
:func:`register` when it is imported; the command line looks experiments up with
:func:`get_experiment`.  This module imports no experiment module at load time (and the trainer,
``drmoo.experiments.training``, imports neither this module nor any experiment), so there is no
import cycle: the built-in experiment modules are imported *by name* on the first lookup, which is
what makes them register.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only
    from torch import Tensor

    from .run_config import RunConfig
    from .training import Build

__all__ = ["BUILTIN_MODULES", "Experiment", "experiments", "get_experiment", "register"]

# The modules that register the experiments drmoo ships: Multi-MNIST's two (built by multimnist.py,
# evaluated under FGSM and compared by robustness.py), CelebA's and MNIST attributes' (Table 2 on real digits).
BUILTIN_MODULES = ("drmoo.experiments.robustness", "drmoo.experiments.celeba", "drmoo.experiments.mnist_attributes")

_REGISTRY: dict[str, Experiment] = {}


class MethodHparams(Protocol):
    """``method_hparams(method, overrides, preset=...)``: the hyperparameters a run of ``method`` gets
    (the paper's, then the choices of the run's ``preset`` where it has any, then ``overrides``)."""

    def __call__(self, method: str, overrides: dict[str, Any] | None = None, preset: str | None = None
                 ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Experiment:
    """What ``drmoo train / eval / compare`` need to know about one deep experiment.

    ``evaluate(run_dir, eps=..., progress=..., device=..., noise_sigmas=...)`` writes and returns eval.json's
    report (``noise_sigmas``: the pixel-noise grid of the robustness block, ``drmoo eval --noise``),
    ``eval_table(report)`` prints it, ``compare(configs, out, eps=..., progress=...)`` trains and
    evaluates every config and returns the markdown table.  ``eps`` matters to FGSM experiments only.
    ``check_data(config)`` raises (FileNotFoundError / ValueError, one line) when the config's data
    cannot be found: the command line calls it before anything is written or torchrun is launched.
    ``check_model(config)`` raises likewise for model settings ``build`` would refuse (``compare`` calls it
    for every row before its --out is created).
    """

    name: str
    build: Build
    presets: dict[str, dict[str, Any]]  # preset name -> RunConfig fields
    method_hparams: MethodHparams
    evaluate: Callable[..., dict[str, Any]]
    eval_table: Callable[[dict[str, Any]], str]
    compare: Callable[..., str]
    sample_weight: Callable[[Tensor], Tensor] | None = None  # labels [B, m] -> importance weights [B, m]
    check_data: Callable[[RunConfig], None] | None = None
    check_model: Callable[[RunConfig], None] | None = None


def register(experiment: Experiment) -> Experiment:
    """Make ``experiment`` known by its name; a second, different experiment of the same name is refused."""
    known = _REGISTRY.get(experiment.name)
    if known is not None and known is not experiment:
        raise ValueError(f"an experiment named {experiment.name!r} is already registered")
    _REGISTRY[experiment.name] = experiment
    return experiment


def _load_builtin() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)  # registers its experiments (a no-op once imported)


def experiments() -> dict[str, Experiment]:
    """Every registered experiment, by ``--experiment`` name (the built-in ones included)."""
    _load_builtin()
    return dict(_REGISTRY)


def get_experiment(name: str) -> Experiment:
    """The experiment registered as ``name``; a clear error naming the valid choices otherwise."""
    known = experiments()
    if name not in known:
        raise ValueError(f"unknown experiment {name!r}; valid choices: {', '.join(known)}")
    return known[name]
