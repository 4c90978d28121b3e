"""Issue 29, the compiled ops: a direct ``torch.ops.drmoo.*`` call is checked like the public API.

One table of hostile arguments goes through every path that reaches the ops -- each backend's Python
API (reference, cpp, triton where it runs) and the registered ops themselves, called directly with real
or ``meta`` tensors (the fake kernels) -- and every path must refuse it before anything is written, with
a message that names the cause:

* SW-13  a direct call that mixes a ``meta`` tensor with CPU tensors reached a fake kernel that checked
         nothing (uninitialized "weights", a skipped in-place update); the fakes accepted a 1-D or int64 J;
* SW-19  parameters that overlap (without being identical), or that share memory with J or w, and an
         eta that shares memory with w or the losses: updates applied twice or read after being written;
* SW-24  NaN / negative / infinite scalars, lr and mu tensors and sample weights, stride-0 targets, and a
         later bad parameter after earlier ones were already updated;
* U-6    errors from inside the stable-ABI kernels: "torch_call_dispatcher(...) API call failed" (torch
         2.11) or a C++ backtrace on stderr (2.14) instead of the cause; an allocation failure without a size.

Also SW-20 (the ops a closure calls inside ``step(closure)`` skipped their value checks) and SW-14
(divergence parameters where float32 computes something else; a NaN objective did not stop the step).
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from drmoo.optim import NonFiniteStepError, available, create
from drmoo_kernels import available_backends, backend_module, get_divergence, reference

BACKENDS = [name for name in ("reference", "cpp", "triton") if name in available_backends()]
HAS_CPP = "cpp" in available_backends()
# Every path into the ops: a backend's Python API, or the registered op called directly.
PATHS = [*BACKENDS, *(["torch.ops"] if HAS_CPP else [])]
CODES = {"chi2": 0, "kl": 1, "cvar_smooth": 2, "cressie_read": 3}


# ------------------------------------------------------------------------------------- arguments
def dual_args(**override: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    args: dict[str, Any] = {
        "losses": torch.rand(8, 3, generator=gen), "eta": torch.zeros(3), "w": torch.full((3,), 1 / 3),
        "lam": 0.6, "scale": 1.0, "divergence": "chi2", "gamma": 0.1, "f1": 1.0, "f2": 0.5, "sample_weight": None,
    }
    args.update(override)
    return args


def combine_args(**override: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    args: dict[str, Any] = {
        "J": torch.randn(3, 10, generator=gen), "w": torch.full((3,), 1 / 3),
        "params": [torch.zeros(4), torch.zeros(6)], "lr": 0.1,
    }
    args.update(override)
    return args


def gram_step_args(**override: Any) -> dict[str, Any]:
    args = combine_args()
    del args["lr"]
    args.update({"gamma": 0.1, "c1": 1.0, "c2": 0.5, "beta": 0.3, "rho": 1e-3, "mu": 0.5, "z": torch.ones(3)})
    args.update(override)
    return args


def _code_and_param(spec: str) -> tuple[int, float]:
    """The (code, param) a divergence spec stands for, without validating it (what a direct caller passes)."""
    match = re.fullmatch(r"([a-z_0-9]+)(?:\((.*)\))?", spec)
    assert match is not None
    return CODES[match.group(1)], float(match.group(2) or 0.0)


def _as_tensor(value: float | Tensor) -> Tensor:
    return value if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float64)


def call(path: str, op: str, args: dict[str, Any]) -> Any:
    """``op`` through ``path``: a backend's Python API, or ``torch.ops.drmoo.<op>`` with the schema's arguments."""
    a = args
    if path != "torch.ops":
        ops = backend_module(path)
        calls: dict[str, Callable[[], Any]] = {
            "dual_forward": lambda: ops.dual_forward(a["losses"], a["eta"], a["lam"], a["scale"], a["divergence"],
                                                     a["sample_weight"]),
            "dual_step": lambda: ops.dual_step(a["losses"], a["eta"], a["w"], a["lam"], a["scale"], a["divergence"],
                                               a["gamma"], a["f1"], a["f2"], a["sample_weight"]),
            "gram": lambda: ops.gram(a["J"]),
            "combine": lambda: ops.combine(a["J"], a["w"], a["params"], a["lr"]),
            "gram_step": lambda: ops.gram_step(a["J"], a["w"], a["params"], a["gamma"], a["c1"], a["c2"], a["beta"],
                                               a["rho"], a["mu"], a["z"]),
        }
        return calls[op]()
    backend_module("cpp")  # loads the extension and registers the fake kernels
    drmoo = torch.ops.drmoo
    if op in ("dual_forward", "dual_step"):
        code, param = _code_and_param(a["divergence"])
        if op == "dual_forward":
            return drmoo.dual_forward(a["losses"], a["eta"], a["lam"], a["scale"], code, param, a["sample_weight"])
        return drmoo.dual_step(a["losses"], a["eta"], a["w"], a["lam"], a["scale"], code, param, a["gamma"], a["f1"],
                               a["f2"], a["sample_weight"])
    if op == "gram":
        return drmoo.gram(a["J"])
    if op == "combine":
        return drmoo.combine(a["J"], a["w"], a["params"], _as_tensor(a["lr"]))
    return drmoo.gram_step(a["J"], a["w"], a["params"], a["gamma"], a["c1"], a["c2"], a["beta"], a["rho"],
                           _as_tensor(a["mu"]), a["z"])


WRITTEN = {"dual_forward": (), "dual_step": ("eta",), "gram": (), "combine": ("params",), "gram_step": ("w", "params")}


def written_tensors(op: str, args: dict[str, Any]) -> list[Tensor]:
    tensors: list[Tensor] = []
    for name in WRITTEN[op]:
        value = args[name]
        tensors.extend(value if isinstance(value, list) else [value])
    return tensors


def _snapshot(tensors: list[Tensor]) -> list[Tensor | None]:
    return [t.detach().clone() if t.device.type != "meta" else None for t in tensors]


# ---------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Case:
    defect: str
    name: str
    op: str
    build: Callable[[], dict[str, Any]]
    message: str  # a regex every path's message must match

    @property
    def id(self) -> str:
        return f"{self.defect}-{self.name}"


def _shared_buffer_params() -> dict[str, Any]:
    buffer = torch.zeros(12)
    return combine_args(params=[buffer[0:4], buffer[2:8]])  # 4 + 6 elements, elements 2 and 3 in both


def _param_in_j() -> dict[str, Any]:
    J = torch.randn(3, 10)
    return combine_args(J=J, params=[J[1, :4], torch.zeros(6)])


def _param_over_w() -> dict[str, Any]:
    buffer = torch.zeros(12)
    w = buffer[0:3]
    w.fill_(1 / 3)
    return combine_args(w=w, params=[buffer[2:6], torch.zeros(6)])


def _gram_step_param_over_z() -> dict[str, Any]:
    buffer = torch.ones(8)
    return gram_step_args(z=buffer[0:3], params=[buffer[1:5], torch.zeros(6)])


def _gram_step_w_in_j() -> dict[str, Any]:
    J = torch.randn(3, 10)
    return gram_step_args(J=J, w=J[0, :3])


def _eta_in_losses() -> dict[str, Any]:
    losses = torch.rand(8, 3)
    return dual_args(losses=losses, eta=losses[2])


def _eta_is_w() -> dict[str, Any]:
    w = torch.full((3,), 1 / 3)
    return dual_args(eta=w, w=w)


def _weights(bad: float) -> dict[str, Any]:
    weights = torch.ones(8, 3)
    weights[5, 1] = bad
    return {"sample_weight": weights}


def _meta(args: dict[str, Any], *names: str) -> dict[str, Any]:
    for name in names:
        value = args[name]
        args[name] = [t.to("meta") for t in value] if isinstance(value, list) else value.to("meta")
    return args


NAN, INF = float("nan"), float("inf")
CASES = [
    # SW-13: a meta tensor among CPU ones reached a fake kernel that checked nothing.
    Case("SW13", "meta-losses", "dual_forward", lambda: _meta(dual_args(), "losses"), "on meta"),
    Case("SW13", "meta-eta", "dual_step", lambda: _meta(dual_args(), "eta"), "on meta|is on cpu but"),
    Case("SW13", "meta-weights", "dual_forward", lambda: _meta(dual_args(**_weights(1.0)), "sample_weight"),
         "on meta|is on cpu but"),
    Case("SW13", "meta-param", "combine", lambda: _meta(combine_args(), "params"), "on meta|is on cpu but"),
    Case("SW13", "meta-J", "gram_step", lambda: _meta(gram_step_args(), "J"), "on meta"),
    Case("SW13", "meta-1d-J", "gram", lambda: {"J": torch.ones(10, device="meta")},
         r"J must be the \[m, n\] per-task gradient matrix"),
    Case("SW13", "meta-int64-J", "gram", lambda: {"J": torch.ones(3, 10, dtype=torch.int64, device="meta")},
         "J must be float32, float64, float16 or bfloat16"),
    Case("SW13", "all-meta-bad-eta-shape", "dual_forward",
         lambda: _meta(dual_args(eta=torch.zeros(4)), "losses", "eta"),
         r"eta must have shape \[3\]|'cpp' backend runs on cpu tensors, but losses is on meta"),
    # SW-19: memory shared where the op writes.
    Case("SW19", "overlapping-params", "combine", _shared_buffer_params,
         r"params\[1\] and params\[0\] share memory"),
    Case("SW19", "overlapping-params", "gram_step", lambda: gram_step_args(params=_shared_buffer_params()["params"]),
         r"params\[1\] and params\[0\] share memory"),
    Case("SW19", "param-in-J", "combine", _param_in_j, r"params\[0\] shares memory with J"),
    Case("SW19", "param-over-w", "combine", _param_over_w, r"params\[0\] shares memory with w"),
    Case("SW19", "param-over-z", "gram_step", _gram_step_param_over_z, r"params\[0\] shares memory with z"),
    Case("SW19", "w-in-J", "gram_step", _gram_step_w_in_j, "w shares memory with J"),
    Case("SW19", "eta-in-losses", "dual_step", _eta_in_losses, "eta shares memory with losses"),
    Case("SW19", "eta-is-w", "dual_step", _eta_is_w, "eta shares memory with w"),
    # SW-24: values.
    *[Case("SW24", f"{name}-{value}", "dual_forward", lambda name=name, value=value: dual_args(**{name: value}),
           rf"drmoo\.dual_forward: {name} must be finite and > 0")
      for name in ("lam", "scale") for value in (NAN, -1.0, INF)],
    *[Case("SW24", f"{name}-{value}", "dual_step", lambda name=name, value=value: dual_args(**{name: value}),
           rf"drmoo\.dual_step: {name} must be finite and >=? 0")
      for name in ("gamma", "f1", "f2") for value in (NAN, -1.0)],
    *[Case("SW24", f"{name}-{value}", "gram_step", lambda name=name, value=value: gram_step_args(**{name: value}),
           rf"drmoo\.gram_step: {name} must be finite and >=? 0")
      for name in ("gamma", "c1", "c2", "beta", "rho") for value in (NAN, -1.0)],
    *[Case("SW24", f"mu-tensor-{value}", "gram_step", lambda value=value: gram_step_args(mu=torch.tensor(value)),
           r"drmoo\.gram_step: mu must be finite and >= 0") for value in (NAN, -1.0)],
    *[Case("SW24", f"lr-tensor-{value}", "combine", lambda value=value: combine_args(lr=torch.tensor(value)),
           r"drmoo\.combine: lr must be finite and >= 0") for value in (NAN, -1.0, INF)],
    *[Case("SW24", f"sample-weight-{value}", op, lambda value=value: dual_args(**_weights(value)),
           rf"drmoo\.{op}: sample_weight \(importance weights\) must be finite and >= 0")
      for op in ("dual_forward", "dual_step") for value in (NAN, -1.0, INF)],
    Case("SW24", "stride0-eta", "dual_step", lambda: dual_args(eta=torch.zeros(1).expand(3)),
         "eta is written in place, but several of its elements share memory"),
    Case("SW24", "stride0-w", "gram_step", lambda: gram_step_args(w=torch.full((1,), 1 / 3).expand(3)),
         "w is written in place, but several of its elements share memory"),
    # A later parameter that cannot be written: the earlier one must not be updated either.
    Case("SW24", "later-stride0-param", "combine",
         lambda: combine_args(params=[torch.zeros(4), torch.zeros(1).expand(6)]),
         r"params\[1\] is written in place, but several of its elements share memory"),
    Case("SW24", "later-stride0-param", "gram_step",
         lambda: gram_step_args(params=[torch.zeros(4), torch.zeros(1).expand(6)]),
         r"params\[1\] is written in place, but several of its elements share memory"),
    Case("SW24", "lr-on-meta", "combine", lambda: combine_args(lr=torch.tensor(0.1, device="meta")),
         "lr is on meta but the other inputs are on cpu|on meta"),
    # SW-14: divergence parameters outside the range where float32 keeps their meaning.
    *[Case("SW14", spec, "dual_forward", lambda spec=spec: dual_args(divergence=spec), message)
      for spec, message in [("cressie_read(1.00000001)", "need 1.001 <= k <= 10000"),
                            ("cressie_read(1e308)", "need 1.001 <= k <= 10000"),
                            ("cvar_smooth(1e-40)", "need 1e-06 <= alpha < 1")]],
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.id}-{case.op}")
def test_every_path_refuses_before_writing_and_names_the_cause(
    case: Case, path: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each hostile call is refused by every backend and by the op itself, with the same cause, before
    anything is written; a direct call prints no C++ backtrace and never reads "API call failed" (U-6)."""
    args = case.build()
    targets = written_tensors(case.op, args)
    before = _snapshot(targets)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=case.message) as info:
        call(path, case.op, args)
    message = str(info.value)
    assert "API call failed" not in message and "torch_call_dispatcher" not in message
    assert "\n" not in message.strip(), message
    assert "frame #" not in capfd.readouterr().err
    for target, saved in zip(targets, before):
        if saved is not None:
            assert torch.equal(target, saved), f"{case.op} wrote {target} before refusing"


