import gzip
import struct

import numpy as np
import pytest
import torch

from layerbraid.data import load_mnist, load_tiny_imagenet, read_idx


def write_idx(path, arr, gz=False):
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    head = bytes([0, 0, codes[arr.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = head + arr.tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def make_mnist_dir(d, n_train=20, n_test=10, gz=False):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    arrays = {}
    for split, n, prefix in (("train", n_train, "train"), ("test", n_test, "t10k")):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(d / f"{prefix}-images-idx3-ubyte{suffix}", x, gz)
        write_idx(d / f"{prefix}-labels-idx1-ubyte{suffix}", y, gz)
        arrays[split] = (x, y)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_idx_files_round_trip(tmp_path, gz):
    arrays = make_mnist_dir(tmp_path, gz=gz)
    data = load_mnist(tmp_path)
    assert data["train_x"].shape == (20, 1, 28, 28) and data["train_x"].dtype == torch.float32
    assert data["test_y"].dtype == torch.int64
    np.testing.assert_array_equal(data["train_x"][:, 0].numpy() * 255, arrays["train"][0])
    np.testing.assert_array_equal(data["test_y"].numpy(), arrays["test"][1])


def test_read_idx_rejects_garbage(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x01\x02\x03\x04hello")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(p)
    write_idx(p, np.zeros((3, 4), np.uint8))
    p.write_bytes(p.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"header says \(3, 4\)"):
        read_idx(p)


def test_missing_files_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match="dataset"):
        load_mnist(dataset="cifar")


def test_real_mnist_ships_in_a_package():
    data = load_mnist()
    assert data["train_x"].shape == (60000, 1, 28, 28)
    assert data["test_x"].shape == (10000, 1, 28, 28)
    assert 0.0 <= float(data["train_x"].min()) and float(data["train_x"].max()) <= 1.0
    counts = torch.bincount(data["train_y"], minlength=10)
    assert counts.min() > 5000 and counts.sum() == 60000  # all ten digits, roughly balanced


def make_tiny_imagenet(root, classes=3, per_class=4, val_per_class=2):
    from PIL import Image

    rng = np.random.default_rng(0)
    wnids = [f"n0{k:07d}" for k in range(classes)]
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w in wnids:
        d = root / "train" / w / "images"
        d.mkdir(parents=True)
        for k in range(per_class):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / f"{w}_{k}.JPEG")
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for k in range(classes * val_per_class):
        name = f"val_{k}.JPEG"
        mode = "L" if k == 0 else "RGB"  # a grayscale image, as the real set has
        shape = (64, 64) if mode == "L" else (64, 64, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(root / "val" / "images" / name)
        lines.append(f"{name}\t{wnids[k % classes]}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return wnids


def test_tiny_imagenet_folder_layout(tmp_path):
    wnids = make_tiny_imagenet(tmp_path)
    x, y, names = load_tiny_imagenet(tmp_path, "train")
    assert names == wnids and x.shape == (12, 3, 64, 64) and x.dtype == torch.uint8
    assert torch.equal(torch.bincount(y), torch.tensor([4, 4, 4]))
    xv, yv, _ = load_tiny_imagenet(tmp_path, "val")
    assert xv.shape == (6, 3, 64, 64) and yv.tolist() == [0, 1, 2, 0, 1, 2]
    x2, y2, _ = load_tiny_imagenet(tmp_path, "train", max_per_class=2)
    assert len(y2) == 6


def test_tiny_imagenet_missing_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no package"):
        load_tiny_imagenet(tmp_path)


def test_tiny_imagenet_dataset_reads_each_image_when_it_is_accessed(tmp_path):
    from PIL import Image

    from layerbraid.data import TinyImageNet

    make_tiny_imagenet(tmp_path)
    ds = TinyImageNet(tmp_path, "train")
    x, y, _ = load_tiny_imagenet(tmp_path, "train")
    assert len(ds) == len(x) and torch.equal(ds[3][0], x[3]) and int(ds[3][1]) == int(y[3])
    # replace an image on disk after the dataset was built: the item follows the file
    Image.new("RGB", (64, 64), (7, 8, 9)).save(ds.files[3], format="PNG")
    image, _ = ds[3]
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
    assert image[:, 0, 0].tolist() == [7, 8, 9]
