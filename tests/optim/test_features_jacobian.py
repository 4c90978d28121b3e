"""``jacobian="features"`` (per-task gradients w.r.t. the representation z): every method, both APIs.

What is guarded:

* every method but MoCo runs in features mode through ``drmoo.Balancer(...).backward(losses, features=z)``
  and ``optimizer.step(closure)`` with a closure returning ``(losses, z)``; MoCo refuses at construction;
* equivalence: a method whose weights stay fixed (``pref_lr=0``; FAMO's come from loss values only)
  writes the same trunk ``.grad`` in both modes, to float32 rounding, with the tolerance derived below;
* the two APIs agree in features mode (SGD(lr) after ``backward`` = ``step``);
* the multi-batch forms of MoDo / SDMGrad / Double-Loop are refused in features mode (their products of
  two batches' Jacobians have no meaning in z's per-sample coordinates);
* bad input -- z the losses do not depend on (another batch's), z that needs no grad, a head that reads
  the trunk's parameters directly, missing or misplaced ``features`` -- raises a clear error and
  changes nothing (no ``.grad``, eta, w or step count);
* GradScaler (scaled ``.grad``, an overflow handed to the scaler), capturable steps, ``state_dict``
  round trips and ``copy.deepcopy``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import available, create
from drmoo.optim._features import OneBatchPerStep
from drmoo_kernels import reference

NUM_TASKS = 3
BATCH = 16
D_IN = 12
D_Z = 8
FEATURE_METHODS = sorted(name for name in available() if name != "moco")
# The methods whose preference weights stay fixed with these settings (pref_lr = 0; Double-Clip's clip
# not binding; FAMO's weights come from the loss values only), hence the same direction in both modes.
FIXED_WEIGHTS: dict[str, dict[str, Any]] = {
    "mgda": {"pref_lr": 0.0},
    "double-clip": {"pref_lr": 0.0, "c1": 1.0, "c2": 1e6},
    "modo": {"pref_lr": 0.0},
    "sdmgrad": {"pref_lr": 0.0},
    "double-loop": {"pref_lr": 0.0, "seed": 0},
    "famo": {},
}
# Methods whose multi-batch form multiplies two independent batches' Jacobians.
MULTI_BATCH = ("modo", "sdmgrad", "double-loop")
UNIT_ROUNDOFF = 2.0**-24  # float32


class Net(nn.Module):
    """A linear trunk z = x W^T + b (the error analysis of the equivalence test is exact for it) and one
    linear head per task, with per-sample squared errors [B, m]."""

    def __init__(self, seed: int = 0, tanh: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(D_IN, D_Z), nn.Tanh()) if tanh else nn.Linear(D_IN, D_Z)
        self.heads = nn.ModuleList(nn.Linear(D_Z, 1) for _ in range(NUM_TASKS))

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        z = self.trunk(x)
        return (torch.cat([head(z) for head in self.heads], dim=1) - y) ** 2, z


def batches(count: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, D_IN, generator=generator), torch.randn(BATCH, NUM_TASKS, generator=generator))
            for _ in range(count)]


def same_batch(net: Net, x: Tensor, y: Tensor) -> Callable[[], tuple[Tensor, Tensor]]:
    """A closure that returns one batch's (losses, z) at every call with a graph (the one-batch use of the
    multi-batch methods); a call without grad (Double-Clip's first draw, Double-Loop's inner steps)
    recomputes it."""
    cached: dict[str, tuple[Tensor, Tensor]] = {}

    def closure() -> tuple[Tensor, Tensor]:
        if not torch.is_grad_enabled():
            return net.losses(x, y)
        if "batch" not in cached:
            cached["batch"] = net.losses(x, y)
        return cached["batch"]

    return closure


def grads(module: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


# --------------------------------------------------------------------------------- every method
@pytest.mark.parametrize("method", FEATURE_METHODS)
def test_every_method_runs_in_features_mode_through_both_apis(method: str) -> None:
    """Three balancer steps and three ``step(closure)`` steps in features mode: finite and moving."""
    seed_kw = {"seed": 0} if method == "double-loop" else {}
    net = Net()
    balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", lr=0.05, **seed_kw)
    sgd = torch.optim.SGD(net.parameters(), lr=0.05)
    before = [p.detach().clone() for p in net.trunk.parameters()]
    for x, y in batches(3):
        sgd.zero_grad()
        losses, z = net.losses(x, y)
        objectives = balancer.backward(losses, features=z)
        assert objectives.shape == (NUM_TASKS,) and bool(torch.isfinite(objectives).all())
        assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in net.parameters())
        sgd.step()
    assert balancer.steps_taken == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, net.trunk.parameters()))

    net = Net()
    optimizer = create(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", lr=0.05, **seed_kw)
    assert optimizer.features_engine is not None
    data = batches(3)
    before = [p.detach().clone() for p in net.trunk.parameters()]
    for x, y in data:
        # one batch per step (the multi-batch methods refuse independent batches, tested below)
        optimizer.step(same_batch(net, x, y))
    assert optimizer.steps_taken == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, net.trunk.parameters()))


def test_moco_refuses_features_with_its_reason() -> None:
    """MoCo's tracked Jacobian averages rows across batches: no feature-space form; refused, not ignored."""
    net = Net()
    with pytest.raises(ValueError, match="MoCo cannot use jacobian='features': its tracked Jacobian"):
        drmoo.Balancer("moco", net.trunk.parameters(), NUM_TASKS, jacobian="features")
    with pytest.raises(ValueError, match="jacobian must be one of parameters, features"):
        drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS, jacobian="feature")


