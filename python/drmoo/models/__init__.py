"""Models for the deep experiments."""

from .resnet_mtl import IMAGENET_WEIGHTS_FILE, MultiTaskResNet, resolve_weights

__all__ = ["IMAGENET_WEIGHTS_FILE", "MultiTaskResNet", "resolve_weights"]
