"""Models for the deep experiments."""

from .lenet_mtl import LENET_INPUT_SIZE, MultiLeNet
from .multitask import MultiTaskModel
from .resnet_mtl import IMAGENET_WEIGHTS_FILE, MultiTaskResNet, resolve_weights

__all__ = ["IMAGENET_WEIGHTS_FILE", "LENET_INPUT_SIZE", "MultiLeNet", "MultiTaskModel", "MultiTaskResNet",
           "resolve_weights"]
