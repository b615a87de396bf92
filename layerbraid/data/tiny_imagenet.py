"""Tiny-ImageNet (200 classes, 64x64 RGB) from the standard `tiny-imagenet-200` folder."""

import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import torch.utils.data

__all__ = ["TinyImageNet", "load_tiny_imagenet"]


def _read_image(path):
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.size != (64, 64):
            im = im.resize((64, 64))
        return np.array(im, dtype=np.uint8)  # a writable copy (torch.from_numpy)


class TinyImageNet(torch.utils.data.Dataset):
    """One split of Tiny-ImageNet, read lazily: the constructor lists the files, each item is
    read from disk when it is accessed (a DataLoader's workers can share the reading).

    Args:
        root: the `tiny-imagenet-200` folder: ``wnids.txt``, ``train/<wnid>/images/*.JPEG`` and
            ``val/images/*.JPEG`` with ``val/val_annotations.txt``.
        split: "train" or "val".
        max_per_class: keep at most this many images of each class (None: all).

    Items are ``(image, label)``: a uint8 tensor (3, 64, 64) and an int64 label, an index into
    ``wnids`` (the class ids in label order).
    """

    def __init__(
        self,
        root: Union[str, os.PathLike],
        split: str = "train",
        max_per_class: Optional[int] = None,
    ) -> None:
        if max_per_class is not None and (
            isinstance(max_per_class, bool)
            or not isinstance(max_per_class, int)
            or max_per_class < 1
        ):
            raise ValueError(f"max_per_class must be an int >= 1 or None, got {max_per_class!r}")
        root = Path(root)
        wnids_file = root / "wnids.txt"
        if not wnids_file.exists():
            raise FileNotFoundError(
                f"{root} is not a tiny-imagenet-200 folder (no wnids.txt). Tiny-ImageNet ships "
                "with no package: download and unpack it yourself and pass its folder as root"
            )
        self.root, self.split = root, split
        self.wnids = [w.strip() for w in wnids_file.read_text().split() if w.strip()]
        index = {w: k for k, w in enumerate(self.wnids)}
        files = []
        if split == "train":
            for w in self.wnids:
                imgs = sorted((root / "train" / w / "images").glob("*.JPEG"))
                if not imgs:
                    raise FileNotFoundError(f"no images in {root / 'train' / w / 'images'}")
                files += [(p, index[w]) for p in imgs[:max_per_class]]
        elif split == "val":
            ann = root / "val" / "val_annotations.txt"
            if not ann.exists():
                raise FileNotFoundError(f"missing {ann}")
            counts: dict[str, int] = {}
            for line in ann.read_text().splitlines():
                parts = line.split("\t")
                if len(parts) < 2:
                    continue
                name, w = parts[0], parts[1]
                if w not in index:
                    raise ValueError(f"{ann}: class {w!r} of {name} is not in wnids.txt")
                counts[w] = counts.get(w, 0) + 1
                if max_per_class is None or counts[w] <= max_per_class:
                    files.append((root / "val" / "images" / name, index[w]))
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.files = [f for f, _ in files]
        self.labels = torch.tensor([c for _, c in files], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        image = torch.from_numpy(_read_image(self.files[i])).permute(2, 0, 1).contiguous()
        return image, self.labels[i]


def load_tiny_imagenet(
    root: Union[str, os.PathLike], split: str = "train", max_per_class: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """One split of Tiny-ImageNet read into memory at once (for small subsets; the lazy
    :class:`TinyImageNet` dataset is what training should use).

    Returns:
        (images, labels, wnids): uint8 tensor (n, 3, 64, 64), int64 labels (indices into wnids),
        and the list of class ids in label order.
    """
    ds = TinyImageNet(root, split, max_per_class)
    x = (
        torch.stack([ds[i][0] for i in range(len(ds))])
        if len(ds)
        else torch.zeros((0, 3, 64, 64), dtype=torch.uint8)
    )
    return x, ds.labels.clone(), ds.wnids
