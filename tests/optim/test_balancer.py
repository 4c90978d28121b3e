"""drmoo.Balancer: every method's direction in ``.grad``, for any torch optimizer.

The reference is the method's own ``step`` (the paper-exact algorithm, tested elsewhere against
plain implementations).  With ``torch.optim.SGD(lr=gamma)`` (no momentum) and the balancer's
``lr = gamma`` the two trajectories differ only in how theta's update is rounded: ``step`` writes
theta - (gamma * factor) * (J^T w), SGD writes theta - gamma * (factor * (J^T w)) -- one rounding
per entry and step, ~1e-16 relative in float64.  Over a few steps of these well-conditioned small
problems that stays far below the 1e-12 / 1e-10 tolerances used here (measured: <= 6e-17), while
any algorithmic difference (a wrong factor, a missed eta or state update, a head fed from another
batch) shows at 1e-4 or more.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import drmoo
from drmoo.optim import NonFiniteStepError, available, create

M = 2
LR = 0.05
STEPS = 6

# Hyperparameters that make every part of each method move within a few steps (w, the clips,
# Nash-MTL's reuse branch, MoCo's tracking, FAMO's logits), so that a missed update would show.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "double-clip": ("double-clip", {"pref_lr": 0.2, "c2": 0.05, "f2": 0.05}),
    "double-loop": ("double-loop", {"pref_lr": 0.2, "dual_lr": 0.1, "inner_steps": 3, "seed": 5}),
    "mgda": ("mgda", {"pref_lr": 0.2}),
    "mgda-min-norm": ("mgda", {"solver": "min_norm"}),
    "modo": ("modo", {"pref_lr": 0.2}),
    "moco": ("moco", {"pref_lr": 0.2, "ema": 0.5}),
    "sdmgrad": ("sdmgrad", {"pref_lr": 0.2}),
    "nashmtl": ("nashmtl", {"solver_iters": 20, "update_every": 2, "max_norm": 0.5}),
    "famo": ("famo", {"pref_lr": 0.1}),
}


def test_the_cases_cover_every_registered_method() -> None:
    assert {name for name, _ in CASES.values()} == set(available())


# ------------------------------------------------------------------------------------ problem
class TwoTaskNet(nn.Module):
    """A shared tanh trunk and one linear head per task; forward gives the [B, M] predictions."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).to(dtype)
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(M)]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def batch_stream(seed: int = 1, dtype: torch.dtype = torch.float64, size: int = 16) -> Iterator[tuple[Tensor, Tensor]]:
    """Fresh batches of a two-task regression whose tasks conflict (opposite dependence on x0)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(size, 4, generator=generator, dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)
        yield x.to(dtype), (y + 0.1 * torch.randn(size, M, generator=generator, dtype=torch.float64)).to(dtype)


def per_sample_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x) - y) ** 2  # [B, M]: one column per task, not averaged


def all_params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_models_close(first: nn.Module, second: nn.Module, *, atol: float = 1e-12, rtol: float = 1e-10) -> None:
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda text, name=name: f"{name}: {text}")


def assert_states_close(first: dict[str, Any], second: dict[str, Any]) -> None:
    """Every entry of two drmoo states (eta, w, step, the method's own state) agrees."""
    mine, theirs = first["state"]["drmoo"], second["state"]["drmoo"]
    assert set(mine) == set(theirs)
    for key, value in mine.items():
        if isinstance(value, Tensor):
            torch.testing.assert_close(value, theirs[key], atol=1e-12, rtol=1e-10,
                                       msg=lambda text, key=key: f"{key}: {text}")
        else:
            assert value == theirs[key], key


def run_step_optimizer(case: str, steps: int = STEPS, *, single_batch: bool = True) -> tuple[nn.Module, Any]:
    """The method's own step(closure), heads stepped by SGD(LR): the reference trajectory."""
    name, hparams = CASES[case]
    if name == "double-clip" and single_batch:
        hparams = {**hparams, "resample": False}
    model, stream = TwoTaskNet(), batch_stream()
    optimizer = create(name, model.trunk.parameters(), M, lr=LR, **hparams)
    heads = torch.optim.SGD(model.heads.parameters(), lr=LR)
    for _ in range(steps):
        heads.zero_grad()
        if single_batch:  # every draw of the step sees this step's batch (its single-batch form)
            fixed = next(stream)
            optimizer.step(lambda fixed=fixed: per_sample_losses(model, *fixed))
        else:
            optimizer.step(lambda: per_sample_losses(model, *next(stream)))
        heads.step()
    return model, optimizer


def run_balancer(case: str, steps: int = STEPS, *, single_batch: bool = True) -> tuple[nn.Module, drmoo.Balancer]:
    name, hparams = CASES[case]
    model, stream = TwoTaskNet(), batch_stream()
    balancer = drmoo.Balancer(name, model.trunk.parameters(), M, lr=LR, **hparams)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        if single_batch:
            balancer.backward(per_sample_losses(model, *next(stream)))
        else:
            balancer.backward(lambda: per_sample_losses(model, *next(stream)))
        optimizer.step()
    return model, balancer


# ------------------------------------------------------------------------- SGD == step(closure)
@pytest.mark.parametrize("case", CASES)
def test_sgd_with_the_balancer_follows_the_methods_own_step(case: str) -> None:
    reference, optimizer = run_step_optimizer(case)
    model, balancer = run_balancer(case)
    assert_models_close(model, reference)  # shared parameters and heads
    assert_states_close(balancer.state_dict(), optimizer.state_dict())  # eta, w, the method's own state
    assert balancer.steps_taken == STEPS
    # the run moved what it should (a zero trajectory would agree trivially)
    assert not torch.equal(balancer.w, torch.full((M,), 0.5, dtype=balancer.w.dtype)) or CASES[case][0] == "nashmtl"
    assert bool((balancer.eta != 0).all())


def trunk_backward_passes(balancer: drmoo.Balancer, model: nn.Module, losses: Tensor | Callable[[], Tensor]) -> int:
    """How many backward passes reach the trunk's first weight during one ``balancer.backward``."""
    passes = 0

    def count(grad: Tensor) -> Tensor:
        nonlocal passes
        passes += 1
        return grad

    handle = model.trunk[0].weight.register_hook(count)
    try:
        balancer.backward(losses)
    finally:
        handle.remove()
    return passes


@pytest.mark.parametrize("case", ["modo", "sdmgrad"])
def test_the_single_batch_form_computes_each_jacobian_once(case: str) -> None:
    """MoDo's and SDMGrad's three draws coincide on one batch (one graph, one eta), so their Jacobians
    are the same matrix: the balancer computes it once (m passes through the trunk, as a one-batch
    method), not once per draw (3m); the trajectory test above shows the result is the same.  With a
    closure (fresh batches) every draw is still computed.  (Double-Loop's three Jacobians are taken at
    inner iterates of eta drawn at random, so they are all computed: its pass count stays fixed.)"""
    name, hparams = CASES[case]
    model, stream = TwoTaskNet(), batch_stream()
    balancer = drmoo.Balancer(name, model.trunk.parameters(), M, lr=LR, **hparams)
    single = trunk_backward_passes(balancer, model, per_sample_losses(model, *next(stream)))
    one_batch_method = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    floor = trunk_backward_passes(one_batch_method, model, per_sample_losses(model, *next(stream)))
    assert floor == M and single <= M + 1, (single, floor)  # (SDMGrad's combined gradient: one pass more)
    assert balancer.algorithm.jacobian_memo is None  # nothing of the step is kept past it
    fresh = trunk_backward_passes(balancer, model, lambda: per_sample_losses(model, *next(stream)))
    assert fresh >= 3 * M, fresh


def test_double_loop_computes_all_three_jacobians_on_one_batch() -> None:
    name, hparams = CASES["double-loop"]
    model, stream = TwoTaskNet(), batch_stream()
    balancer = drmoo.Balancer(name, model.trunk.parameters(), M, lr=LR, **hparams)
    passes = [trunk_backward_passes(balancer, model, per_sample_losses(model, *next(stream))) for _ in range(3)]
    assert passes == [3 * M] * 3  # one per draw, every step (a fixed count: bench-iter relies on it)


@pytest.mark.parametrize("case", ["double-clip", "double-loop", "modo", "sdmgrad", "famo"])
def test_a_closure_runs_the_methods_multi_batch_form(case: str) -> None:
    reference, optimizer = run_step_optimizer(case, 4, single_batch=False)
    model, balancer = run_balancer(case, 4, single_batch=False)
    assert_models_close(model, reference)
    assert_states_close(balancer.state_dict(), optimizer.state_dict())
    if case == "double-clip":  # resample=True (the default): two batches per step
        assert optimizer.param_groups[0]["resample"]


def test_double_clip_writes_the_clipped_direction() -> None:
    model, stream = TwoTaskNet(), batch_stream()
    balancer = drmoo.Balancer("double-clip", model.trunk.parameters(), M, lr=LR, c2=0.01)
    balancer.backward(per_sample_losses(model, *next(stream)))
    alpha = float(balancer.stats["alpha"])
    assert alpha < 1.0  # the clip is active: .grad is alpha * J^T w, not J^T w
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.trunk.parameters()))
    torch.testing.assert_close(grad_norm, torch.tensor(0.01, dtype=grad_norm.dtype), rtol=1e-9, atol=0.0)