# --------------------------------------------------------------------- what must still be accepted
def test_the_fake_kernels_still_answer_for_valid_meta_arguments() -> None:
    """SW-13's checks refuse only what is wrong: all-meta arguments get outputs of the right shapes."""
    if not HAS_CPP:
        pytest.skip("the compiled ops are not available")
    objective, z, weights = call("torch.ops", "dual_forward", _meta(dual_args(), "losses", "eta"))
    assert objective.shape == (3,) and z.shape == (3,) and weights.shape == (8, 3) and weights.device.type == "meta"
    gram, d_norm, alpha = call("torch.ops", "gram_step", _meta(gram_step_args(mu=torch.tensor(0.5)), "J", "w", "z",
                                                               "params"))
    assert gram.shape == (3, 3) and d_norm.shape == () and alpha.shape == ()
    call("torch.ops", "combine", _meta(combine_args(), "J", "w", "params"))


@pytest.mark.parametrize("path", PATHS)
def test_disjoint_views_of_one_buffer_and_a_cpu_lr_are_accepted(path: str) -> None:
    """SW-19's rule refuses shared memory only: parameters that are disjoint slices of one buffer are fine."""
    # Triton compiles for the GPU where there is one (then only the interpreter, on CPU-only machines, takes
    # CPU tensors): the parameters and J go there; lr stays a CPU tensor either way.
    device = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    buffer = torch.zeros(10, device=device)
    cpu_args = combine_args()
    args = combine_args(J=cpu_args["J"].to(device), w=cpu_args["w"].to(device), params=[buffer[0:4], buffer[4:10]],
                        lr=torch.tensor(0.1))
    call(path, "combine", args)
    expected = -0.1 * (cpu_args["w"] @ cpu_args["J"])
    assert torch.allclose(buffer.cpu(), expected, atol=1e-6)


