"""DoubleLoopMGDA against a plain, step-by-step transcription of the paper's Algorithm 1."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
import torch
from torch import Tensor

from drmoo.jacobian import task_jacobian
from drmoo.optim import DoubleLoopMGDA, NonFiniteStepError
from drmoo_kernels.reference import project_simplex

HP = {"lr": 0.05, "dual_lr": 0.2, "pref_lr": 0.2, "rho": 1e-3, "inner_steps": 4, "lam": 0.6}


def kl_weights(u: Tensor) -> Tensor:
    return torch.exp(u)


def kl_dual(losses: Tensor, eta: Tensor, lam: float) -> Tensor:
    return lam * (torch.exp((losses - eta) / lam) - 1).mean(0) + eta


def plain_projection(v: Tensor) -> Tensor:
    """Bisection on the threshold tau of sum(max(v - tau, 0)) = 1."""
    low, high = float(v.min()) - 1.0, float(v.max())
    for _ in range(200):
        mid = 0.5 * (low + high)
        if float(torch.clamp(v - mid, min=0).sum()) > 1.0:
            low = mid
        else:
            high = mid
    return torch.clamp(v - 0.5 * (low + high), min=0)


def plain_algorithm1(problem, steps: int, seed: int, index_seed: int) -> list[dict]:
    """Algorithm 1 as printed (KL divergence), with the same batch stream and index generator."""
    m, lam, depth = problem.num_tasks, HP["lam"], HP["inner_steps"]
    eta = torch.zeros(m, dtype=torch.float64)
    w = torch.full((m,), 1.0 / m, dtype=torch.float64)
    draw = problem.batches(seed)
    index_gen = random.Random(index_seed)  # the optimizer's documented host-side index generator
    history = []
    for _ in range(steps):
        etas = [eta]
        for _ in range(depth):  # lines 3-6
            with torch.no_grad():
                losses = problem.losses(draw())
            etas.append(etas[-1] - HP["dual_lr"] * (1 - kl_weights((losses - etas[-1]) / lam).mean(0)))
        d, d_bar, d_tilde = (index_gen.randrange(depth) for _ in range(3))  # line 7
        jacobians = []
        head_grad = None
        for index in (d, d_bar, d_tilde):  # lines 8-11
            dual = kl_dual(problem.losses(draw()), etas[index], lam)
            rows = []
            for i in range(m):
                grads = torch.autograd.grad(dual[i], problem.shared, retain_graph=True)
                rows.append(torch.cat([g.flatten() for g in grads]))
            if head_grad is None:
                (head_grad,) = torch.autograd.grad(dual.sum(), problem.H)
            jacobians.append(torch.stack(rows))
        y, y_bar, y_tilde = jacobians
        step = y.T @ w
        with torch.no_grad():  # line 12
            offset = 0
            for p in problem.shared:
                p -= HP["lr"] * step[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            problem.H -= 0.01 * head_grad
        w = plain_projection(w - HP["pref_lr"] * (y_bar @ y_tilde.T @ w + HP["rho"] * w))  # line 13
        eta = etas[-1]
        history.append({"w": w.clone(), "eta": eta.clone(), "indices": (d, d_bar, d_tilde),
                        "head_grad": head_grad, "params": problem.snapshot()})
    return history


def test_matches_plain_algorithm_1(toy) -> None:
    # KL weights on this toy overflow for some index sequences (eta_{t,0} far below the losses):
    # the seed gives a finite trajectory, checked so that the comparison below is not vacuous.
    expected = plain_algorithm1(toy(), steps=12, seed=11, index_seed=7)
    assert all(bool(torch.isfinite(want["eta"]).all() and torch.isfinite(want["w"]).all()) for want in expected)
    problem = toy()
    optimizer = DoubleLoopMGDA(problem.shared, problem.num_tasks, **HP, divergence="kl", seed=7,
                               backend="reference")
    heads = torch.optim.SGD([problem.H], lr=0.01)
    closure = problem.closure(11)
    seen_indices = set()
    for step, want in enumerate(expected):
        heads.zero_grad()
        optimizer.step(closure)
        assert tuple(optimizer.stats["inner_indices"].tolist()) == want["indices"]
        torch.testing.assert_close(problem.H.grad, want["head_grad"], msg=f"head gradient, step {step}")
        heads.step()
        for got, ref in zip(problem.snapshot(), want["params"]):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=f"params, step {step}")
        torch.testing.assert_close(optimizer.w, want["w"], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(optimizer.eta, want["eta"], rtol=1e-10, atol=1e-12)
        seen_indices.update(want["indices"])
    assert len(seen_indices) > 1, "the random inner indices should vary"


def test_closure_calls_per_step(toy) -> None:
    problem = toy()
    calls = []
    inner = problem.closure(0)

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        return inner()

    DoubleLoopMGDA(problem.shared, 3, inner_steps=6).step(closure)
    # D forward-only inner draws, then three independent draws with graphs
    assert calls == [False] * 6 + [True] * 3


def test_state_dict_round_trip_continues_identically(toy) -> None:
    problem = toy()
    optimizer = DoubleLoopMGDA(problem.shared, 3, **HP, seed=5)
    draw = problem.batches(3)
    for _ in range(4):
        optimizer.step(lambda: problem.losses(draw()))
    buffer = io.BytesIO()
    torch.save({"optim": optimizer.state_dict(), "params": problem.snapshot()}, buffer)
    future = [draw() for _ in range(5 * (HP["inner_steps"] + 3))]
    feed = iter(future)
    for _ in range(5):
        optimizer.step(lambda: problem.losses(next(feed)))
    want = problem.snapshot() + [optimizer.w.clone(), optimizer.eta.clone()]

    buffer.seek(0)
    saved = torch.load(buffer)
    fresh = toy()
    with torch.no_grad():
        for p, value in zip((fresh.A, fresh.c, fresh.H), saved["params"]):
            p.copy_(value)
    restored = DoubleLoopMGDA(fresh.shared, 3, **HP, seed=999)  # the saved generator state wins
    restored.load_state_dict(saved["optim"])
    feed = iter(future)
    for _ in range(5):
        restored.step(lambda: fresh.losses(next(feed)))
    for got, expected in zip(fresh.snapshot() + [restored.w, restored.eta], want):
        assert torch.equal(got, expected)


def test_inner_steps_must_be_a_positive_int(toy) -> None:
    problem = toy()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="inner_steps"):
            DoubleLoopMGDA(problem.shared, 3, inner_steps=bad)


class _Python310Int(int):
    """``int`` as Python 3.10 has it for ``from_bytes``: the byte order has no default (3.11 added "big")."""

    @classmethod
    def from_bytes(cls, data: bytes, byteorder: str, *, signed: bool = False) -> int:
        return int.from_bytes(data, byteorder, signed=signed)


def test_a_legacy_torch_generator_state_loads_under_python_3_10(toy, monkeypatch) -> None:
    """A state saved with the former torch index generator (``rng_state``) loads, under Python 3.10 too.

    Its upgrade seeds the new generator from the old state's bytes with ``int.from_bytes``; it passed
    no byte order, which Python 3.10 requires (TypeError there).  The module's ``int`` is replaced by
    one with 3.10's signature, and the seed is the big-endian one that 3.11's default gave.
    """
    import hashlib

    import drmoo.optim.double_loop as double_loop

    problem = toy()
    saved = DoubleLoopMGDA(problem.shared, 3, **HP, seed=5).state_dict()
    legacy_state = torch.Generator().manual_seed(3).get_state()
    own = {key: value for key, value in saved["state"]["drmoo"].items() if key != "index_rng_state"}
    legacy = {**saved, "state": {**saved["state"], "drmoo": {**own, "rng_state": legacy_state}}}
    restored = DoubleLoopMGDA(problem.shared, 3, **HP, seed=999)
    monkeypatch.setattr(double_loop, "int", _Python310Int, raising=False)  # for the load only
    restored.load_state_dict(legacy)
    monkeypatch.undo()
    seed = int.from_bytes(hashlib.sha256(legacy_state.numpy().tobytes()).digest()[:8], "big")
    assert restored.state_dict()["state"]["drmoo"]["index_rng_state"] == random.Random(seed).getstate()


# ---------------------------------------------------------------------------------------- features mode
# Features mode never forms Y_tilde: line 13 uses it only as Y_tilde^T w, which is ONE backward pass above
# z of the cotangent c~ * w (c~: Y_tilde's cotangents).  The tests below hold that pass to the full-Jacobian
# formula it replaces, count the passes, and check that a non-finite value still stops the step.
FEATURES_TASKS = 5


def features_closure(problem, rows: Tensor):
    """One batch for the whole step: the inner draws recompute it without grad, the three outer draws get
    the same (losses, z), z = tanh(x A + c) being the representation every head (a column of H) reads."""
    cached: dict[str, tuple[Tensor, Tensor]] = {}

    def closure() -> tuple[Tensor, Tensor]:
        if "batch" not in cached or not torch.is_grad_enabled():
            z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
            batch = ((z @ problem.H - problem.targets[rows]) ** 2, z)
            if not torch.is_grad_enabled():
                return batch
            cached["batch"] = batch
        return cached["batch"]

    return closure


def features_optimizer(problem, **kw) -> DoubleLoopMGDA:
    return DoubleLoopMGDA(problem.shared, problem.num_tasks, **{**HP, **kw}, jacobian="features", seed=3,
                          backend="reference")


def gamma(n: int, unit: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n floating-point roundings."""
    return n * unit / (1 - n * unit)


