"""The paper's multi-task network: a ResNet18 encoder shared by all tasks and one MLP head per task.

Paper App. D, Table 3: ImageNet-pretrained ResNet18 with conv1, bn1 and layer1 frozen; per task a
two-layer linear head with ReLU and dropout, Kaiming-uniform initialisation.  The ImageNet
normalisation happens inside the model, so inputs (and adversarial perturbations) live in [0, 1].
Frozen layers keep their batch-norm statistics: their BN modules stay in eval mode whatever
``train()`` says.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn

from .multitask import MultiTaskModel

__all__ = ["IMAGENET_WEIGHTS_FILE", "MultiTaskResNet", "resolve_weights"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_WEIGHTS_FILE = "resnet18-f37072fd.pth"  # torchvision's IMAGENET1K_V1 file name


def _torch_hub_checkpoints() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints"


def resolve_weights(spec: str | None) -> Path | None:
    """``none`` -> None; ``imagenet`` -> torchvision's cached IMAGENET1K_V1 file; else a path.

    Never downloads: a missing file raises ``FileNotFoundError`` saying how to provide it.
    """
    if spec is None or spec.lower() == "none":
        return None
    if spec.lower() == "imagenet":
        path = _torch_hub_checkpoints() / IMAGENET_WEIGHTS_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"ImageNet weights for ResNet18 are not on disk (looked for {path}). drmoo never downloads: copy "
                f"torchvision's {IMAGENET_WEIGHTS_FILE} there "
                f"(TORCH_HOME={os.environ.get('TORCH_HOME', '~/.cache/torch')}), "
                "pass --weights /path/to/resnet18.pth, or train from scratch with --weights none"
            )
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--weights {path}: no such file (use 'imagenet', 'none' or a path to a state dict)")
    return path


class MultiTaskResNet(MultiTaskModel):
    """ResNet18 trunk (shared) + ``len(num_classes)`` MLP heads; ``forward`` returns one logit tensor per task."""

    FROZEN = ("conv1", "bn1", "layer1")
    mean: Tensor  # ImageNet's normalisation, [1, 3, 1, 1] buffers (registered in __init__)
    std: Tensor

    def __init__(
        self, num_classes: list[int], weights: Path | None = None, hidden: int = 256, dropout: float = 0.2
    ) -> None:
        super().__init__()
        from torchvision.models import resnet18

        trunk = resnet18(weights=None)
        if weights is not None:
            try:
                state = torch.load(weights, map_location="cpu", weights_only=True)
            except Exception as error:
                raise ValueError(f"cannot read ResNet18 weights from {weights}: {error}") from None
            state = {k: v for k, v in state.items() if not k.startswith("fc.")}
            missing, unexpected = trunk.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith("fc.")]
            if missing or unexpected:
                raise ValueError(
                    f"{weights} is not a ResNet18 state dict (missing {missing[:3]}, unexpected {unexpected[:3]})"
                )
        trunk.fc = nn.Identity()
        self.trunk = trunk
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        for name in self.FROZEN:
            for param in getattr(trunk, name).parameters():
                param.requires_grad_(False)
        self.heads = nn.ModuleList(self._head(512, hidden, classes, dropout) for classes in num_classes)

    @staticmethod
    def _head(features: int, hidden: int, classes: int, dropout: float) -> nn.Sequential:
        first, last = nn.Linear(features, hidden), nn.Linear(hidden, classes)
        for layer in (first, last):
            nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        return nn.Sequential(first, nn.ReLU(), nn.Dropout(dropout), last)

    def train(self, mode: bool = True) -> MultiTaskResNet:
        super().train(mode)
        for name in self.FROZEN:  # frozen layers never update their running statistics
            getattr(self.trunk, name).eval()
        return self

    def shared_parameters(self) -> list[Tensor]:
        """The trainable trunk parameters (layer2-4): what the multi-objective optimizer updates."""
        return [p for p in self.trunk.parameters() if p.requires_grad]

    def features(self, images: Tensor) -> Tensor:
        features: Tensor = self.trunk((images - self.mean) / self.std)
        return features

    def forward(self, images: Tensor) -> list[Tensor]:
        features = self.features(images)
        return [head(features) for head in self.heads]
