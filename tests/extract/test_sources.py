"""Data sources: digits, Fashion-MNIST (checked against its sha256), npz and image folders."""

import gzip
import shutil

import numpy as np
import pytest

from dpprobe import extract
from tests.conftest import requires_fashion_mnist


def test_digits_source_is_a_fixed_80_20_split():
    splits = extract.open_source("digits")
    assert len(splits["train"]) == 1438 and len(splits["test"]) == 359
    again = extract.open_source("digits")
    assert splits["train"].fingerprint == again["train"].fingerprint
    assert splits["train"].fingerprint != splits["test"].fingerprint
    assert splits["train"].array.dtype == np.uint8 and splits["train"].array.max() == 255


@requires_fashion_mnist
def test_fashion_mnist_checks_its_sha256(tmp_path):
    splits = extract.open_source("fashion-mnist")
    assert splits["train"].array.shape == (60000, 28, 28)
    assert splits["test"].labels.shape == (10000,)
    assert np.bincount(splits["test"].labels).tolist() == [1000] * 10
    # A corrupted copy is refused.
    for file in extract.sources.FASHION_MNIST_DIR.iterdir():
        shutil.copy(file, tmp_path / file.name)
    raw = bytearray(gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz").read())
    raw[100] = (raw[100] + 1) % 10
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(ValueError, match="sha256"):
        extract.open_source("fashion-mnist", data_dir=tmp_path)


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        extract.open_source("fashion-mnist", data_dir=tmp_path)


def test_npz_and_imagefolder_sources(tmp_path, rng):
    from PIL import Image

    images = rng.integers(0, 256, size=(5, 12, 12, 3), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", images=images, labels=np.array([0, 1, 2, 1, 0]))
    with pytest.raises(ValueError, match="`num_classes=K`"):  # the class set is declared
        extract.open_source(f"npz:{tmp_path / 'd.npz'}", split="test")
    split = extract.open_source(f"npz:{tmp_path / 'd.npz'}", split="test", num_classes=3)["test"]
    assert split.split == "test" and split.num_classes == 3
    np.testing.assert_array_equal(np.asarray(split.images([2])[0]), images[2])
    for cls in ("cat", "dog"):
        (tmp_path / "folder" / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(images[i]).save(tmp_path / "folder" / cls / f"{i}.png")
    folder = extract.open_source(f"imagefolder:{tmp_path / 'folder'}")["train"]
    assert folder.class_names == ["cat", "dog"] and folder.labels.tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(np.asarray(folder.images([3])[0]), images[1])
    np.savez(tmp_path / "bad.npz", images=images, labels=np.array([0, 1]))
    with pytest.raises(ValueError, match="labels must be"):
        extract.open_source(f"npz:{tmp_path / 'bad.npz'}", num_classes=3)
    with pytest.raises(ValueError, match="unknown data source"):
        extract.open_source("mnist")