# ------------------------------------------------------------------------------------------ U-6
def test_u6_a_failed_allocation_names_its_size(capfd: pytest.CaptureFixture[str]) -> None:
    """The CPU kernels' allocation failure said only "allocating a CPU tensor failed"; it now names the shape
    and the bytes.  (A J of 2^24 rows, all one stride-0 row: its 2^24 x 2^24 Gram needs 1 PiB.)"""
    if not HAS_CPP:
        pytest.skip("the compiled ops are not available")
    rows = 2**24
    with pytest.raises(RuntimeError, match=rf"allocating a CPU tensor of shape \[{rows}, {rows}\] \(Float, "
                                           rf"{rows * rows * 4} bytes\) failed"):
        call("torch.ops", "gram", {"J": torch.zeros(1, 1).expand(rows, 1)})
    assert "frame #" not in capfd.readouterr().err


def test_u6_a_copy_that_cannot_be_allocated_names_its_size(capfd: pytest.CaptureFixture[str]) -> None:
    """The kernels' own copies (non-contiguous losses, J or parameters) went through torch's dispatcher,
    whose allocation failure read "torch_call_dispatcher(...) API call failed" under torch 2.11 and came
    behind a C++ backtrace under 2.14.  (Losses of 2^45 rows, one stride-0 row: a copy of 384 TiB, more
    than any address space.)"""
    if not HAS_CPP:
        pytest.skip("the compiled ops are not available")
    rows = 2**45
    losses = torch.zeros(1, 3).expand(rows, 3)
    with pytest.raises(RuntimeError, match=rf"allocating a CPU tensor of shape \[{rows}, 3\] \(Float, "
                                           rf"{rows * 12} bytes\) failed") as info:
        torch.ops.drmoo.dual_forward(losses, torch.zeros(3), 1.0, 1.0, 0, 0.0, None)
    assert "API call failed" not in str(info.value)
    assert "frame #" not in capfd.readouterr().err