@pytest.mark.parametrize("strategy", ["loop", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_features_cross_equals_the_full_jacobian_formula(toy, monkeypatch, dtype: torch.dtype, strategy: str) -> None:
    """The one-pass Y_bar (Y_tilde^T w) equals the former Y_bar (w^T Y_tilde) with Y_tilde's full Jacobian
    w.r.t. z (same losses, same cotangents), and w_{t+1} follows, over steps with a zero weight in w.

    Tolerance (first-order rounding analysis; u = 2^-24 / 2^-53 the unit roundoff of the dtype, which is
    also the accumulation precision, K = B * hidden the entries of z, m the tasks).  An entry of Y_tilde is
    c~[b, i] * 2 (out[b, i] - y[b, i]) * H[k, i]: a product of four factors.  The former v = w^T Y_tilde
    adds m such rows, each times w_i; the one pass forms the products w_i c~[b, i] 2 (out - y) H[k, i]
    (one rounding more each) and sums them over the m tasks in autograd's matmul.  Each is a sum of m
    products of at most five factors, so each is within gamma_{m+5} (|w|^T |Y_tilde|)[k] of the exact v.
    Y_bar v is then a sum of K products in one matmul for both: |cross_new - cross_old| <=
    2 (gamma_{m+5} + gamma_K) (|Y_bar| (|Y_tilde|^T |w|)) <= 2 gamma_{m+K+5} (|Y_bar| (|Y_tilde|^T |w|)),
    entry by entry.  The projection onto the simplex is 1-Lipschitz (Euclidean norm), so w_{t+1} differs
    from the projection of the former step by at most pref_lr ||cross_new - cross_old|| plus the
    projection's own rounding (a sort, cumulative sums of m terms: 4 m u).
    """
    unit = 2.0**-24 if dtype == torch.float32 else 2.0**-53
    problem = toy(num_tasks=FEATURES_TASKS, dtype=dtype)
    optimizer = features_optimizer(problem)
    optimizer.jacobian_strategy = strategy
    engine = optimizer.features_engine
    assert engine is not None
    with torch.no_grad():  # a zero weight: 0 * (anything finite) must not change the comparison
        optimizer.w.copy_(torch.tensor([0.4, 0.0, 0.3, 0.2, 0.1], dtype=optimizer.w.dtype))
    seen: dict[str, Any] = {}
    rows_of = optimizer.task_jacobian

    def spy_rows(losses: Tensor, cotangent: Tensor, slot: str, *, feed_heads: bool) -> Tensor:
        jacobian = rows_of(losses, cotangent, slot, feed_heads=feed_heads)
        seen[slot] = jacobian.clone()
        return jacobian

    combined = optimizer._tilde_times_w

    def spy_combined(losses: Tensor, cotangent: Tensor) -> Tensor:
        # The former Y_tilde: every task's row w.r.t. z, from the same losses and cotangents.
        assert engine.features is not None
        full = torch.empty(FEATURES_TASKS, sum(p.numel() for p in engine.features), dtype=dtype)
        task_jacobian(losses, cotangent, engine.features, full, strategy="loop", feed_heads=False,
                      retain_graph=True)
        seen["Y_tilde"] = full
        return combined(losses, cotangent)

    outer = optimizer._outer_gradients

    def spy_outer(*args: Any) -> Any:
        result = outer(*args)
        seen["cross"] = result[1].clone()
        return result

    monkeypatch.setattr(optimizer, "task_jacobian", spy_rows)
    monkeypatch.setattr(optimizer, "_tilde_times_w", spy_combined)
    monkeypatch.setattr(optimizer, "_outer_gradients", spy_outer)
    generator = torch.Generator().manual_seed(4)
    for step in range(4):
        w = optimizer.w.clone()
        optimizer.step(features_closure(problem, torch.randint(0, 256, (problem.batch_size,), generator=generator)))
        y_bar, y_tilde = seen["Y_bar"], seen["Y_tilde"]
        former = (y_bar @ (w @ y_tilde)).double()  # the former features step (acc = the dtype here)
        size = (abs(y_bar).double() @ (abs(w).double() @ abs(y_tilde).double()))
        bound = 2 * gamma(FEATURES_TASKS + y_bar.shape[1] + 5, unit) * size
        error = (seen["cross"] - former).abs()
        assert bool((error <= bound).all()), f"step {step}: |cross - former| {error.tolist()} > {bound.tolist()}"
        w_former = project_simplex(w.double() - HP["pref_lr"] * (former + HP["rho"] * w.double()))
        w_bound = HP["pref_lr"] * float(torch.linalg.vector_norm(bound)) + 4 * FEATURES_TASKS * unit
        assert float((optimizer.w.double() - w_former).abs().max()) <= w_bound, f"step {step}: w_(t+1)"
    assert float(optimizer.w.min()) >= 0.0 and abs(float(optimizer.w.sum()) - 1.0) < 1e-5


@pytest.mark.parametrize("strategy", ["loop", "batched"])
def test_a_features_step_takes_2m_plus_1_passes_above_z(toy, monkeypatch, strategy: str) -> None:
    """Backward calls per step, by what they differentiate: above z, 2m + 1 task passes (loop: one per
    task of Y and Y_bar, one for Y_tilde^T w; batched: two vmapped passes and one plain one), where the
    three Jacobians took 3m (3 vmapped); the heads' pass (batched) and the lift through the trunk are
    one each.  Parameters mode keeps the paper's three Jacobians: 3m passes through the trunk."""
    calls: list[tuple[str, bool]] = []
    grad = torch.autograd.grad

    def counting(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        ids = {id(t) for t in ([inputs] if isinstance(inputs, Tensor) else inputs)}
        kind = "trunk" if id(problem.A) in ids else "z" if ids & z_ids else "heads" if ids == {id(problem.H)} else "?"
        cotangents = kwargs.get("grad_outputs")
        cotangents = [cotangents] if isinstance(cotangents, Tensor) else list(cotangents or [])
        vmapped = any(isinstance(t, Tensor) and torch._C._functorch.is_batchedtensor(t) for t in cotangents)
        calls.append((kind, vmapped or bool(kwargs.get("is_grads_batched", False))))
        return grad(outputs, inputs, *args, **kwargs)

    m = FEATURES_TASKS
    problem = toy(num_tasks=m)
    optimizer = features_optimizer(problem)
    optimizer.jacobian_strategy = strategy
    rows = torch.arange(problem.batch_size)
    closure = features_closure(problem, rows)
    z_ids = {id(closure()[1])}
    monkeypatch.setattr(torch.autograd, "grad", counting)
    optimizer.step(closure)
    monkeypatch.undo()
    above_z = [batched for kind, batched in calls if kind == "z"]
    if strategy == "loop":  # (the loop feeds the heads of role Y inside its passes)
        assert above_z == [False] * (2 * m + 1)
        assert [kind for kind, _ in calls].count("heads") == 0
    else:
        assert above_z == [True, True, False]
        assert [kind for kind, _ in calls].count("heads") == 1
    assert [kind for kind, _ in calls].count("trunk") == 1  # the lift: (dz/dtheta)^T (Y^T w)
    assert "?" not in [kind for kind, _ in calls]

    calls.clear()
    problem = toy(num_tasks=m)
    parameters = DoubleLoopMGDA(problem.shared, m, **HP, seed=3)
    z_ids = set()
    monkeypatch.setattr(torch.autograd, "grad", counting)
    parameters.step(problem.closure(0))
    monkeypatch.undo()
    assert [kind for kind, _ in calls].count("trunk") == 3 * m  # loop strategy (m <= 4 is not needed here)


@pytest.mark.parametrize("capturable", [False, True])
def test_a_non_finite_tilde_times_w_stops_the_step(toy, monkeypatch, capturable: bool) -> None:
    """A NaN/Inf in Y_tilde^T w stops the step, eagerly (NonFiniteStepError, nothing written) and when
    capturable (skipped on the device), also where it faces a zero column of Y_bar (z's unit k read by no
    head: 0 * Inf in the product is then the only way it could show)."""
    problem = toy(num_tasks=FEATURES_TASKS)
    with torch.no_grad():
        problem.H[0].zero_()  # z's first unit is read by no head: Y_bar's columns (b, 0) are zero
    optimizer = features_optimizer(problem, capturable=capturable)
    combined = optimizer._tilde_times_w

    def poisoned(losses: Tensor, cotangent: Tensor) -> Tensor:
        v = combined(losses, cotangent).clone()
        v[0] = float("inf")  # entry (b = 0, k = 0)
        return v

    monkeypatch.setattr(optimizer, "_tilde_times_w", poisoned)
    before = problem.snapshot()[:2] + [optimizer.w.clone(), optimizer.eta.clone()]
    closure = features_closure(problem, torch.arange(problem.batch_size))
    if capturable:
        optimizer.step(closure)
        assert int(optimizer.state["drmoo"]["skipped_steps"]) == 1
    else:
        with pytest.raises(NonFiniteStepError, match="Y_bar, Y_tilde"):
            optimizer.step(closure)
        assert optimizer.steps_taken == 0
    assert all(torch.equal(a, b) for a, b in zip(before, problem.snapshot()[:2] + [optimizer.w, optimizer.eta]))


@pytest.mark.parametrize("capturable", [False, True])
def test_a_non_finite_gradient_of_a_zero_weight_task_stops_the_features_step(toy, monkeypatch,
                                                                               capturable: bool) -> None:
    """A task with w_i = 0 whose gradient is NaN (|h| = sqrt(h^2) at h = 0: its derivative is 0 * Inf):
    the step stops (eager: raises, at Y's head gradients already; capturable: every check runs and the
    step is skipped), nothing is written, and the one pass for Y_tilde^T w carries the NaN too (0 * NaN
    through the zero cotangent), not only Y's checked rows."""
    problem = toy(num_tasks=FEATURES_TASKS)
    with torch.no_grad():
        problem.H[:, 4].zero_()  # task 4's output h = 0 on every sample
    rows = torch.arange(problem.batch_size)
    cached: dict[str, tuple[Tensor, Tensor]] = {}

    def closure() -> tuple[Tensor, Tensor]:
        if "batch" in cached and torch.is_grad_enabled():
            return cached["batch"]
        z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
        out = z @ problem.H
        losses = torch.cat([(out[:, :4] - problem.targets[rows, :4]) ** 2, torch.sqrt(out[:, 4:] ** 2)], dim=1)
        if torch.is_grad_enabled():
            cached["batch"] = (losses, z)
        return losses, z

    optimizer = features_optimizer(problem, capturable=capturable)
    with torch.no_grad():
        optimizer.w.copy_(torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0], dtype=optimizer.w.dtype))
    seen: list[Tensor] = []
    combined = optimizer._tilde_times_w

    def spy(losses: Tensor, cotangent: Tensor) -> Tensor:
        seen.append(combined(losses, cotangent).clone())
        return seen[-1]

    monkeypatch.setattr(optimizer, "_tilde_times_w", spy)
    before = problem.snapshot()[:2] + [optimizer.w.clone(), optimizer.eta.clone()]
    if capturable:
        optimizer.step(closure)
        assert int(optimizer.state["drmoo"]["skipped_steps"]) == 1
        assert len(seen) == 1 and not bool(torch.isfinite(seen[0]).all())
    else:
        with pytest.raises(NonFiniteStepError):
            optimizer.step(closure)
        assert optimizer.steps_taken == 0
    assert all(torch.equal(a, b) for a, b in zip(before, problem.snapshot()[:2] + [optimizer.w, optimizer.eta]))


def test_features_grad_scaler_gives_the_unscaled_step(toy) -> None:
    """A power-of-two loss scale is exact: with it, the heads' .grad are the unscaled ones times the scale
    and theta, w and eta move exactly as without it (Y_tilde^T w is divided back like the Jacobians)."""
    import drmoo

    results = []
    for scale in (None, 2.0**12):
        problem = toy(num_tasks=FEATURES_TASKS, dtype=torch.float32)
        balancer = drmoo.Balancer("double-loop", problem.shared, FEATURES_TASKS, jacobian="features", seed=3,
                                  lr=0.05, pref_lr=0.2, rho=1e-3, inner_steps=4, lam=0.6, dual_lr=0.2)
        scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
        rows = torch.arange(problem.batch_size)
        z = torch.tanh(problem.inputs[rows] @ problem.A + problem.c)
        losses = (z @ problem.H - problem.targets[rows]) ** 2
        balancer.backward(losses, features=z, scaler=scaler)
        divide = 1.0 if scale is None else scale
        results.append([problem.A.grad / divide, problem.c.grad / divide, problem.H.grad / divide,
                        balancer.w.clone(), balancer.eta.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