# ---------------------------------------------------------------------------------- equivalence
def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of a length-k float32 dot product."""
    return k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)


def task_feature_gradients(net: Net, x: Tensor, y: Tensor, eta: Tensor) -> Tensor:
    """G [m, B, d]: G_i = d (sum_b v_bi / B * l_bi) / dz at the given eta (chi2, lam 0.8)."""
    losses, z = net.losses(x, y)
    _, _, cotangent = reference.dual_forward(losses.detach(), eta, 0.8, 1.0, "chi2")
    return torch.stack([torch.autograd.grad(losses, z, grad_outputs=cotangent * (torch.arange(NUM_TASKS) == i),
                                            retain_graph=True)[0] for i in range(NUM_TASKS)])


@pytest.mark.parametrize("method", sorted(FIXED_WEIGHTS))
def test_fixed_weights_give_the_same_trunk_grad_in_both_modes(method: str) -> None:
    """Error bound.  With the linear trunk z = X W^T + b the exact direction is D = sum_i c_i G_i^T [X, 1]
    (G_i = dL^i/dz, [B, d]; c the step weights).  Parameters mode rounds each G_i^T X (a length-B dot
    product per entry: error <= gamma_B |G_i|^T |X|) and then the length-m sum over tasks (<= gamma_m
    times the sum of |c_i G_i^T X|); features mode rounds sum_i c_i G_i first (gamma_m) and then one
    product with X (gamma_B).  Both are within (gamma_B + gamma_m + gamma_B gamma_m) S of D, with
    S = (sum_i c_i |G_i|)^T |X| entrywise, so they differ by at most twice that.  (G_i, the dual
    weights and c are computed by the same operations in both modes.)  A wrong direction -- another
    weighting, a lost task, the wrong batch -- is off by O(|D|) = O(S), ~10^5 times the tolerance."""
    kw = FIXED_WEIGHTS[method]
    x, y = batches(1)[0]
    written = {}
    for mode in ("parameters", "features"):
        net = Net()
        balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian=mode, **kw)
        losses, z = net.losses(x, y)
        balancer.backward(losses, features=z) if mode == "features" else balancer.backward(losses)
        written[mode] = (grads(net.trunk), grads(net.heads), balancer.stats["w"].clone(), balancer.eta.clone())
    torch.testing.assert_close(written["features"][3], written["parameters"][3], rtol=0, atol=0)  # eta: exact
    net = Net()
    eta = torch.zeros(NUM_TASKS)
    if method == "double-clip":  # its gradient is taken at eta_{t+1}; eta_t = 0 here
        eta = written["features"][3]
    weights = balancer.stats["step_weights"].float() if "step_weights" in balancer.stats else balancer.w.float()
    if method == "double-clip":
        weights = balancer.stats["alpha"].float() * torch.full((NUM_TASKS,), 1.0 / NUM_TASKS)
    if method == "double-loop":  # its gradient is taken at a drawn inner iterate eta_d: magnitudes from eta_D
        eta = written["features"][3]
    G = task_feature_gradients(net, x, y, eta).abs()
    S_weight = torch.einsum("i,ibd,bk->dk", weights.abs(), G, x.abs())
    S_bias = torch.einsum("i,ibd->d", weights.abs(), G)
    bound = 2 * (gamma(BATCH) + gamma(NUM_TASKS) + gamma(BATCH) * gamma(NUM_TASKS))
    slack = 2.0  # G here is recomputed in float32 (and for Double-Loop at another inner eta): magnitudes only
    for name, a, b, S in zip(("weight", "bias"), written["parameters"][0], written["features"][0],
                             (S_weight, S_bias)):
        assert a is not None and b is not None
        excess = ((a - b).abs() - slack * bound * S).max()
        assert float(excess) <= 0.0, f"{method}: trunk {name} .grad differs beyond the float32 bound by {excess}"
        assert float((a - b).abs().max()) < 1e-3 * float(a.abs().max())
    # the heads keep their own DR gradient, computed by the same passes above z in both modes
    for a, b in zip(written["parameters"][1], written["features"][1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("method", ["mgda", "double-clip", "nashmtl", "famo", "sdmgrad"])
def test_balancer_with_sgd_follows_step_in_features_mode(method: str) -> None:
    """SGD(lr) after ``backward(losses, features=z)`` takes the step ``step(closure)`` takes (to rounding)."""
    kw: dict[str, Any] = {"lr": 0.05}
    if method == "double-clip":
        kw["resample"] = False
    data = batches(3)
    nets = {}
    for api in ("balancer", "step"):
        net = Net(tanh=True)
        if api == "balancer":
            balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", **kw)
            sgd = torch.optim.SGD(net.trunk.parameters(), lr=kw["lr"])
            for x, y in data:
                sgd.zero_grad()
                losses, z = net.losses(x, y)
                balancer.backward(losses, features=z)
                sgd.step()
        else:
            optimizer = create(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", **kw)
            for x, y in data:
                optimizer.step(same_batch(net, x, y))
        nets[api] = net
    for a, b in zip(nets["balancer"].trunk.parameters(), nets["step"].trunk.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- refusals, input
@pytest.mark.parametrize("method", MULTI_BATCH)
def test_multi_batch_forms_are_refused_in_features_mode(method: str) -> None:
    """Products of two independent batches' features Jacobians estimate nothing: the second fresh batch
    is refused with the reason, and nothing changes."""
    seed_kw = {"seed": 0} if method == "double-loop" else {}
    net = Net()
    optimizer = create(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", **seed_kw)
    draws = iter(batches(20))
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="several independent batches in one step"):
        optimizer.step(lambda: net.losses(*next(draws)))
    assert optimizer.steps_taken == 0 and all(p.grad is None for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert optimizer.features_engine is not None and optimizer.features_engine.features is None  # forgotten


@pytest.mark.parametrize("method", MULTI_BATCH)
def test_one_batch_per_step_makes_the_multi_batch_methods_run_their_single_batch_form(method: str) -> None:
    """The closure rule drmoo train and GraphedStep share: wrapped in OneBatchPerStep, the closure that
    was refused above steps, drawing one fresh batch with a graph per step."""
    seed_kw = {"seed": 0} if method == "double-loop" else {}
    net = Net()
    optimizer = create(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", **seed_kw)
    draws = iter(batches(40))
    fresh_with_graph = [0]

    def draw(same_batch: bool) -> Any:
        fresh_with_graph[0] += torch.is_grad_enabled() and not same_batch
        return net.losses(*next(draws))

    closure = OneBatchPerStep(draw, lambda: optimizer.features_engine is not None)
    before = [p.detach().clone() for p in net.trunk.parameters()]
    for step in range(1, 3):
        optimizer.step(closure)
        closure.end_step()
        assert fresh_with_graph[0] == step
    assert optimizer.steps_taken == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, net.trunk.parameters()))


def test_one_batch_per_step_passes_through_what_the_rule_does_not_cover() -> None:
    """Per call kind: a draw with a graph after the step's first returns that first object; a draw
    without a graph, a same_batch call, any draw in parameters mode and the first draw after end_step
    reach ``draw``."""
    calls: list[bool] = []
    features_mode = [True]

    def draw(same_batch: bool) -> object:
        calls.append(same_batch)
        return object()

    closure = OneBatchPerStep(draw, lambda: features_mode[0])
    first = closure()
    assert closure() is first and closure(same_batch=False) is first and calls == [False]
    assert closure(same_batch=True) is not first and calls == [False, True]
    with torch.no_grad():
        assert closure() is not first and calls == [False, True, False]
    closure.end_step()
    second = closure()
    assert second is not first and closure() is second and len(calls) == 4
    closure.end_step()
    features_mode[0] = False  # parameters mode: nothing is kept, every draw is fresh
    assert closure() is not closure() and len(calls) == 6


def _bad_inputs() -> dict[str, Callable[[Net], tuple[Tensor, Any]]]:
    x, y = batches(2)[0]
    x2, _ = batches(2)[1]

    def other_batch(net: Net) -> tuple[Tensor, Any]:
        losses, _ = net.losses(x, y)
        return losses, net.trunk(x2)

    def no_grad(net: Net) -> tuple[Tensor, Any]:
        losses, z = net.losses(x, y)
        return losses, z.detach()

    def head_reads_trunk(net: Net) -> tuple[Tensor, Any]:
        losses, z = net.losses(x, y)
        return losses + 1e-3 * net.trunk.weight.sum(), z  # a path to W that bypasses z

    def not_a_tensor(net: Net) -> tuple[Tensor, Any]:
        losses, z = net.losses(x, y)
        return losses, [z, "z"]

    return {"z of another batch": other_batch, "z that needs no grad": no_grad,
            "a head that reads the trunk's parameters": head_reads_trunk, "z not tensors": not_a_tensor}


BAD_MESSAGES = {
    "z of another batch": "the losses do not depend on features\\[0\\]",
    "z that needs no grad": "needs no grad",
    "a head that reads the trunk's parameters": "without passing through the features z",
    "z not tensors": "features z must be a Tensor",
}


@pytest.mark.parametrize("method", ["mgda", "double-clip", "famo", "nashmtl", "modo"])
@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_bad_features_raise_and_change_nothing(method: str, case: str) -> None:
    net = Net()
    balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian="features")
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    losses, z = _bad_inputs()[case](net)
    with pytest.raises((ValueError, TypeError), match=BAD_MESSAGES[case]):
        balancer.backward(losses, features=z)
    assert all(bool((p.grad == 0.5).all()) for p in net.parameters()), "a refused step changed a .grad"
    assert balancer.steps_taken == 0 and bool((balancer.eta == 0).all())
    assert bool((balancer.w == 1.0 / NUM_TASKS).all())
    # the balancer is still usable
    x, y = batches(1)[0]
    losses, z = net.losses(x, y)
    balancer.backward(losses, features=z)
    assert balancer.steps_taken == 1


def test_features_keyword_is_required_exactly_in_features_mode() -> None:
    net = Net()
    x, y = batches(1)[0]
    features = drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS, jacobian="features")
    parameters = drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS)
    losses, z = net.losses(x, y)
    with pytest.raises(ValueError, match="needs the representation z"):
        features.backward(losses)
    with pytest.raises(ValueError, match="features=z is for jacobian='features'"):
        parameters.backward(losses, features=z)
    with pytest.raises(TypeError, match="the closure must return \\(losses, z\\)"):
        features.backward(lambda: net.losses(x, y)[0])
    assert features.steps_taken == parameters.steps_taken == 0
    features.backward(lambda: net.losses(x, y))  # the closure form returns (losses, z)
    assert features.steps_taken == 1


def test_losses_and_features_from_one_compiled_node_are_refused() -> None:
    """A graph where the losses and z leave the same autograd node (trunk and heads compiled as one graph)
    has no gradient w.r.t. z to take: refused with the fix, instead of zero rows."""
    net = Net()
    x, y = batches(1)[0]

    class Joint(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, inputs: Tensor) -> tuple[Tensor, Tensor]:
            z = inputs[:, :D_Z] * 1.0
            return (z[:, :NUM_TASKS] - y) ** 2, z

        @staticmethod
        def backward(ctx: Any, *grads: Tensor) -> Tensor:  # pragma: no cover - never reached
            raise AssertionError

    losses, z = Joint.apply(net.trunk(x))
    balancer = drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS, jacobian="features")
    with pytest.raises(ValueError, match="come out of one autograd node"):
        balancer.backward(losses, features=z)


def test_a_tuple_of_features_is_one_representation() -> None:
    """z given as two pieces (the heads read both) gives the same .grad as z given whole."""
    x, y = batches(1)[0]
    written = []
    for split in (False, True):
        net = Net()
        balancer = drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS, jacobian="features", pref_lr=0.0)
        z = net.trunk(x)
        pieces = (z[:, :3], z[:, 3:])
        joined = torch.cat(pieces, dim=1) if split else z
        losses = (torch.cat([head(joined) for head in net.heads], dim=1) - y) ** 2
        balancer.backward(losses, features=pieces if split else z)
        written.append(grads(net.trunk))
    for a, b in zip(*written):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("method", ["mgda", "double-clip", "famo", "nashmtl", "double-loop"])
def test_grad_scaler_scales_the_grads_and_takes_an_overflow(method: str) -> None:
    """With a GradScaler (power-of-two scale) the .grad are the unscaled ones times the scale, and an
    Inf in the trunk's backward is handed to the scaler: nothing of the balancer changes, found_inf = 1."""
    x, y = batches(1)[0]
    scale = 2.0**10
    written = []
    for use_scaler in (False, True):
        net = Net(tanh=True)
        balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian="features")
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if use_scaler else None
        losses, z = net.losses(x, y)
        balancer.backward(losses, features=z, scaler=scaler)
        written.append([g / (scale if use_scaler else 1.0) for g in grads(net)])
    for a, b in zip(*written):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    net = Net(tanh=True)
    balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian="features")
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, z = net.losses(x, y)
    net.trunk[0].weight.register_hook(lambda grad: grad * float("inf"))  # overflow in the trunk's backward
    before = [p.detach().clone() for p in net.parameters()]
    balancer.backward(losses, features=z, scaler=scaler)
    assert float(balancer.stats["found_inf"]) == 1.0 and balancer.steps_taken == 0
    scaler.step(sgd)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters())), "the scaler should skip the step"
    assert scaler.get_scale() < scale


