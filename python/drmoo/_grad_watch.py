"""Gradients that would be added to a balancer's direction without anyone meaning it.

``Balancer.backward`` adds its direction to the shared parameters' ``.grad``, as autograd accumulates.
Two ways of getting a different algorithm without a word:

* a second ``backward`` before the optimizer stepped (the gradient-accumulation habit: four
  micro-batches, four backwards, one step): four directions summed, four dual steps; the exact way is
  ``backward(losses, accumulate=True)`` on every micro-batch but the last;
* a ``loss.backward()`` (or a ``backward`` left over from before the last ``zero_grad``) into the
  shared parameters before ``balancer.backward``: that gradient and the direction summed.

How it is seen, with no device read (nothing that costs a step a synchronisation):

* the balancer's own gradient: after each backward it notes every shared parameter's ``.grad``
  object and that tensor's ``_version`` (its in-place write counter).  At the next backward, a
  ``.grad`` that is still the same tensor at the same version was neither reset by ``zero_grad``
  (``set_to_none=True`` replaces it by None; ``set_to_none=False`` zeroes it in place, which bumps
  the counter) nor written by anything else: the previous direction is still in it.  Whether the
  optimizer stepped in between (the parameter's own counter moved) only changes the message: a
  second backward before the step, or a step without ``zero_grad`` after it;
* anyone else's gradient: a post-accumulate-grad hook on each shared parameter notes the ``.grad``
  and its version each time autograd accumulates into it outside the balancer (``loss.backward()``);
  the balancer's own passes take ``torch.autograd.grad`` and set ``.grad`` directly, which fires no
  hook.  The same test then tells whether that gradient is still there.

Either finding is a :class:`GradientAccumulationWarning` (``drmoo.GradientAccumulationWarning``); a
deliberate sum (a regularizer's gradient added first, say) silences it with
``warnings.filterwarnings("ignore", category=drmoo.GradientAccumulationWarning)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from torch import Tensor

__all__ = ["GradWatch", "GradientAccumulationWarning"]


class GradientAccumulationWarning(UserWarning):
    """A balancer's direction is about to be added to a gradient already in the shared parameters'
    ``.grad`` (a second backward before the optimizer stepped, or a ``loss.backward()`` before it)."""


# (the .grad tensor, weakly: a gradient reset to None must not be kept alive here; its _version then)
_Seen = tuple["weakref.ref[Tensor]", int]


def _still_there(param: Tensor, seen: _Seen | None) -> bool:
    """Whether ``param.grad`` is the tensor noted in ``seen``, unwritten since."""
    grad = param.grad
    return grad is not None and seen is not None and seen[0]() is grad and grad._version == seen[1]


class GradWatch:
    """The notes of the module docstring for one balancer's shared parameters."""

    def __init__(self, shared: Sequence[Tensor]) -> None:
        self._shared = list(shared)
        self._left: list[_Seen | None] = []  # after the balancer's last backward, per parameter
        self._param_versions: list[int] = []
        self._foreign: dict[int, _Seen] = {}  # by the parameter's id: a gradient accumulated outside
        watch = weakref.ref(self)  # the hooks must not keep the balancer alive
        self._handles = []
        for param in self._shared:
            if param.is_leaf and param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda tensor, watch=watch: _note_foreign(watch, tensor)))

    def __del__(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()

    def __getstate__(self) -> dict[str, list[Tensor]]:
        """A copy (``copy.deepcopy``, pickle) watches the copied parameters with hooks of its own: the notes and
        hook handles are process-local (a copied handle would remove the original's hook)."""
        return {"shared": self._shared}

    def __setstate__(self, state: dict[str, list[Tensor]]) -> None:
        self.__init__(state["shared"])  # type: ignore[misc]

    def note_foreign(self, param: Tensor) -> None:
        if param.grad is not None:
            self._foreign[id(param)] = (weakref.ref(param.grad), param.grad._version)

    def finding(self) -> str | None:
        """What a backward starting now would add its direction to, as a warning's text; None if nothing."""
        shared = self._shared
        foreign = [index for index, param in enumerate(shared) if _still_there(param, self._foreign.get(id(param)))]
        self._foreign.clear()
        if foreign:
            return (f"the .grad of {len(foreign)} shared parameter(s) already hold a gradient from a backward pass "
                    "outside the balancer (loss.backward()?); the balancer's direction is added to it: call "
                    "optimizer.zero_grad() first, or silence this warning if the sum is intended")
        if len(self._left) != len(shared):
            return None
        ours = [index for index, param in enumerate(shared) if _still_there(param, self._left[index])]
        if not ours:
            return None
        stepped = any(param._version != version for param, version in zip(shared, self._param_versions))
        if stepped:
            return ("the shared parameters' .grad still hold the previous backward's direction (the optimizer "
                    "stepped, but no zero_grad followed): this backward adds to it; call optimizer.zero_grad() "
                    "after each step")
        return ("a second backward before the optimizer stepped: its direction and its dual step add to the "
                "previous ones (a different algorithm); to accumulate micro-batches into one full-batch step, "
                "pass accumulate=True to every backward but the last (drmoo.Balancer.backward)")

    def note_own(self) -> None:
        """After the balancer wrote its direction: note every shared ``.grad`` and the parameters' versions."""
        self._left = [None if param.grad is None else (weakref.ref(param.grad), param.grad._version)
                      for param in self._shared]
        self._param_versions = [param._version for param in self._shared]


def _note_foreign(watch: weakref.ref[GradWatch], param: Tensor) -> None:
    alive = watch()
    if alive is not None:
        alive.note_foreign(param)