# ----------------------------------------------------------------------------------------- SW-20
@pytest.mark.parametrize("backend", [name for name in ("reference", "cpp") if name in BACKENDS])
@pytest.mark.parametrize(
    "hostile",
    ["negative-sample-weights", "overlapping-params"],
)
def test_sw20_ops_called_by_the_closure_inside_step_check_their_arguments(toy, backend: str, hostile: str) -> None:
    """The optimizer trusts its own op calls (they skip the host reads), but that trust covered the user's
    closure too: ops it called accepted negative importance weights.  Now they are refused, and the step
    changes nothing."""
    problem = toy(dtype=torch.float32)
    optimizer = create("mgda", problem.shared, 3, backend=backend)
    ops = backend_module(backend)
    draw = problem.batches(1)
    before = problem.snapshot()

    def closure() -> Tensor:
        losses = problem.losses(draw())
        if hostile == "negative-sample-weights":
            ops.dual_forward(losses.detach(), torch.zeros(3), 1.0, 1.0, "chi2", -torch.ones_like(losses))
        else:
            call(backend, "combine", _shared_buffer_params())
        return losses

    message = "sample_weight .* must be finite and >= 0" if hostile.startswith("negative") else "share memory"
    with pytest.raises(ValueError, match=message):
        optimizer.step(closure)
    for got, want in zip(problem.snapshot(), before):
        assert torch.equal(got, want)


