"""Griffe extension: the API page shows each `drmoo.Balancer` overload with its method's real defaults.

The overloads (one per method, for the type checkers) write their hyperparameters' defaults as ``...``:
the default lives in the method's class (``lam`` is 0.8 for every method, ``pref_lr`` differs between
them), and repeating it there would be a second copy to keep in step.  At build time this extension reads
each overload's ``method`` literal, takes that class from ``drmoo.optim.available()`` and writes the
class's default in place of every ``...`` of the overload, so the page says ``pref_lr: float = 0.1``
where the source says ``pref_lr: float = ...``.  A parameter the class does not have keeps ``...``.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe

_PLACEHOLDER = "..."


def method_defaults(method: str) -> dict[str, str]:
    """The defaults of method ``method``'s optimizer class, as source text (``repr``), by parameter name."""
    import drmoo.optim  # at build time, from the checkout's python/ (mkdocs.yml: paths)

    signature = inspect.signature(drmoo.optim.available()[method].__init__)
    return {name: repr(parameter.default) for name, parameter in signature.parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def fill_overload_defaults(function: griffe.Function) -> None:
    """Replace the ``...`` defaults of each overload of ``function`` (``Balancer.__init__``) by its method's."""
    for overload in function.overloads or []:
        method = next((p for p in overload.parameters if p.name == "method"), None)
        literal = getattr(method.annotation, "slice", None) if method is not None else None
        if literal is None:
            continue
        defaults = method_defaults(str(literal).strip("'\""))
        for parameter in overload.parameters:
            if parameter.default == _PLACEHOLDER and parameter.name in defaults:
                parameter.default = defaults[parameter.name]


class OverloadDefaults(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "drmoo":
            fill_overload_defaults(pkg["balancer"]["Balancer"]["__init__"])
