"""f-divergences for the DRO dual: the conjugate f* and its derivative f*' in one place.

The regularized f-divergence DRO objective of a task, in its dual form (paper eq. 4-5), is

    L(theta, eta) = lam * E[ f*((loss - s*eta) / lam) ] + s*eta

so a divergence enters the library only through f* (the objective) and f*' (the per-sample weights
of the worst-case distribution, and hence every gradient).  The primal f is kept as well: the tests
check the Fenchel-Young inequality f(t) + f*(u) >= t*u against it.

Every formula here is the pure-torch *reference*; fused kernels must reproduce it.  Kernels select a
divergence by its integer ``code`` and a single float ``param`` (see ``Divergence.code``).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DIVERGENCE_NAMES", "Divergence", "divergence_from_code", "get_divergence"]


# The conjugates are written without cancellation near u = 0, where they vanish: the dual objective is
# lam * f*(u) with u = (loss - s eta) / lam, so at a large lam (a small ball) f*(u) ~ u must keep u's own
# relative precision.  Written as "something near 1, minus 1" -- 0.25 (u + 2)^2 - 1, a power of 1 + (k - 1) u
# minus 1, a log-sum-exp that is log(1) at u = 0 -- it kept an absolute error of one rounding of 1, and
# lam times that: in float32 the objective was 0 for every loss at lam = 1e8 (chi2, Cressie-Read) and off
# by a factor 6 (cvar_smooth).  Each form below has a relative error of a few roundings at every u.
def _chi2_conj(u: Tensor, _: float) -> Tensor:
    # 0.25 (u + 2)^2 - 1 = u (1 + u / 4) for u >= -2, and -1 below (the clamp keeps NaN).
    v = torch.clamp(u, min=-2.0)
    return v * (1.0 + 0.25 * v)


def _chi2_conj_grad(u: Tensor, _: float) -> Tensor:
    return 0.5 * torch.clamp(u + 2.0, min=0.0)


def _chi2_primal(t: Tensor, _: float) -> Tensor:
    return (t - 1.0) ** 2


def _kl_conj(u: Tensor, _: float) -> Tensor:
    return torch.expm1(u)


def _kl_conj_grad(u: Tensor, _: float) -> Tensor:
    return torch.exp(u)


def _kl_primal(t: Tensor, _: float) -> Tensor:
    return torch.xlogy(t, t) - t + 1.0


# Within [-CVAR_NEAR_U, CVAR_NEAR_U], cvar_smooth's conjugate is log1p(alpha * expm1(u)) / alpha: there
# 1 + alpha expm1(u) >= 1 - (1 - 1/e) > 0.36 for every alpha < 1, so neither the sum nor its log cancels, and
# expm1 cannot overflow.  Outside, the log-sum-exp form, whose value is then far from 0.  (Below the window
# the log1p form would cancel for alpha near 1: 1 + alpha expm1(-30) is 1e-6 at alpha = 0.999999.)
CVAR_NEAR_U = 1.0


def _cvar_conj(u: Tensor, alpha: float) -> Tensor:
    # (1/alpha) * log(1 - alpha + alpha*e^u).  Far from 0: a log-sum-exp, so that it never overflows,
    # log((1-alpha) + alpha*e^u) = logaddexp(log(1-alpha), log(alpha) + u); near 0, where that sum is log(1)
    # up to a rounding, log1p(alpha * expm1(u)).  NaN takes the log-sum-exp branch and stays NaN.
    near = u.abs() <= CVAR_NEAR_U
    inside = torch.where(near, u, torch.zeros_like(u))  # not clamp: its gradient is 0 at the window's edge
    small = torch.log1p(alpha * torch.expm1(inside)) / alpha
    large = torch.logaddexp(torch.full_like(u, math.log1p(-alpha)), u + math.log(alpha)) / alpha
    return torch.where(near, small, large)


def _cvar_conj_grad(u: Tensor, alpha: float) -> Tensor:
    # e^u / (1 - alpha + alpha e^u) = sigmoid(u + log(alpha/(1-alpha))) / alpha, overflow-free.
    return torch.sigmoid(u + math.log(alpha / (1.0 - alpha))) / alpha


def _cvar_primal(t: Tensor, alpha: float) -> Tensor:
    # Smoothed CVaR (Jin et al. 2021): t log t + (1 - alpha t)/alpha * log((1 - alpha t)/(1 - alpha))
    # on 0 <= t <= 1/alpha, +inf outside.
    rest = 1.0 - alpha * t
    value = torch.xlogy(t, t) + torch.xlogy(rest, rest / (1.0 - alpha)) / alpha
    outside = (t < 0) | (rest < 0)
    return torch.where(outside, torch.full_like(t, math.inf), value)


def _cressie_conj(u: Tensor, k: float) -> Tensor:
    # (base^(k/(k-1)) - 1) / k with base = max(1 + (k - 1) u, 0), as expm1(k/(k-1) * log1p((k - 1) u)) / k,
    # and -1/k where base is 0.  The log is taken of a stand-in 0 there, so that neither the value nor its
    # gradient meets log1p(-1) = -inf (NaN is not <= -1: it stays NaN).
    # exp(y) - 1 where y < -1/2 has no cancellation, and its gradient exp(y) keeps its digits near the floor
    # (expm1's backward forms expm1(y) + 1 there).
    x = (k - 1.0) * u
    edge = x <= -1.0
    inside = torch.where(edge, torch.zeros_like(x), x)
    y = (k / (k - 1.0)) * torch.log1p(inside)
    power_minus_one = torch.where(y < -0.5, torch.exp(y) - 1.0, torch.expm1(y))
    return torch.where(edge, torch.full_like(x, -1.0 / k), power_minus_one / k)


def _cressie_conj_grad(u: Tensor, k: float) -> Tensor:
    base = torch.clamp((k - 1.0) * u + 1.0, min=0.0)
    return base ** (1.0 / (k - 1.0))


def _cressie_primal(t: Tensor, k: float) -> Tensor:
    value = (t**k - k * t + k - 1.0) / (k * (k - 1.0))
    return torch.where(t < 0, torch.full_like(t, math.inf), value)


# Parameter ranges where the float32 kernels keep the divergence's meaning (csrc/checks.h holds the
# same numbers).  Outside them float32 silently computes something else:
# * cvar_smooth: the weights sigmoid(u + log(alpha / (1 - alpha))) / alpha need 1/alpha and alpha
#   itself as normal float32 numbers with room for u below 0; at alpha = 1e-40 every weight was 0.
#   From 1e-6 on, the float32 weights stay within 5e-6 (relative) of float64 for |u| <= 60.
# * cressie_read: the base 1 + (k - 1) u of f*' = base^(1/(k-1)) is rounded to float32 (relative
#   error 6e-8), and the power multiplies that error by 1/(k - 1): k - 1 >= 1e-3 keeps the weights
#   within 6e-5 of their float64 values, while k = 1 + 1e-8 rounds the base to 1 (plain ERM:
#   objective 0, weights 1).  Above k = 1e4 the exponent 1/(k-1) < 1e-4 leaves the weights within
#   1e-3 of 1 for any float32 base, and (k - 1) u overflows long before k = 1e308 (NaN there).
CVAR_ALPHA_MIN = 1e-6
CRESSIE_K_MIN = 1.001
CRESSIE_K_MAX = 1e4


@dataclass(frozen=True)
class _Family:
    code: int
    conj: Callable[[Tensor, float], Tensor]
    conj_grad: Callable[[Tensor, float], Tensor]
    primal: Callable[[Tensor, float], Tensor]
    param_name: str | None
    default_param: float
    param_rule: str
    param_ok: Callable[[float], bool]


_FAMILIES: dict[str, _Family] = {
    "chi2": _Family(0, _chi2_conj, _chi2_conj_grad, _chi2_primal, None, 0.0, "", lambda _: True),
    "kl": _Family(1, _kl_conj, _kl_conj_grad, _kl_primal, None, 0.0, "", lambda _: True),
    "cvar_smooth": _Family(
        2, _cvar_conj, _cvar_conj_grad, _cvar_primal, "alpha", 0.1,
        "1e-06 <= alpha < 1 (the divergence needs 0 < alpha < 1; below 1e-06 float32 loses its meaning)",
        lambda a: CVAR_ALPHA_MIN <= a < 1.0,
    ),
    "cressie_read": _Family(
        3, _cressie_conj, _cressie_conj_grad, _cressie_primal, "k", 2.0,
        "1.001 <= k <= 10000 (the divergence needs k > 1; outside this range float32 loses its meaning)",
        lambda k: CRESSIE_K_MIN <= k <= CRESSIE_K_MAX,
    ),
}

DIVERGENCE_NAMES: tuple[str, ...] = tuple(_FAMILIES)
_VALID = "chi2, kl, cvar_smooth(alpha) with 1e-06 <= alpha < 1, cressie_read(k) with 1.001 <= k <= 10000"


@dataclass(frozen=True)
class Divergence:
    """One f-divergence: ``name`` among :data:`DIVERGENCE_NAMES` and its single parameter.

    Args:
        name: one of :data:`DIVERGENCE_NAMES`.
        param: alpha for ``cvar_smooth``, k for ``cressie_read``; unused (0.0) otherwise.
    """

    name: str
    param: float = 0.0

    def __post_init__(self) -> None:
        family = _FAMILIES.get(self.name)
        if family is None:
            raise ValueError(f"unknown divergence {self.name!r}; valid choices: {_VALID}")
        # The parameter is kept as the float it was checked as: text such as "0.2" would pass float() here and
        # then reach the kernels and str() as text.
        if isinstance(self.param, bool) or not isinstance(self.param, numbers.Real):
            raise ValueError(f"the parameter of divergence {self.name!r} must be a number, got {self.param!r}")
        object.__setattr__(self, "param", float(self.param))
        if family.param_name is not None and not family.param_ok(self.param):
            raise ValueError(
                f"invalid {family.param_name}={self.param!r} for divergence {self.name!r}: "
                f"need {family.param_rule}"
            )

    @property
    def code(self) -> int:
        """Integer id the compiled kernels switch on (0 chi2, 1 kl, 2 cvar_smooth, 3 cressie_read)."""
        return _FAMILIES[self.name].code

    def conj(self, u: Tensor) -> Tensor:
        r""":math:`f^*(u)`, the convex conjugate.

        Args:
            u: any tensor; the result has its shape.
        """
        return _FAMILIES[self.name].conj(u, self.param)

    def conj_grad(self, u: Tensor) -> Tensor:
        r""":math:`f^{*\prime}(u) \ge 0`: the density ratio of the worst-case distribution at :math:`u`.

        Args:
            u: any tensor; the result has its shape.
        """
        return _FAMILIES[self.name].conj_grad(u, self.param)

    def primal(self, t: Tensor) -> Tensor:
        """:math:`f(t)`, +inf outside its domain.

        Args:
            t: any tensor; the result has its shape.
        """
        return _FAMILIES[self.name].primal(t, self.param)

    def __str__(self) -> str:
        family = _FAMILIES[self.name]
        return self.name if family.param_name is None else f"{self.name}({self.param:g})"


# name, or name(value), or name(keyword=value): groups name, keyword (None when absent), value ("" when empty).
_CALL_SYNTAX = re.compile(r"^\s*([a-z_0-9]+)\s*(?:\(\s*(?:([a-z_]+)\s*=\s*)?([^)]*?)\s*\))?\s*$")


def get_divergence(spec: str | Divergence, param: float | None = None) -> Divergence:
    """Look a divergence up by name.

    Accepts a :class:`Divergence`, a bare name (``"chi2"``, ``"cvar_smooth"`` with its default
    parameter) or a call-like string (``"cvar_smooth(0.2)"``, ``"cressie_read(k=3)"``); ``param``
    overrides the parameter.  Unknown names and invalid parameters raise ``ValueError`` listing the
    valid choices.

    Args:
        spec: a :class:`Divergence`, a name or a call-like string.
        param: the divergence's parameter, overriding the one ``spec`` gives (None = keep it).
    """
    if isinstance(spec, Divergence):
        return spec if param is None else Divergence(spec.name, float(param))
    if not isinstance(spec, str):
        raise ValueError(f"divergence must be a name or a Divergence, got {type(spec).__name__}; "
                         f"valid choices: {_VALID}")
    match = _CALL_SYNTAX.match(spec.lower())
    if match is None:
        raise ValueError(f"cannot parse divergence {spec!r}; valid choices: {_VALID}")
    name, keyword, text_param = match.group(1), match.group(2), match.group(3)
    family = _FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown divergence {spec!r}; valid choices: {_VALID}")
    if family.param_name is None:
        if keyword is not None or text_param or param is not None:
            raise ValueError(f"divergence {name!r} takes no parameter, got {spec!r}"
                             + ("" if param is None else f" with param={param!r}"))
        return Divergence(name)
    if keyword is not None and keyword != family.param_name:
        raise ValueError(f"divergence {name!r} takes {family.param_name}, not {keyword}: got {spec!r}")
    if keyword is not None and not text_param:
        raise ValueError(f"divergence {spec!r} gives {keyword}= no value")
    if param is None and text_param:
        try:
            param = float(text_param)
        except ValueError:
            raise ValueError(f"cannot parse the parameter of divergence {spec!r}") from None
    if param is None:
        param = family.default_param
    if isinstance(param, bool) or not isinstance(param, numbers.Real):
        raise ValueError(f"the parameter of divergence {name!r} must be a number, got {param!r}")
    return Divergence(name, float(param))


_NAMES_BY_CODE = {family.code: name for name, family in _FAMILIES.items()}


def divergence_from_code(code: int, param: float) -> Divergence:
    """The divergence the compiled ops' ``(code, param)`` arguments stand for; ValueError if there is none
    (an unknown code, or a parameter outside its range)."""
    name = _NAMES_BY_CODE.get(code) if isinstance(code, int) else None
    if name is None:
        raise ValueError(f"unknown divergence code {code!r} (0 chi2, 1 kl, 2 cvar_smooth, 3 cressie_read)")
    return Divergence(name, float(param) if _FAMILIES[name].param_name is not None else 0.0)
