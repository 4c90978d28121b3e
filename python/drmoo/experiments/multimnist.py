"""Multi-MNIST experiments (paper §5.1, App. D): presets and how to build model and data."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from drmoo.data import MultiMnist, MultiMnistRecipe, load_multimnist
from drmoo.models import MultiTaskResNet, resolve_weights
from drmoo.optim import available

from .training import RunConfig

__all__ = ["EXPERIMENTS", "PRESETS", "build_multimnist", "method_hparams"]

EXPERIMENTS = {"multimnist2": 2, "multimnist3": 3}

# paper: App. D Table 3 (70 / 100 epochs, B = 256, 128 / 96 px, ImageNet ResNet18, full MNIST on a GPU).
# quick: the README demo on a 2-core CPU - 32 px inputs, 2,000 training composites from the
# embedded 5,000-digit subset, 500 test composites, one epoch (32 iterations), batch 64, no
# pretrained weights: about 4 minutes for all eight methods.  It shows the pipeline, not the
# paper's accuracies (those need the paper preset: ImageNet weights, full MNIST, a GPU).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {
        "multimnist2": {"epochs": 70, "batch_size": 256, "input_size": 128, "weights": "imagenet",
                        "train_size": None, "test_size": None},
        "multimnist3": {"epochs": 100, "batch_size": 256, "input_size": 96, "weights": "imagenet",
                        "train_size": None, "test_size": None},
    },
    "quick": {
        "multimnist2": {"epochs": 1, "batch_size": 64, "input_size": 32, "weights": "none",
                        "train_size": 2000, "test_size": 500},
        "multimnist3": {"epochs": 1, "batch_size": 64, "input_size": 32, "weights": "none",
                        "train_size": 2000, "test_size": 500},
    },
}

# Paper Table 4 (Multi-MNIST).  The optimizers' defaults are these values; the common ones
# (lambda = 0.6, rho = 1e-5) are set here for every method.
COMMON = {"lam": 0.6, "rho": 1e-5}
PAPER_METHOD_HPARAMS: dict[str, dict[str, Any]] = {
    "double-loop": {"lr": 5e-4, "dual_lr": 3e-3, "pref_lr": 1e-5, "inner_steps": 5},
    "double-clip": {"lr": 5e-3, "pref_lr": 1e-2, "c1": 1.0, "c2": 0.5, "f1": 1.0, "f2": 0.5},
}


def method_hparams(method: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The paper's Multi-MNIST hyperparameters of ``method`` (class defaults for the baselines) + overrides.

    The common settings apply only where the method has them (NashMTL has no rho, for instance).
    """
    if method not in available():
        raise ValueError(f"unknown method {method!r}; valid choices: {', '.join(available())}")
    accepted = inspect.signature(available()[method].__init__).parameters
    common = {key: value for key, value in COMMON.items() if key in accepted}
    return {**common, **PAPER_METHOD_HPARAMS.get(method, {}), **(overrides or {})}


def build_multimnist(config: RunConfig) -> tuple[nn.Module, MultiMnist]:
    """The ResNet18 multi-task model and the generated data of a run."""
    if config.experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {config.experiment!r}; valid choices: {', '.join(EXPERIMENTS)}")
    recipe = MultiMnistRecipe(
        digits=EXPERIMENTS[config.experiment], input_size=config.input_size, seed=config.seed,
        train_size=config.train_size, test_size=config.test_size,
    )
    data = load_multimnist(recipe, data_root=config.data_root, cache_dir=config.cache_dir)
    model = MultiTaskResNet([10] * recipe.digits, weights=resolve_weights(config.weights))
    return model, data
