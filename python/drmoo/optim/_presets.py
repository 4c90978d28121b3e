"""Named paper settings of a method (its ``PRESETS``), kept apart from the optimizer base class, whose job is
the step's machinery."""

from __future__ import annotations

from typing import Any, ClassVar


class Presets:
    """Mixin: ``cls.preset(name)`` returns the constructor keyword arguments of a named paper setting."""

    # Named paper settings of the method: preset name -> constructor keyword arguments.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def preset(cls, name: str) -> dict[str, Any]:
        """Constructor keyword arguments of a named paper setting (``cls.PRESETS``), e.g.
        ``DoubleClipMGDA(params, m, **DoubleClipMGDA.preset("multimnist"))``.

        Args:
            name: a key of ``cls.PRESETS``; another name raises ValueError listing them.
        """
        try:
            return dict(cls.PRESETS[name])
        except KeyError:
            known = ", ".join(cls.PRESETS) or "none"
            raise ValueError(f"{cls.__name__} has no preset {name!r}; known presets: {known}") from None