def test_backward_adds_to_existing_grads_like_autograd() -> None:
    model, stream = TwoTaskNet(), batch_stream()
    batch = next(stream)
    fresh = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    twin = copy.deepcopy((model, fresh))
    fresh.backward(per_sample_losses(model, *batch))
    direction = [p.grad.clone() for p in model.parameters()]
    twin_model, twin_balancer = twin
    for p in twin_model.parameters():
        p.grad = torch.ones_like(p)
    twin_balancer.backward(per_sample_losses(twin_model, *batch))
    for before, after in zip(direction, twin_model.parameters()):
        torch.testing.assert_close(after.grad, before + 1.0, atol=1e-15, rtol=0.0)


# --------------------------------------------------------------------------- any optimizer
def train(model: nn.Module, balancer: drmoo.Balancer, optimizer: torch.optim.Optimizer, steps: int,
          scheduler: Any = None, clip: float | None = None) -> tuple[float, float]:
    stream = batch_stream()
    first = last = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        losses = per_sample_losses(model, *next(stream))
        balancer.backward(losses)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        value = float(losses.detach().mean())
        first = value if step == 0 else first
        last = value
    return first, last


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.Adam(params, lr=1e-2),
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2),
    lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-3),
], ids=["adam", "adamw", "sgd-momentum-wd"])
@pytest.mark.parametrize("method", ["double-clip", "mgda", "famo"])
def test_any_torch_optimizer_trains_on_the_balanced_direction(make_optimizer: Callable, method: str) -> None:
    model = TwoTaskNet()
    balancer = drmoo.Balancer(method, model.trunk.parameters(), M, lr=1e-2)
    optimizer = make_optimizer(model.parameters())
    # Adam's first step moves every entry with a nonzero gradient by ~lr: it consumed our .grad
    start = all_params(model)
    optimizer.zero_grad()
    balancer.backward(per_sample_losses(model, *next(batch_stream(seed=9))))
    optimizer.step()
    moved = [float((p.detach() - s).abs().max()) for p, s in zip(model.trunk.parameters(), start)]
    assert all(value > 0 for value in moved)
    first, last = train(model, balancer, optimizer, 60)
    assert last < 0.6 * first, (first, last)
    assert all(bool(torch.isfinite(v).all()) for v in balancer.stats.values())


