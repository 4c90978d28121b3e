"""Data sets for the paper's deep experiments (nothing is downloaded)."""

from .mnist import DigitSplits, load_mnist
from .multimnist import MultiMnist, MultiMnistRecipe, load_multimnist

__all__ = ["DigitSplits", "MultiMnist", "MultiMnistRecipe", "load_mnist", "load_multimnist"]
