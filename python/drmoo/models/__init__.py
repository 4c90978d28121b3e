"""Models for the deep experiments."""

from .lenet_mtl import LENET_INPUT_SIZE, MultiLeNet, check_lenet_input_size
from .multitask import MultiTaskModel
from .resnet_mtl import IMAGENET_WEIGHTS_FILE, MultiTaskResNet, resolve_weights

__all__ = ["IMAGENET_WEIGHTS_FILE", "LENET_INPUT_SIZE", "MultiLeNet", "MultiTaskModel", "MultiTaskResNet",
           "check_lenet_input_size", "resolve_weights"]
