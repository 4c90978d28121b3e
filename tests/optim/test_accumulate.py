"""Gradient accumulation: k micro-batches through ``Balancer.backward(losses, accumulate=True)`` give the
step of one backward on the concatenated batch.

The reference is the same balancer given the whole batch (64 rows); the accumulated run gets it as
micro-batches (4 x 16, and 10 + 30 + 4 + 20 on one step) from the same model, for 3 steps of SGD.

Tolerances, from the bound on re-ordered sums.  Every quantity compared is, mathematically, the same
finite sum over the batch's samples in both runs -- only the grouping differs (per micro-batch, then
across them).  A sum of N terms computed in any order and grouping in floating point is within
gamma_N * sum|terms| of the exact value (gamma_N = N u / (1 - N u), u the unit roundoff; Higham,
*Accuracy and Stability of Numerical Algorithms*, eq. 4.4), so two groupings differ by at most twice
that.  Here each entry of a gradient is a sum over B samples and m tasks of per-sample terms that are
themselves products along the network (at most 4 + 8 + 1 + 1 factors and sums): N = B m 14.  The terms'
absolute sum is computed from per-sample gradients at each step (:func:`absolute_terms`) and scaled by
the step's coefficient mass (sum |c_i|, at least 1 for the heads, which take coefficients 1).  The
three steps add their bounds (first order: a difference carried into theta by an earlier step moves
the next gradient by lr * (its Hessian) times it, lr = 0.05, inside the factor 4 used below).  The dual
variables: eta moves by lr * c_i * z_i, z_i = 1 - mean_b v_b (terms summing to at most 1 + mean_b v_b).
The preference w and the methods' states are m x m functions of the Gram: a relative perturbation delta
of the Gram moves them by at most cond(K) * delta to first order, cond(K) taken from the reference's
Jacobian at each step.  An algorithmic difference (four summed directions, four dual steps, the 1/4
convention) shows at 1e-3 or more; these bounds are ~1e-12.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import drmoo
from drmoo import GradientAccumulationWarning, distributed
from drmoo_kernels import get_divergence
from drmoo_kernels.reference import dual_forward

M = 2
LR = 0.05
STEPS = 3
BATCH = 64
SPLITS = {0: [16, 16, 16, 16], 1: [10, 30, 4, 20], 2: [16, 16, 16, 16]}  # unequal sizes at step 1
U = 2.0**-53
TERMS = BATCH * M * 14  # N of the module docstring
GAMMA = TERMS * U / (1 - TERMS * U)

# Every method accumulate mode accepts, with hyperparameters that move every part of it within 3 steps.
ACCEPTED: dict[str, tuple[str, dict[str, Any]]] = {
    **{method: (method, {"pref_lr": 0.3}) for method in ("mgda", "modo", "sdmgrad", "famo")},
    "mgda-min-norm": ("mgda", {"solver": "min_norm"}),
    "moco": ("moco", {"pref_lr": 0.3, "ema": 0.5}),
    "nashmtl": ("nashmtl", {"solver_iters": 20, "update_every": 2, "max_norm": 0.5}),
}


class TwoTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double()
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(M)]).double()

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def batches(seed: int = 1) -> Iterator[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(BATCH, 4, generator=generator, dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0]) + x[:, 1], -torch.sin(x[:, 0]) + 0.5 * x[:, 2]], dim=1)
        yield x, y + 0.1 * torch.randn(BATCH, M, generator=generator, dtype=torch.float64)


def losses_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x) - y) ** 2


def absolute_terms(model: nn.Module, x: Tensor, y: Tensor, eta: Tensor) -> tuple[list[Tensor], Tensor, Tensor]:
    """Per parameter, sum_b,i (v_b^i / B) |d l_b^i / d theta| (the gradient's terms, in absolute value); the
    Jacobian J [m, n] of the dual objectives; max_i (1 + mean_b v_b^i) (z's terms)."""
    params = list(model.parameters())
    losses = losses_of(model, x, y)
    _, _, cotangent = dual_forward(losses.detach(), eta, 0.8, 1.0, get_divergence("chi2"))
    absolute = [torch.zeros_like(p) for p in params]
    trunk = len(list(model.trunk.parameters()))  # the trunk's parameters come first
    rows = torch.zeros(M, sum(p.numel() for p in params[:trunk]), dtype=torch.float64)
    for b in range(BATCH):  # per-sample gradients, one backward each (the net is tiny)
        for task in range(M):
            sample = torch.autograd.grad(losses[b, task], params, retain_graph=True, allow_unused=True)
            weight = cotangent[b, task]
            for index, g in enumerate(sample):
                if g is not None:
                    absolute[index] += weight * g.abs()
            rows[task] += weight * torch.cat([g.reshape(-1) for g in sample[:trunk]])
    z_terms = (1.0 + (cotangent * BATCH).mean(0)).max()
    return absolute, rows, z_terms


def features_gram(model: nn.Module, x: Tensor, y: Tensor, eta: Tensor) -> Tensor:
    """The Gram J_z J_z^T of the dual objectives' gradients w.r.t. the features z (features mode's)."""
    z = model.trunk(x)
    losses = (torch.cat([head(z) for head in model.heads], dim=1) - y) ** 2
    _, _, cotangent = dual_forward(losses.detach(), eta, 0.8, 1.0, get_divergence("chi2"))
    rows = torch.stack([torch.autograd.grad(losses[:, task], z, grad_outputs=cotangent[:, task],
                                            retain_graph=True)[0].reshape(-1) for task in range(M)])
    return rows @ rows.T


def balanced_backward(balancer: drmoo.Balancer, model: nn.Module, x: Tensor, y: Tensor, weight: Tensor | None,
                      features: bool, accumulate: bool = False) -> None:
    """One backward of the balancer on (x, y): with z in features mode."""
    z = model.trunk(x)
    losses = (torch.cat([head(z) for head in model.heads], dim=1) - y) ** 2
    given = losses if weight is None else (losses, weight)
    balancer.backward(given, features=z if features else None, accumulate=accumulate)


def run(case: str, *, accumulate: bool, weighted: bool = False,
        splits: dict[int, list[int]] = SPLITS, features: bool = False) -> dict[str, Any]:
    """STEPS steps of SGD on the whole batch, or accumulated over micro-batches of ``splits[step]`` rows; under
    torch.distributed each rank takes its shard of the batch (every W-th row), then its micro-batches.
    ``features``: jacobian="features" (the Gram over z: the reference is features mode's own full batch)."""
    name, hparams = ACCEPTED[case]
    model, stream = TwoTaskNet(), batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    mode: dict[str, Any] = {"jacobian": "features"} if features else {}
    if features and name in ("mgda", "nashmtl"):
        mode["features_rate_chosen"] = True  # their step size reads gradient norms, taken over z here
    balancer = drmoo.Balancer(name, model.trunk.parameters(), M, optimizer=optimizer, lam=0.8, **hparams, **mode)
    record: dict[str, Any] = {"grads": [], "eta": [], "w": [], "steps": [], "bounds": [], "cond": [], "z": [],
                              "mass": []}
    for step in range(STEPS):
        x, y = next(stream)
        weight = torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64)[:, None].expand(BATCH, M) if weighted else None
        if not accumulate:
            absolute, jacobian, z_terms = absolute_terms(model, x, y, balancer.eta.clone())
            gram = features_gram(model, x, y, balancer.eta.clone()) if features else jacobian @ jacobian.T
            record["bounds"].append(absolute)
            record["cond"].append(float(torch.linalg.cond(gram)))
            record["z"].append(float(z_terms))
        optimizer.zero_grad()
        if accumulate:
            rows = distributed.shard(torch.arange(BATCH))
            x, y = x[rows], y[rows]
            weight = None if weight is None else weight[rows]
            start, sizes = 0, splits[step]
            for k, size in enumerate(sizes):
                rows = slice(start, start + size)
                start += size
                balanced_backward(balancer, model, x[rows], y[rows], None if weight is None else weight[rows],
                                  features, accumulate=k < len(sizes) - 1)
                if k < len(sizes) - 1:
                    assert balancer.steps_taken == step  # no dual step before the last micro-batch
                    assert all(p.grad is None for p in model.parameters())  # nothing written yet
        else:
            balanced_backward(balancer, model, x, y, weight, features)
        record["grads"].append([p.grad.clone() for p in model.parameters()])
        record["eta"].append(balancer.eta.clone())
        record["w"].append(balancer.w.clone())
        record["steps"].append(balancer.steps_taken)
        record["mass"].append(max(1.0, float(balancer.stats["step_weights"].abs().sum())))
        optimizer.step()
    record["state"] = balancer.state_dict()["state"]["drmoo"]
    return record


# Importance weights: with one Jacobian-forming method and the combined-gradient one (FAMO).
@pytest.mark.parametrize(("case", "weighted"), [*((case, False) for case in ACCEPTED), ("mgda", True), ("famo", True)])
def test_micro_batches_give_the_full_batch_step(case: str, weighted: bool) -> None:
    full, micro = run(case, accumulate=False, weighted=weighted), run(case, accumulate=True, weighted=weighted)
    assert_full_batch_step(full, micro)


# Each rank's shard (32 rows) in micro-batches; the ranks' micro-batches are as large as each other's.
RANK_SPLITS = {0: [16, 16], 1: [10, 22], 2: [8, 8, 16]}


RANK_CASES = ("mgda", "famo")  # a Jacobian-forming method and the combined-gradient one, in one launch


def _accumulating_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        runs = {case: run(case, accumulate=True, splits=RANK_SPLITS) for case in RANK_CASES}
        runs["features"] = run("mgda", accumulate=True, splits=RANK_SPLITS, features=True)  # z's Gram over ranks
        torch.save(runs, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_accumulating_their_shards_give_the_full_batch_step(tmp_path: Path,
                                                                       run_ranks: Callable[..., None]) -> None:
    run_ranks(_accumulating_rank, 2, str(tmp_path / "init"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for case in RANK_CASES:
        for first, second in zip(ranks[0][case]["grads"], ranks[1][case]["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(first, second))  # the replicas stay identical
        assert_full_batch_step(run(case, accumulate=False), ranks[0][case])
    assert_full_batch_step(run("mgda", accumulate=False, features=True), ranks[0]["features"])


def assert_full_batch_step(full: dict[str, Any], micro: dict[str, Any]) -> None:
    """The accumulated run's .grad, eta, w, step count and state are the full batch's, within the bounds of
    the module docstring."""
    assert micro["steps"] == full["steps"] == [1, 2, 3]  # one dual step per optimizer step
    carried = [torch.zeros_like(b) for b in full["bounds"][0]]
    eta_bound, w_bound = 0.0, 0.0
    for step in range(STEPS):
        mass = full["mass"][step]
        carried = [c + mass * b for c, b in zip(carried, full["bounds"][step])]
        for index, (a, b) in enumerate(zip(full["grads"][step], micro["grads"][step])):
            bound = 4 * 2 * GAMMA * carried[index]  # shared parameters and heads alike
            assert bool(((a - b).abs() <= bound).all()), f"step {step} parameter {index}: {(a - b).abs().max()}"
        eta_bound += 4 * 2 * GAMMA * LR * mass * full["z"][step]
        w_bound += 4 * 2 * GAMMA * full["cond"][step]
        torch.testing.assert_close(micro["eta"][step], full["eta"][step], atol=eta_bound, rtol=0.0)
        torch.testing.assert_close(micro["w"][step], full["w"][step], atol=w_bound, rtol=0.0)
    for key, value in full["state"].items():  # the method's own state (MoCo's tracking, FAMO's logits, ...)
        if isinstance(value, Tensor) and value.is_floating_point():
            scale = 1.0 + float(value.abs().max())
            torch.testing.assert_close(micro["state"][key], value, atol=w_bound * scale, rtol=0.0,
                                       msg=lambda text, key=key: f"{key}: {text}")
        else:
            assert micro["state"][key] == value


def test_the_naive_convention_is_a_different_step() -> None:
    """What the bounds guard against: four backwards of losses / 4 (the common convention) differ at 1e-3 or
    more, and take four dual steps."""
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR, pref_lr=0.2)
    reference = copy.deepcopy(model)
    reference_balancer = drmoo.Balancer("mgda", reference.trunk.parameters(), M, lr=LR, pref_lr=0.2)
    x, y = next(stream)
    reference_balancer.backward(losses_of(reference, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientAccumulationWarning)
        for rows in torch.arange(BATCH).split(16):
            balancer.backward(losses_of(model, x[rows], y[rows]) / 4)
    assert balancer.steps_taken == 4
    difference = (model.trunk[0].weight.grad - reference.trunk[0].weight.grad).abs().max()
    assert float(difference) > 1e-3 * float(reference.trunk[0].weight.grad.abs().max())


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("method", ["double-clip", "double-loop"])
def test_methods_whose_gradients_need_the_whole_batch_first_are_refused(method: str) -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer(method, model.trunk.parameters(), M, lr=LR)  # type: ignore[call-overload]
    x, y = next(stream)
    with pytest.raises(ValueError, match=r"cannot accumulate micro-batches exactly: .*eta.*torch.cat"):
        balancer.backward(losses_of(model, x[:16], y[:16]), accumulate=True)
    assert balancer.steps_taken == 0 and all(p.grad is None for p in model.parameters())


# Features mode: every method it runs (MoCo's tracked Jacobian is refused there); its Gram is over z, so the
# reference is features mode's own full batch, and the bounds' condition number is that Gram's.
@pytest.mark.parametrize(("case", "weighted"), [*((case, False) for case in ACCEPTED if case != "moco"),
                                                ("famo", True)])
def test_micro_batches_give_the_full_batch_step_in_features_mode(case: str, weighted: bool) -> None:
    full = run(case, accumulate=False, weighted=weighted, features=True)
    micro = run(case, accumulate=True, weighted=weighted, features=True)
    assert_full_batch_step(full, micro)


def test_a_closure_neither_accumulates_nor_closes_an_accumulation() -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    x, y = next(stream)
    with pytest.raises(TypeError, match=r"accumulate=True\) takes a micro-batch's per-sample losses"):
        balancer.backward(lambda: losses_of(model, x, y), accumulate=True)
    balancer.backward(losses_of(model, x[:16], y[:16]), accumulate=True)
    with pytest.raises(TypeError, match="closes the step takes the last micro-batch's losses"):
        balancer.backward(lambda: losses_of(model, x, y))


def test_an_optimizer_step_between_micro_batches_is_refused() -> None:
    model, stream = TwoTaskNet(), batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, optimizer=optimizer)
    x, y = next(stream)
    balancer.backward(losses_of(model, x[:16], y[:16]), accumulate=True)
    model.trunk[0].weight.grad = torch.ones_like(model.trunk[0].weight)
    optimizer.step()  # the shared parameters move: the micro-batch above was taken at another point
    with pytest.raises(ValueError, match="shared parameters changed since the first of the 1 micro-batch"):
        balancer.backward(losses_of(model, x[16:32], y[16:32]))


def test_loading_a_state_while_micro_batches_are_accumulated_is_refused() -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    saved = copy.deepcopy(balancer.state_dict())  # state_dict() holds the live state, as torch's does
    x, y = next(stream)
    balancer.backward(losses_of(model, x[:16], y[:16]), accumulate=True)
    with pytest.raises(ValueError, match=r"1 micro-batch\(es\) are accumulated .* before load_state_dict"):
        balancer.load_state_dict(saved)
    balancer.backward(losses_of(model, x[16:32], y[16:32]))
    balancer.load_state_dict(saved)  # closed: allowed again
    assert balancer.steps_taken == 0


def test_a_failing_closing_step_changes_nothing_and_drops_the_micro_batches() -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    x, y = next(stream)
    balancer.backward(losses_of(model, x[:16], y[:16]), accumulate=True)
    bad = losses_of(model, x[16:32], y[16:32]) * torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    eta, w = balancer.eta.clone(), balancer.w.clone()
    with pytest.raises(drmoo.optim.NonFiniteStepError):
        balancer.backward(bad)
    assert torch.equal(balancer.eta, eta) and torch.equal(balancer.w, w) and balancer.steps_taken == 0
    assert all(p.grad is None for p in model.parameters())
    balancer.backward(losses_of(model, x[32:48], y[32:48]))  # a fresh step: the dropped micro-batch is not in it
    reference = TwoTaskNet()
    reference_balancer = drmoo.Balancer("mgda", reference.trunk.parameters(), M, lr=LR)
    reference_balancer.backward(losses_of(reference, x[32:48], y[32:48]))
    torch.testing.assert_close(model.trunk[0].weight.grad, reference.trunk[0].weight.grad, rtol=0.0, atol=0.0)


# ------------------------------------------------------------------------ no silent double backward
def test_a_second_backward_before_the_step_warns_naming_accumulate() -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    x, y = next(stream)
    balancer.backward(losses_of(model, x[:16], y[:16]))
    expected = r"second backward before the optimizer stepped.*accumulate=True"
    with pytest.warns(GradientAccumulationWarning, match=expected):
        balancer.backward(losses_of(model, x[16:32], y[16:32]))


def test_a_loss_backward_before_the_balancer_warns() -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    x, y = next(stream)
    losses_of(model, x, y).mean().backward()
    with pytest.warns(GradientAccumulationWarning, match="from a backward pass outside the balancer"):
        balancer.backward(losses_of(model, x, y))


def test_a_step_without_zero_grad_warns() -> None:
    model, stream = TwoTaskNet(), batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, optimizer=optimizer)
    x, y = next(stream)
    balancer.backward(losses_of(model, x, y))
    optimizer.step()
    with pytest.warns(GradientAccumulationWarning, match="no zero_grad followed"):
        balancer.backward(losses_of(model, x, y))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_ordinary_loops_do_not_warn(set_to_none: bool) -> None:
    model, stream = TwoTaskNet(), batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientAccumulationWarning)
        for step in range(4):
            x, y = next(stream)
            optimizer.zero_grad(set_to_none=set_to_none)
            if step % 2:  # accumulated and plain steps alternate
                balancer.backward(losses_of(model, x[:32], y[:32]), accumulate=True)
                balancer.backward(losses_of(model, x[32:], y[32:]))
            else:
                losses_of(model, x, y).mean().backward()  # a foreign gradient, then zeroed: nothing left
                optimizer.zero_grad(set_to_none=set_to_none)
                balancer.backward(losses_of(model, x, y))
            optimizer.step()
    assert balancer.steps_taken == 4


# ------------------------------------------------------------------------------- mixed precision
def accumulate_under(scaler: torch.amp.GradScaler | None,
                     poison: int | None = None) -> tuple[nn.Module, drmoo.Balancer]:
    """One accumulated step (4 x 16 rows) with ``scaler``; ``poison``: that micro-batch's losses get an Inf."""
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR, pref_lr=0.3)
    x, y = next(stream)
    for k, rows in enumerate(torch.arange(BATCH).split(16)):
        losses = losses_of(model, x[rows], y[rows])
        if k == poison:
            losses = losses * torch.tensor([float("inf"), 1.0], dtype=torch.float64)
        balancer.backward(losses, scaler=scaler, accumulate=k < 3)
    return model, balancer


def test_under_a_grad_scaler_the_accumulated_grad_is_scaled_and_nothing_else_changes() -> None:
    plain_model, plain = accumulate_under(None)
    scale = 2.0**12
    model, balancer = accumulate_under(torch.amp.GradScaler("cpu", init_scale=scale))
    for a, b in zip(model.parameters(), plain_model.parameters()):  # a power of 2: scaling is exact
        torch.testing.assert_close(a.grad / scale, b.grad, rtol=0.0, atol=0.0)
    assert torch.equal(balancer.eta, plain.eta) and torch.equal(balancer.w, plain.w) and balancer.steps_taken == 1


@pytest.mark.parametrize("poison", [0, 3], ids=["an-earlier-micro-batch", "the-last"])
def test_an_overflowing_micro_batch_skips_the_whole_step_through_the_scaler(poison: int) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    model, balancer = accumulate_under(scaler, poison)
    assert balancer.steps_taken == 0 and torch.equal(balancer.eta, torch.zeros_like(balancer.eta))
    assert bool(balancer.stats["found_inf"])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler.step(optimizer)  # skipped: every .grad the step writes holds an Inf
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() < 2.0**12


def test_a_copied_balancer_watches_its_own_parameters_and_leaves_the_original_watching() -> None:
    model, stream = TwoTaskNet(), batches()
    balancer = drmoo.Balancer("mgda", model.trunk.parameters(), M, lr=LR)
    model_copy, balancer_copy = copy.deepcopy((model, balancer))
    del balancer_copy  # must not take the original's hooks with it
    x, y = next(stream)
    for net, watcher in ((model, balancer), *[copy.deepcopy((model, balancer))]):
        losses_of(net, x, y).mean().backward()
        with pytest.warns(GradientAccumulationWarning, match="outside the balancer"):
            watcher.backward(losses_of(net, x, y))
        net.zero_grad()
    assert model_copy is not model