# --------------------------------------------------------------------------------- capturable
@pytest.mark.parametrize("method", ["mgda", "double-clip", "nashmtl", "famo", "sdmgrad", "double-loop"])
def test_capturable_features_steps_match_eager_and_skip_non_finite_ones(method: str) -> None:
    kw: dict[str, Any] = {"lr": 0.05, **({"seed": 0} if method == "double-loop" else {})}
    data = batches(3)
    params = {}
    for capturable in (False, True):
        net = Net(tanh=True)
        optimizer = create(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", capturable=capturable,
                           **kw)
        for x, y in data:
            optimizer.step(same_batch(net, x, y))
        params[capturable] = [p.detach().clone() for p in net.trunk.parameters()]
        if capturable:  # a NaN loss: skipped on the device, nothing written
            before = [p.detach().clone() for p in net.trunk.parameters()]
            w, eta = optimizer.w.clone(), optimizer.eta.clone()
            x, y = data[0]
            optimizer.step(same_batch(net, x, y * float("nan")))
            assert int(optimizer.state["drmoo"]["skipped_steps"]) == 1
            assert all(torch.equal(a, b) for a, b in zip(before, net.trunk.parameters()))
            assert torch.equal(w, optimizer.w) and torch.equal(eta, optimizer.eta)
    for a, b in zip(params[False], params[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- state
@pytest.mark.parametrize("method", FEATURE_METHODS)
def test_state_dict_round_trip_and_deepcopy_continue_identically(method: str) -> None:
    """After a step, (a) a fresh features balancer loaded with the state_dict and (b) a deep copy of
    (model, balancer) continue exactly as the original; the copy holds no graph of the last step."""
    seed_kw = {"seed": 0} if method == "double-loop" else {}
    data = batches(3)

    def run(net: Net, balancer: drmoo.Balancer, batch: tuple[Tensor, Tensor]) -> list[Tensor | None]:
        for p in net.parameters():
            p.grad = None
        losses, z = net.losses(*batch)
        balancer.backward(losses, features=z)
        return grads(net)

    net = Net(tanh=True)
    balancer = drmoo.Balancer(method, net.trunk.parameters(), NUM_TASKS, jacobian="features", **seed_kw)
    run(net, balancer, data[0])
    net_copy, balancer_copy = copy.deepcopy((net, balancer))
    assert balancer_copy.algorithm.features_engine is not None
    assert balancer_copy.algorithm.features_engine.features is None
    net_loaded = copy.deepcopy(net)
    balancer_loaded = drmoo.Balancer(method, net_loaded.trunk.parameters(), NUM_TASKS, jacobian="features",
                                     **seed_kw)
    balancer_loaded.load_state_dict(balancer.state_dict())
    expected = run(net, balancer, data[1])
    for other_net, other in ((net_copy, balancer_copy), (net_loaded, balancer_loaded)):
        got = run(other_net, other, data[1])
        for a, b in zip(expected, got):
            assert a is not None and b is not None and torch.equal(a, b)
        assert torch.equal(other.w, balancer.w) and torch.equal(other.eta, balancer.eta)


def test_a_head_reading_an_intermediate_of_the_trunk_is_refused() -> None:
    """A skip connection from inside the trunk to a head bypasses z: its gradient would be missing from
    the features Jacobian, so it is refused (nothing changes), not silently dropped."""
    net = Net(tanh=True)
    x, y = batches(1)[0]
    hidden = net.trunk[0](x)
    z = net.trunk[1](hidden)
    losses = (torch.cat([head(z) for head in net.heads], dim=1) + hidden[:, :1] - y) ** 2
    balancer = drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS, jacobian="features")
    with pytest.raises(ValueError, match="without passing through the features z"):
        balancer.backward(losses, features=z)
    assert all(p.grad is None for p in net.parameters()) and balancer.steps_taken == 0


def test_the_batched_strategy_gives_the_loop_rows_in_features_mode() -> None:
    """``jacobian_strategy = "batched"`` (one vmapped pass above z) writes the same .grad as the loop."""
    x, y = batches(1)[0]
    written = []
    for strategy in ("loop", "batched"):
        net = Net(tanh=True)
        balancer = drmoo.Balancer("mgda", net.trunk.parameters(), NUM_TASKS, jacobian="features")
        balancer.algorithm.jacobian_strategy = strategy
        losses, z = net.losses(x, y)
        balancer.backward(losses, features=z)
        written.append(grads(net))
    for a, b in zip(*written):
        torch.testing.assert_close(a, b)