def test_per_group_learning_rates_and_a_scheduler_match_the_step_optimizer() -> None:
    """SGD with a trunk group (lr gamma) and a heads group (another lr), both on a StepLR, plus a StepLR
    on the balancer's eta step: the trajectory of step() with the same schedules."""
    case, trunk_lr, heads_lr = "mgda", 0.08, 0.02
    name, hparams = CASES[case]

    reference, stream = TwoTaskNet(), batch_stream()
    optimizer = create(name, reference.trunk.parameters(), M, lr=trunk_lr, **hparams)
    heads = torch.optim.SGD(reference.heads.parameters(), lr=heads_lr)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (optimizer, heads)]
    for _ in range(STEPS):
        fixed = next(stream)
        heads.zero_grad()
        optimizer.step(lambda fixed=fixed: per_sample_losses(reference, *fixed))
        heads.step()
        for schedule in schedules:
            schedule.step()

    model, stream = TwoTaskNet(), batch_stream()
    balancer = drmoo.Balancer(name, model.trunk.parameters(), M, lr=trunk_lr, **hparams)
    sgd = torch.optim.SGD([{"params": model.trunk.parameters(), "lr": trunk_lr},
                           {"params": model.heads.parameters(), "lr": heads_lr}])
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (sgd, balancer.algorithm)]
    for _ in range(STEPS):
        sgd.zero_grad()
        balancer.backward(per_sample_losses(model, *next(stream)))
        sgd.step()
        for schedule in schedules:
            schedule.step()
    assert sgd.param_groups[0]["lr"] == trunk_lr / 8
    assert_models_close(model, reference)
    assert_states_close(balancer.state_dict(), optimizer.state_dict())


