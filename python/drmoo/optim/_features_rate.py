"""The features-mode caveat at run time: a rate chosen for parameters mode is not one for features mode
in the methods whose theta step length reads the Gram's scale.

``jacobian="features"`` takes the per-task gradients w.r.t. the representation z, and J_z's scale is
not J_theta's.  The methods that move theta by the exact gradient of sum_i c_i L^i (MGDA unclipped,
MoDo, SDMGrad, Double-Loop, FAMO) only compute the weights c_i from z, and their ``lr`` carries
over.  Three read a norm of the Gram in theta's step length, so their ``lr`` means another step there:

* Double-Clip: theta's clip alpha = min(c1, c2 / ||J_z^T w||);
* Nash-MTL: its weights scale as 1 / ||g_i|| (gradients w.r.t. z, far smaller) and its clip reads
  the z norm;
* MGDA with ``clip_c1`` / ``clip_c2``: Double-Clip's clip.

(The preference update w <- w - pref_lr * K w of MGDA's one-step solver, MoDo, SDMGrad without
``normalize``, Double-Loop and Double-Clip reads the Gram's scale too; it moves w, not theta, and at
the benchmarks' pref_lr the weights stayed near uniform in both modes: no warning for it.)

On the 2-digit small benchmark, at the parameters-mode rates Double-Clip lost 8-18 points and
Nash-MTL did not train; their rates chosen again in features mode were a tenth of the parameters-mode
ones.  Hence a :class:`FeaturesRateWarning`, once per method and process, when one of them is built
in features mode without ``features_rate_chosen=True`` (or the warning filtered:
``warnings.filterwarnings("ignore", category=drmoo.optim.FeaturesRateWarning)``).
"""

from __future__ import annotations

import warnings
from typing import Any

from drmoo._caller import user_stacklevel

__all__ = ["FeaturesRateWarning", "warn_unless_rate_chosen"]


class FeaturesRateWarning(UserWarning):
    """A method whose theta step length reads the Gram's scale (Double-Clip, Nash-MTL, MGDA with
    ``clip_c1``/``clip_c2``) runs with ``jacobian="features"`` at a rate not said to be chosen for it.

    Silence it by choosing ``lr`` for features mode and passing ``features_rate_chosen=True`` (to the
    optimizer class or :class:`drmoo.Balancer`), or with
    ``warnings.filterwarnings("ignore", category=drmoo.optim.FeaturesRateWarning)``.
    """


# Issued once per method class and process: a training loop builds its optimizer once, a sweep many times.
_warned: set[str] = set()


def warn_unless_rate_chosen(optimizer: Any, jacobian: str, why: str | None, chosen: bool) -> bool:
    """Warn (once per class) when ``optimizer`` runs in features mode with a theta step length that reads
    the Gram's scale (``why`` says how; None: it does not) and ``chosen`` is False.

    Returns ``chosen`` checked as a flag (a string such as "false" is refused).
    """
    if not isinstance(chosen, bool):
        raise ValueError(f"features_rate_chosen must be True or False, got {chosen!r}")
    name = type(optimizer).__name__
    if jacobian != "features" or why is None or chosen or name in _warned:
        return chosen
    _warned.add(name)
    warnings.warn(
        f"{name} with jacobian='features': {why}, so theta's step length is read in z's scale and an lr "
        f"chosen for parameters mode is another step here (on the 2-digit benchmark, at the parameters-mode "
        f"rates Double-Clip lost 8-18 points and Nash-MTL did not train; a tenth of the rate was chosen in "
        f"features mode). Choose lr for features mode, then pass features_rate_chosen=True to silence this.",
        FeaturesRateWarning, stacklevel=user_stacklevel(),
    )
    return chosen
