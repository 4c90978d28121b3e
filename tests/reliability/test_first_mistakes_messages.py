"""What a new user's first mistakes with the Balancer say: the cause and the fix, not torch's internals.

* a module instead of its parameters (torch: "'Linear' object is not iterable");
* a parameter generator another optimizer already consumed (torch: "optimizer got an empty parameter list");
* another method's hyperparameter (Python: "MGDA.__init__() got an unexpected keyword argument 'c1'");
* ``scaler.scale(losses)`` handed to ``backward`` (the scaled values would set the DR weights).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import drmoo
from drmoo.optim import create


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.heads = nn.Linear(5, 2)


def test_a_module_instead_of_its_parameters_names_the_fix() -> None:
    model = Model()
    with pytest.raises(TypeError, match=r"got the module Sequential itself: pass its parameters, e\.g\. "
                                        r"model\.trunk\.parameters\(\)"):
        drmoo.Balancer("mgda", model.trunk, 2, lr=0.1)  # type: ignore[arg-type]


def test_an_exhausted_parameter_generator_is_named() -> None:
    model = Model()
    shared = model.trunk.parameters()
    torch.optim.SGD(shared, lr=0.1)  # consumes the generator
    with pytest.raises(ValueError, match=r"generator that is already exhausted \(Module\.parameters\(\).*call "
                                         r"model\.trunk\.parameters\(\) again"):
        drmoo.Balancer("mgda", shared, 2, lr=0.1)
    drmoo.Balancer("mgda", model.trunk.parameters(), 2, lr=0.1)  # a fresh generator is fine


def test_another_methods_hyperparameter_lists_the_methods_own() -> None:
    model = Model()
    with pytest.raises(TypeError, match=r"mgda has no hyperparameter 'c1'; valid: .*clip_c1, .*lam, lr, .*"
                                        r"\('c1' is a hyperparameter of double-clip\)"):
        drmoo.Balancer("mgda", model.trunk.parameters(), 2, c1=1.0)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"famo has no hyperparameter 'lamda'; valid: .*lam, .*lr"):
        create("famo", model.trunk.parameters(), 2, lamda=0.5)


def test_scaled_losses_are_refused_with_the_scaler_keyword_named() -> None:
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), 2, lr=0.1)
    losses = (model.heads(model.trunk(x)) - y) ** 2
    eta = balancer.eta.clone()
    with pytest.raises(ValueError, match=r"takes the unscaled losses and the scaler itself: pass "
                                         r"backward\(losses, scaler=scaler\), not scaler\.scale\(losses\)"):
        balancer.backward(scaler.scale(losses), scaler=scaler)
    assert torch.equal(balancer.eta, eta) and model.trunk[0].weight.grad is None  # nothing ran
    balancer.backward(losses * 2.0, scaler=scaler)  # a product by another number is the user's loss: taken