def test_clip_grad_norm_acts_on_the_written_direction() -> None:
    model, stream = TwoTaskNet(), batch_stream()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    balancer.backward(per_sample_losses(model, *next(stream)))
    total = torch.nn.utils.clip_grad_norm_(model.trunk.parameters(), max_norm=1e-3)
    # the trunk's .grad is J^T w_{t+1}, whose norm the method reports as theta_grad_norm
    torch.testing.assert_close(total.double(), balancer.stats["theta_grad_norm"].double(), rtol=1e-6, atol=0.0)
    clipped = torch.sqrt(sum((p.grad**2).sum() for p in model.trunk.parameters()))
    assert abs(float(clipped) - 1e-3) < 1e-9
    first, last = train(model, balancer, torch.optim.SGD(model.parameters(), lr=0.5), 40, clip=0.5)
    assert last < first


# ------------------------------------------------------------------------- mixed precision
def _fp16_autocast_works_on_cpu() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float16
    except (RuntimeError, TypeError):
        return False


FP16_CPU = pytest.mark.skipif(not _fp16_autocast_works_on_cpu(), reason="this torch has no fp16 autocast on the CPU")


def run_autocast(steps: int, scaler: torch.amp.GradScaler | None, *, method: str = "double-clip",
                 init_batch_seed: int = 1) -> tuple[nn.Module, drmoo.Balancer, list[Tensor]]:
    model, stream = TwoTaskNet(dtype=torch.float32), batch_stream(init_batch_seed, dtype=torch.float32)
    balancer = drmoo.Balancer(method, model.trunk.parameters(), M, lr=LR)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    objectives = []
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = next(stream)
        with torch.autocast("cpu", dtype=torch.float16):
            losses = (model(x).float() - y) ** 2
        objectives.append(balancer.backward(losses, scaler=scaler))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return model, balancer, objectives


