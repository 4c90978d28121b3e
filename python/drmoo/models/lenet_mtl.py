"""The MultiLeNet of the multi-objective literature: a small LeNet trunk shared by all tasks.

Sener & Koltun (NeurIPS 2018, "Multi-Task Learning as Multi-Objective Optimization") train it on
Multi-MNIST, and Pareto MTL, EPO and later work reuse it, so it is the standard small benchmark:

* trunk: conv 1 -> 10 (5 x 5), max-pool 2, ReLU; conv 10 -> 20 (5 x 5), max-pool 2, ReLU;
  flatten (20 x 4 x 4 = 320 features for a 28 x 28 input); linear 320 -> 50, ReLU;
* one head per task: linear 50 -> 50, ReLU, linear 50 -> classes.

The input is the 36 x 36 composite resized to 28 x 28, as in Sener & Koltun, in [0, 1] and without
any normalisation inside the model: FGSM's eps is then simply a pixel budget (no eps-space
question).  The data pipeline hands every model three identical grey channels (the ResNet wants
three); the LeNet averages them back to one, so an attack that perturbs the channels alike (FGSM's
sign of a gradient that is the same in every channel) moves the one channel by exactly eps.

The layers use torch's default initialisation (Kaiming-uniform with a = sqrt(5)), the choice of the
reference implementations of Sener & Koltun and Pareto MTL.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .multitask import MultiTaskModel

__all__ = ["LENET_INPUT_SIZE", "MultiLeNet"]

LENET_INPUT_SIZE = 28  # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4: 20 x 4 x 4 = 320 trunk features


def check_lenet_input_size(input_size: int) -> None:
    """Refuse an input size the MultiLeNet cannot take (before a command builds it, or writes anything)."""
    if input_size != LENET_INPUT_SIZE:
        raise ValueError(f"the MultiLeNet takes {LENET_INPUT_SIZE} x {LENET_INPUT_SIZE} inputs (its linear layer "
                         f"expects 320 features), got input_size {input_size}: use --input-size {LENET_INPUT_SIZE}")


class MultiLeNet(MultiTaskModel):
    """Shared LeNet trunk + ``len(num_classes)`` two-layer heads; ``forward`` returns one logit tensor per task."""

    def __init__(self, num_classes: list[int], input_size: int = LENET_INPUT_SIZE) -> None:
        super().__init__()
        if not num_classes or any(isinstance(c, bool) or not isinstance(c, int) or c < 2 for c in num_classes):
            raise ValueError(f"num_classes must be a non-empty list of ints >= 2, got {num_classes!r}")
        check_lenet_input_size(input_size)
        self.trunk = nn.ModuleDict({
            "conv1": nn.Conv2d(1, 10, kernel_size=5),
            "conv2": nn.Conv2d(10, 20, kernel_size=5),
            "fc": nn.Linear(320, 50),
        })
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, classes)) for classes in num_classes
        )

    def shared_parameters(self) -> list[Tensor]:
        """Every trunk parameter: what the multi-objective optimizer updates."""
        return list(self.trunk.parameters())

    def features(self, images: Tensor) -> Tensor:
        if images.dim() != 4 or images.shape[-2:] != (LENET_INPUT_SIZE, LENET_INPUT_SIZE):
            raise ValueError(f"expected images [B, C, {LENET_INPUT_SIZE}, {LENET_INPUT_SIZE}], got "
                             f"{list(images.shape)}")
        x = images.mean(dim=1, keepdim=True)  # the grey channel (the pipeline repeats it for the ResNet)
        x = F.relu(F.max_pool2d(self.trunk["conv1"](x), 2))
        x = F.relu(F.max_pool2d(self.trunk["conv2"](x), 2))
        return F.relu(self.trunk["fc"](x.flatten(1)))

    def forward(self, images: Tensor) -> list[Tensor]:
        features = self.features(images)
        return [head(features) for head in self.heads]
