"""Features mode's guard on the trunk's gradients (the lift of the method's direction through the trunk).

In features mode the rows, their Gram, the losses and z are all guarded before the lift; the trunk's own
backward can still make a NaN or Inf from finite inputs -- a bad parameter whose forward value is masked
(0 * NaN in the backward), an overflow -- and it must stop the step before theta or ``.grad`` is written.
The guard reads one value per gradient in one op, accumulated in float32 at least (a half-precision gradient's
norm overflows fp16 long before its entries do, and a finite step must not be refused for it): on the CPU with the
``cpp`` backend each gradient's sum of squares (the compiled ``sum_squares``), elsewhere its L2 norm
(``torch._foreach_norm``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import NonFiniteStepError, _features, create

NUM_TASKS, BATCH, D_IN, D_Z = 2, 16, 6, 4
APIS = ("balancer", "step")


class MaskedTrunk(nn.Module):
    """h = tanh(x W1^T); z = where(h > 5, h * bad, h W2^T): tanh never exceeds 1, so ``bad`` never reaches z,
    but its backward multiplies the zero cotangent of the masked branch by ``bad`` (0 * NaN = NaN into h's
    gradient, hence W1's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(D_IN, D_Z, bias=False)
        self.second = nn.Linear(D_Z, D_Z, bias=False)
        self.bad = nn.Parameter(torch.ones(D_Z))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.first(x))
        return torch.where(h > 5.0, h * self.bad, self.second(h))


def balancer_step(trunk: nn.Module, heads: Tensor, x: Tensor, y: Tensor, **hparams: Any) -> Any:
    balancer = drmoo.Balancer("mgda", trunk.parameters(), NUM_TASKS, jacobian="features", **hparams)
    z = trunk(x)
    balancer.backward((z @ heads - y) ** 2, features=z)
    return balancer.algorithm


def closure_step(trunk: nn.Module, heads: Tensor, x: Tensor, y: Tensor, **hparams: Any) -> Any:
    optimizer = create("mgda", trunk.parameters(), NUM_TASKS, jacobian="features", **hparams)
    cached: list[tuple[Tensor, Tensor]] = []

    def closure() -> tuple[Tensor, Tensor]:
        if not cached:
            z = trunk(x)
            cached.append(((z @ heads - y) ** 2, z))
        return cached[0]

    optimizer.step(closure)
    return optimizer


STEPS = {"balancer": balancer_step, "step": closure_step}


@pytest.mark.parametrize("api", APIS)
def test_a_nan_made_inside_the_trunks_backward_stops_the_step_and_changes_nothing(api: str) -> None:
    trunk = MaskedTrunk()
    with torch.no_grad():
        trunk.bad.fill_(float("nan"))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, D_IN, generator=generator), torch.randn(BATCH, NUM_TASKS, generator=generator)
    heads = torch.randn(D_Z, NUM_TASKS, generator=generator)
    z = trunk(x)
    assert torch.isfinite(z).all(), "the case this test is about: z and the losses are finite"
    plain = torch.autograd.grad(z, trunk.first.weight, torch.ones_like(z))[0]
    assert torch.isnan(plain).all(), "the case this test is about: the trunk's backward makes the NaN"
    before = [p.detach().clone() for p in trunk.parameters()]
    with pytest.raises(NonFiniteStepError, match="non-finite gradient of the shared parameters from the backward "
                                                 "pass through the trunk"):
        STEPS[api](trunk, heads, x, y, lr=0.1)
    assert all(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)  # (bad is NaN: equal as NaN)
               for a, b in zip(trunk.parameters(), before)), "theta moved"
    assert all(p.grad is None for p in trunk.parameters()), ".grad written"


@pytest.mark.parametrize("api", APIS)
def test_a_finite_half_precision_trunk_gradient_whose_norm_overflows_fp16_passes(api: str) -> None:
    """A float16 trunk: its gradient's entries reach a few thousand (finite), its L2 norm ~1e6, above 65504 (fp16's
    largest): the old guard, a norm in the gradient's own dtype, refused the step as non-finite."""
    torch.manual_seed(0)
    trunk = nn.Linear(4096, 256, bias=False).half()
    with torch.no_grad():
        trunk.weight.copy_(0.0003 * torch.randn(256, 4096))
    heads = (0.1 * torch.randn(256, NUM_TASKS)).half()
    x = torch.full((BATCH, 4096), 256.0, dtype=torch.float16)
    before = trunk.weight.detach().clone()
    optimizer = STEPS[api](trunk, heads, x, torch.zeros(BATCH, NUM_TASKS, dtype=torch.float16), lr=1e-6)
    assert optimizer.steps_taken == 1
    if api == "balancer":
        grad = trunk.weight.grad
        assert grad is not None and torch.isfinite(grad).all()
        assert torch.isinf(grad.norm()), "the case this test is about: the gradient's norm in fp16 overflows"
    else:
        assert not torch.equal(trunk.weight, before) and torch.isfinite(trunk.weight).all()


@pytest.mark.parametrize("api", APIS)
def test_on_the_cpu_the_guard_is_one_compiled_op_in_place_of_one_foreach_norm(
        api: str, monkeypatch: pytest.MonkeyPatch, load_bench: Any) -> None:
    """With the ``cpp`` backend the trunk's gradients are guarded by ONE ``drmoo::sum_squares`` call, in place of the
    one ``aten::_foreach_norm`` of every other backend: the step dispatches as many non-view ops either way (the
    op counts of bench/launches.py)."""
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(BATCH, D_IN, generator=generator), torch.randn(BATCH, NUM_TASKS, generator=generator)
    heads = torch.randn(D_Z, NUM_TASKS, generator=generator)
    counted = {}
    for guard in ("sum_squares", "foreach_norm"):
        if guard == "foreach_norm":  # the same step as another backend guards it
            monkeypatch.setattr(_features, "cpp_backend", None)
        with load_bench("op_count").OpCounter() as counter:  # the counter behind the op tables
            STEPS[api](MaskedTrunk(), heads, x, y, lr=0.1, backend="cpp")
        counted[guard] = counter.ops
    fused, foreach = counted["sum_squares"], counted["foreach_norm"]
    assert fused["sum_squares"] == 1 and foreach["sum_squares"] == 0
    assert fused["_foreach_norm"] == foreach["_foreach_norm"] - 1
    assert sum(fused.values()) == sum(foreach.values())