@FP16_CPU
@pytest.mark.parametrize("method", ["double-clip", "nashmtl"])
def test_grad_scaler_with_fp16_autocast_gives_the_unscaled_trajectory(method: str) -> None:
    """A power-of-two scale is exact: the scaled run must follow the unscaled one (the dual saw the
    true losses, the scaler unscaled .grad), to fp16-autocast rounding."""
    plain, plain_balancer, plain_objectives = run_autocast(4, None, method=method)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    scaled, balancer, objectives = run_autocast(4, scaler, method=method)
    assert scaler.get_scale() == 2.0**12  # no overflow, no skipped step
    for mine, theirs in zip(objectives, plain_objectives):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert_models_close(scaled, plain, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(balancer.eta, plain_balancer.eta, rtol=1e-5, atol=1e-7)


@FP16_CPU
def test_grad_scaler_overflow_skips_the_step_and_lowers_the_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    model, balancer, _ = run_autocast(1, scaler)
    untouched = TwoTaskNet(dtype=torch.float32)
    assert_models_close(model, untouched, atol=0.0, rtol=0.0)  # the optimizer step was skipped
    assert scaler.get_scale() < 2.0**40
    assert float(balancer.stats["found_inf"]) == 1.0
    assert balancer.steps_taken == 0 and bool((balancer.eta == 0).all())


# ----------------------------------------------------------------------------- torch.compile
def test_a_compiled_model_gives_the_eager_trajectory() -> None:
    """torch.compile with the aot_eager backend: TorchDynamo + AOTAutograd, the same compiled autograd
    graph (one CompiledFunctionBackward node, several backward passes over it) the balancer meets with
    inductor, without inductor's C++ code generation, which takes tens of seconds on a 2-core CPU."""
    for method in ("double-clip", "modo"):  # modo: three Jacobians over the one compiled graph
        eager, _ = run_balancer(method, 3)
        model, stream = TwoTaskNet(), batch_stream()
        compiled = torch.compile(model, backend="aot_eager")
        name, hparams = CASES[method]
        balancer = drmoo.Balancer(name, model.trunk.parameters(), M, lr=LR, **hparams)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(3):
            optimizer.zero_grad()
            x, y = next(stream)
            balancer.backward((compiled(x) - y) ** 2)
            optimizer.step()
        assert_models_close(model, eager, atol=1e-10, rtol=1e-8)


# ------------------------------------------------------------------------------------ state
@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trip_continues_identically(case: str) -> None:
    model, balancer = run_balancer(case, 3)
    name, hparams = CASES[case]
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(balancer.state_dict())
    buffer = io.BytesIO()
    torch.save(saved_state, buffer)
    restored_model = TwoTaskNet(seed=99)
    restored_model.load_state_dict(saved_model)
    restored = drmoo.Balancer(name, restored_model.trunk.parameters(), M, lr=LR, **hparams)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert_states_close(restored.state_dict(), balancer.state_dict())
    for pair in ((model, balancer), (restored_model, restored)):
        stream = batch_stream(seed=3)
        optimizer = torch.optim.SGD(pair[0].parameters(), lr=LR)
        for _ in range(2):
            optimizer.zero_grad()
            pair[1].backward(per_sample_losses(pair[0], *next(stream)))
            optimizer.step()
    assert_models_close(restored_model, model, atol=0.0, rtol=0.0)
    assert_states_close(restored.state_dict(), balancer.state_dict())


def test_a_step_optimizers_state_loads_into_a_balancer_and_back() -> None:
    _, optimizer = run_step_optimizer("moco", 2)
    model = TwoTaskNet()
    balancer = drmoo.Balancer("moco", model.trunk.parameters(), M, lr=LR, **CASES["moco"][1])
    balancer.load_state_dict(optimizer.state_dict())
    assert_states_close(balancer.state_dict(), optimizer.state_dict())
    with pytest.raises(ValueError, match="saved by MoCo, not by MGDA"):
        drmoo.Balancer("mgda", model.trunk.parameters(), M).load_state_dict(balancer.state_dict())


# ------------------------------------------------------------------------------- bad input
def bad_input_setup() -> tuple[nn.Module, drmoo.Balancer, tuple[Tensor, Tensor]]:
    model = TwoTaskNet()
    return model, drmoo.Balancer("double-clip", model.trunk.parameters(), M, lr=LR), next(batch_stream())


@pytest.mark.parametrize(("make_losses", "error", "message"), [
    (lambda model, x, y: per_sample_losses(model, x, y).mean(dim=1), ValueError, r"shape \[B, 2\].*got shape \(16,\)"),
    (lambda model, x, y: torch.cat([per_sample_losses(model, x, y)] * 2, dim=1), ValueError, r"got shape \(16, 4\)"),
    (lambda model, x, y: per_sample_losses(model, x, y).detach(), ValueError, "no autograd graph"),
    (lambda model, x, y: (torch.cat([h(torch.zeros(16, 8, dtype=torch.float64)) for h in model.heads], 1) - y) ** 2,
     ValueError, "do not depend on the balancer's shared parameters"),
    (lambda model, x, y: torch.ones(16, M, requires_grad=True), ValueError, "do not depend"),
    (lambda model, x, y: per_sample_losses(model, x, y).tolist(), TypeError, "takes per-sample losses"),
    (lambda model, x, y: (per_sample_losses(model, x, y),), ValueError, r"must be \(losses, sample_weight\)"),
    (lambda model, x, y: (per_sample_losses(model, x, y), torch.ones(3, M)), ValueError, "sample weights of shape"),
], ids=["averaged", "wrong-m", "detached", "heads-only", "no-params", "list", "1-tuple", "weights-shape"])
def test_bad_losses_are_refused_and_change_nothing(make_losses: Callable, error: type, message: str) -> None:
    model, balancer, batch = bad_input_setup()
    with pytest.raises(error, match=message):
        balancer.backward(make_losses(model, *batch))
    assert all(p.grad is None for p in model.parameters())
    assert balancer.steps_taken == 0 and bool((balancer.eta == 0).all())


def test_nan_losses_raise_and_leave_every_grad_and_the_state_as_they_were() -> None:
    model, balancer, batch = bad_input_setup()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    losses = per_sample_losses(model, *batch)
    with pytest.raises(NonFiniteStepError, match=r"non-finite \(NaN or Inf\) per-sample losses for task\(s\) \[1\]"):
        balancer.backward(losses * torch.tensor([1.0, float("nan")], dtype=losses.dtype))
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())
    assert balancer.steps_taken == 0 and bool((balancer.eta == 0).all())


