"""What a user meets first (issue 21, item 7): the paper's main setting as the default, one preset
API for every method, and each class saying how its learning rate scales."""

from __future__ import annotations

import inspect

import pytest
import torch

from drmoo.experiments.multimnist import method_hparams
from drmoo.optim import available, create


@pytest.mark.parametrize("method", list(available()))
def test_defaults_are_the_main_experiments_lambda(method: str) -> None:
    optimizer = create(method, [torch.nn.Parameter(torch.zeros(3))], num_tasks=2)
    assert optimizer.param_groups[0]["lam"] == 0.8  # App. F.1: "In our main experiments, we set lambda = 0.8"


@pytest.mark.parametrize("method", list(available()))
def test_every_method_has_the_same_preset_access(method: str) -> None:
    cls = available()[method]
    preset = cls.preset("multimnist")
    hparams = method_hparams(method)
    assert {key: hparams.get(key) for key in preset} == preset  # what drmoo's own trainer runs
    create(method, [torch.nn.Parameter(torch.zeros(3))], num_tasks=2, **preset)  # valid arguments
    with pytest.raises(ValueError, match=f"{cls.__name__} has no preset 'nope'; known presets: multimnist"):
        cls.preset("nope")
    assert cls.preset("multimnist") is not cls.PRESETS["multimnist"]  # a copy: editing it changes nothing


@pytest.mark.parametrize("method", list(available()))
def test_every_class_says_how_its_learning_rate_scales(method: str) -> None:
    text = " ".join(inspect.getdoc(available()[method]).split())
    assert "Learning-rate scale." in text
    assert "clipped" in text  # each says whether its step is clipped/normalised like Double-Clip's
