"""What the trainer (:mod:`drmoo.experiments.training`) needs of a network: a trunk shared by all tasks
and one head per task."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor, nn

__all__ = ["MultiTaskModel"]


class MultiTaskModel(nn.Module, ABC):
    """A shared trunk and ``heads`` (one per task): ``forward(images)`` returns one logit tensor per task,
    each head reading ``features(images)``, the trunk's output."""

    heads: nn.ModuleList

    @abstractmethod
    def shared_parameters(self) -> list[Tensor]:
        """The trunk's trainable parameters: what the multi-objective optimizer updates."""

    def task_parameters(self) -> list[Tensor]:
        """The heads' parameters (the trainer steps them with SGD)."""
        return list(self.heads.parameters())

    @abstractmethod
    def features(self, images: Tensor) -> Tensor:
        """The trunk's output for ``images``: what every head reads (``jacobian="features"`` differentiates here)."""