def test_sw20_the_optimizers_own_op_calls_stay_trusted(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The closure's calls are checked again, the optimizer's own are not: its step still reads no tensor
    value for the ops' checks (no host synchronisation added to a step)."""
    from drmoo_kernels import _checks

    problem = toy()
    optimizer = create("double-clip", problem.shared, 3, backend="reference")
    readable: list[bool] = []
    original = _checks._values_readable
    monkeypatch.setattr(_checks, "_values_readable", lambda tensor: readable.append(original(tensor)) or readable[-1])
    draw = problem.batches(1)
    closure_calls = []

    def closure() -> tuple[Tensor, Tensor]:
        rows = draw()
        losses = problem.losses(rows)
        reference.dual_forward(losses.detach(), torch.zeros(3, dtype=losses.dtype), 1.0, 1.0, "chi2",
                               torch.ones_like(losses))
        closure_calls.append(1)
        return losses, torch.ones(len(rows), 3, dtype=torch.float64)

    optimizer.step(closure)
    # One allowed read per closure call (its own dual_forward's weights); every read the step's own op
    # calls asked for (sample weights, mu) was declined.
    assert closure_calls and readable.count(True) == len(closure_calls)
    assert readable.count(False) >= 1


# ----------------------------------------------------------------------------------------- SW-14
@pytest.mark.parametrize(
    "spec",
    ["cressie_read(1.00000001)", "cressie_read(1.0005)", "cressie_read(1e308)", "cressie_read(20000)",
     "cvar_smooth(1e-40)", "cvar_smooth(1e-7)"],
)
def test_sw14_divergence_parameters_outside_the_float32_range_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="float32 loses its meaning"):
        get_divergence(spec)
    if HAS_CPP:
        code, param = _code_and_param(spec)
        with pytest.raises(RuntimeError, match="float32 loses its meaning"):
            torch.ops.drmoo.dual_forward(torch.rand(4, 2), torch.zeros(2), 1.0, 1.0, code, param, None)


