"""Models for the deep experiments."""

from .lenet_mtl import LENET_INPUT_SIZE, MultiLeNet
from .resnet_mtl import IMAGENET_WEIGHTS_FILE, MultiTaskResNet, resolve_weights

__all__ = ["IMAGENET_WEIGHTS_FILE", "LENET_INPUT_SIZE", "MultiLeNet", "MultiTaskResNet", "resolve_weights"]
