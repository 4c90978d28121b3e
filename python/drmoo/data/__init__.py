"""Data sets for the paper's deep experiments (nothing is downloaded)."""

from .celeba import CelebA, load_celeba
from .mnist import DigitSplits, load_mnist
from .multimnist import MultiMnist, MultiMnistRecipe, load_multimnist

__all__ = ["CelebA", "DigitSplits", "MultiMnist", "MultiMnistRecipe", "load_celeba", "load_mnist", "load_multimnist"]