@pytest.mark.parametrize(
    ("spec", "tolerance"),
    [("cressie_read(1.001)", 1e-4), ("cressie_read(10000)", 1e-6), ("cvar_smooth(1e-6)", 1e-5),
     ("cvar_smooth(0.999999)", 1e-6)],
)
@pytest.mark.parametrize("backend", [name for name in ("reference", "cpp") if name in BACKENDS])
def test_sw14_at_the_ends_of_the_range_float32_agrees_with_float64(spec: str, tolerance: float, backend: str) -> None:
    """The bounds are where float32 still computes the divergence: weights within ``tolerance`` (relative)
    of float64 and a non-trivial objective (cressie_read(1 + 1e-8) gave plain ERM: objective 0, weights 1)."""
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(512, 3, generator=gen) * 4
    eta = torch.tensor([0.5, 1.0, 2.0])
    divergence = get_divergence(spec)
    want_objective, _, want_weights = reference.dual_forward(losses.double(), eta.double(), 1.0, 1.0, divergence)
    objective, _, weights = backend_module(backend).dual_forward(losses, eta, 1.0, 1.0, divergence)
    error = (weights.double() - want_weights).abs()
    relative = torch.where(want_weights == 0, error, error / want_weights.abs()).max()  # 0: cressie's clamp
    assert float(relative) < tolerance
    assert torch.allclose(objective.double(), want_objective, rtol=1e-5)
    assert bool((want_objective.abs() > 1.0).all())


@pytest.mark.parametrize("method", sorted(available()))
def test_sw14_a_non_finite_objective_is_a_non_finite_step(toy, method: str) -> None:
    """The dual objective came back NaN while the weights stayed finite, and training went on with
    ``dual_objective nan``: now every method abandons such a step with NonFiniteStepError, changing nothing."""
    problem = toy()
    optimizer = create(method, problem.shared, 3, backend="reference")
    real = optimizer._ops

    def nan_objective(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
        objective, z, weights = real.dual_forward(*args, **kwargs)
        return torch.full_like(objective, math.nan), z, weights

    optimizer._ops = types.SimpleNamespace(**{name: getattr(real, name) for name in
                                              ("dual_step", "gram", "combine", "gram_step")},
                                           dual_forward=nan_objective)
    before = problem.snapshot()
    w_before, eta_before = optimizer.w.clone(), optimizer.eta.clone()
    with pytest.raises(NonFiniteStepError):
        optimizer.step(problem.closure(1))
    for got, want in zip(problem.snapshot(), before):
        assert torch.equal(got, want)
    assert torch.equal(optimizer.w, w_before) and torch.equal(optimizer.eta, eta_before)
