"""DoubleLoopMGDA against a plain, step-by-step transcription of the paper's Algorithm 1."""

from __future__ import annotations

import io
import random

import pytest
import torch
from torch import Tensor

from drmoo.optim import DoubleLoopMGDA

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