def test_unknown_method_and_bad_scaler_are_refused() -> None:
    model, balancer, batch = bad_input_setup()
    with pytest.raises(ValueError, match="unknown method 'adam'; valid choices: double-clip"):
        drmoo.Balancer("adam", model.trunk.parameters(), M)
    with pytest.raises(ValueError, match="lam must be finite and > 0"):
        drmoo.Balancer("mgda", model.trunk.parameters(), M, lam=0.0)
    with pytest.raises(TypeError, match="GradScaler"):
        balancer.backward(per_sample_losses(model, *batch), scaler=2.0)  # type: ignore[arg-type]


# Copies (deepcopy, pickle, torch.save) of every method and the Balancer: issue 18's CR-1 test,
# tests/reliability/test_optimizer_copies.py.


# --------------------------------------------------------------------- FAMO's plain closure
def test_every_method_takes_the_readme_closure() -> None:
    for name in available():
        model, stream = TwoTaskNet(), batch_stream()

        def closure(model: nn.Module = model, stream: Iterator = stream) -> Tensor:
            return per_sample_losses(model, *next(stream))

        optimizer = create(name, model.trunk.parameters(), M, lr=LR)
        for _ in range(3):
            optimizer.step(closure)
        assert optimizer.steps_taken == 3, name


def test_famo_plain_closure_updates_the_logits_from_the_next_batch() -> None:
    """Next-batch form: step 1 leaves the logits (its update is pending), step 2 first updates them with
    delta = log D_1 - log D_2, D_2 from its own batch; Adam's first step is -pref_lr * sign(grad)."""
    pref_lr, eps = 0.1, 1e-8
    model, stream = TwoTaskNet(), batch_stream()
    famo = create("famo", model.trunk.parameters(), M, lr=LR, pref_lr=pref_lr, logit_decay=0.0)
    famo.step(lambda: per_sample_losses(model, *next(stream)))
    assert bool((famo.state["drmoo"]["logits"] == 0).all()) and float(famo.state["drmoo"]["pending"]) == 1.0
    first = famo.stats["dual_objective"].double() + eps
    famo.step(lambda: per_sample_losses(model, *next(stream)))
    second = famo.stats["dual_objective"].double() + eps
    decrease = torch.log(first) - torch.log(second)
    gradient = 0.5 * (decrease - decrease.mean())
    expected = -pref_lr * gradient / (gradient.abs() + 1e-8)
    torch.testing.assert_close(famo.state["drmoo"]["logits"], expected, rtol=1e-6, atol=1e-9)
    assert "dual_objective_after" not in famo.stats


# ------------------------------------------------------------------------------- capturable
@pytest.mark.parametrize("case", [case for case in CASES if case != "mgda-min-norm"])
def test_a_capturable_balancer_follows_the_eager_one_and_skips_a_nan_step_on_the_device(case: str) -> None:
    name, hparams = CASES[case]
    runs = []
    for capturable in (False, True):
        model, stream = TwoTaskNet(), batch_stream()
        balancer = drmoo.Balancer(name, model.trunk.parameters(), M, lr=LR, capturable=capturable, **hparams)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(3):
            optimizer.zero_grad()
            balancer.backward(per_sample_losses(model, *next(stream)))
            optimizer.step()
        runs.append((model, balancer))
    (eager, eager_balancer), (model, balancer) = runs
    assert_models_close(model, eager)
    mine, theirs = balancer.state_dict(), eager_balancer.state_dict()
    for state in (mine, theirs):
        state["state"]["drmoo"].pop("skipped_steps")
    assert_states_close(mine, theirs)

    before = copy.deepcopy(balancer.state_dict()["state"]["drmoo"])
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    losses = per_sample_losses(model, *next(batch_stream(seed=7)))
    balancer.backward(losses * torch.tensor([1.0, float("nan")], dtype=losses.dtype))  # no raise: skipped
    assert float(balancer.stats["found_inf"]) == 1.0
    assert all(bool((p.grad == 2.0).all()) for p in model.parameters())  # zeros added
    after = balancer.state_dict()["state"]["drmoo"]
    for key, value in before.items():
        if key not in ("step", "skipped_steps", "index_rng_state"):  # Double-Loop draws its indices all the same
            assert torch.equal(after[key], value) if isinstance(value, Tensor) else after[key] == value, key
