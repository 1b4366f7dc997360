"""Readers of dataset files, each into labelled splits (`extract.splits`): Fashion-MNIST (Debian's
gzipped IDX files), scikit-learn digits, npz archives (images or precomputed features), image
folders (ROOT/CLASS/IMAGE); CIFAR-10/100's python-pickle batches are `extract.cifar`'s.

Every reader refuses a damaged or unexpected file with a message naming it, before anything is
written. With `strict=False` (a publishing job's reader) a fault of one record is not refused:
the public per-record rule of `extract.defects` applies to it, the same for every record.
"""

from __future__ import annotations

import gzip
import hashlib
import io
from pathlib import Path

import numpy as np

from dpprobe.extract.defects import (
    decoding,
    first_line,
    image_error,
    load_image,
    open_image,
    pixel_rule,
    read_capped,
    strict_decoding,
    unreadable,
)
from dpprobe.extract.splits import ImageSplit, PrecomputedSplit, arrays_sha256, check_label_range

__all__ = [
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_SHA256",
    "IMAGE_EXTENSIONS",
    "read_digits",
    "read_fashion_mnist",
    "read_imagefolder",
    "read_npz_features",
    "read_npz_images",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
# sha256 of the *decompressed* IDX files (Zalando's release, as packaged by Debian).
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")


def _read_idx(path: Path, expected_sha256: str | None) -> np.ndarray:
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise ValueError(f"{path} is not a readable gzipped IDX file ({first_line(err)})") from err
    if expected_sha256 is not None:
        actual = hashlib.sha256(raw).hexdigest()
        if actual != expected_sha256:
            raise ValueError(
                f"{path}: sha256 of the decompressed bytes is {actual}, expected "
                f"{expected_sha256}; the file is corrupt or not Fashion-MNIST"
            )
    if len(raw) < 4 or raw[:3] != b"\0\0\x08" or not 1 <= raw[3] <= 4:
        raise ValueError(f"{path} is not an IDX file of uint8 data")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != 4 + 4 * ndim + int(np.prod(dims)):
        raise ValueError(f"{path}: IDX header says {dims}, which does not match its length")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def read_fashion_mnist(directory: Path) -> dict[str, ImageSplit]:
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        arrays = {}
        for part in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            stem = f"{prefix}-{part}"
            file = directory / f"{stem}.gz"
            if not file.exists():
                raise FileNotFoundError(
                    f"Fashion-MNIST file {file} is missing. Install Debian's package "
                    "(`sudo apt-get install dataset-fashion-mnist`) or pass `data_dir=DIR` "
                    "holding the four gzipped IDX files."
                )
            arrays[part] = _read_idx(file, FASHION_MNIST_SHA256[stem])
        images, labels = arrays["images-idx3-ubyte"], arrays["labels-idx1-ubyte"]
        splits[split] = ImageSplit(
            dataset="fashion-mnist",
            split=split,
            labels=labels,
            class_names=FASHION_MNIST_CLASSES,
            fingerprint=arrays_sha256(images, labels),
            array=images,
        )
    return splits


def read_digits() -> dict[str, ImageSplit]:
    """scikit-learn's 8x8 digits (1797 images), split 80/20 by a fixed seeded permutation."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    labels = bunch.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    num_train = int(round(0.8 * len(labels)))
    parts = {"train": np.sort(order[:num_train]), "test": np.sort(order[num_train:])}
    return {
        split: ImageSplit(
            dataset="digits",
            split=split,
            labels=labels[idx],
            class_names=[str(c) for c in range(10)],
            fingerprint=arrays_sha256(images[idx], labels[idx]),
            array=images[idx],
        )
        for split, idx in parts.items()
    }


def _load_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The arrays `keys` (and `class_names`, when there) of an npz. An object array is refused
    whole, never unpickled: a pickle's content can run code or corrupt memory, whatever
    allow-list reads it (save rows of their own shapes as image files or an `hf:` dataset)."""
    if not path.exists():
        raise FileNotFoundError(f"npz file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"npz:{path} is not a file")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - zip, pickle and format errors alike
        raise ValueError(f"{path} is not a readable .npz file ({type(err).__name__}: "
                         f"{first_line(err)})") from err
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is a single .npy array, not an .npz archive holding "
                         f"{', '.join(keys)} (save it with np.savez)")
    with data:
        missing = [k for k in keys if k not in data.files]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; it holds {data.files}")
        wanted = keys + tuple(k for k in ("class_names",) if k in data.files)
        try:
            return {k: data[k] for k in wanted}
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"{path}: an array cannot be read ({type(err).__name__}: "
                             f"{first_line(err)})") from err


def _class_names(path: Path, data: dict, num_classes: int | None) -> list[str]:
    """The declared class list: the npz's `class_names`, else `--num-classes K` (never
    inferred from the labels: the class set is a public input)."""
    if "class_names" in data:
        names = np.asarray(data["class_names"])
        if names.ndim != 1 or names.size == 0:
            raise ValueError(f"{path}: class_names must be a non-empty 1-D array, "
                             f"got shape {names.shape}")
        return [str(c) for c in names]
    if num_classes is None:
        raise ValueError(f"{path} has no class_names: declare the classes with `num_classes=K` "
                         "(labels must lie in [0, K))")
    return [str(c) for c in range(num_classes)]


def read_npz_images(path: Path, split: str, num_classes: int | None = None, *,
                    strict: bool = True) -> ImageSplit:
    """An npz of `images` (N, H, W[, 1 or 3]) and `labels` (N,): refused by value when a
    pixel or label is out of range (`strict`, extract), else by the publishing rule
    (`extract.defects`: clamped, or null records)."""
    data = _load_npz(path, ("images", "labels"))
    images, labels = data["images"], np.asarray(data["labels"])
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] != 3):
        raise ValueError(f"{path}: images must be (N, H, W) or (N, H, W, 3), got {images.shape}")
    if images.shape[0] == 0 or min(images.shape[1:3]) < 1:
        raise ValueError(f"{path}: images have shape {images.shape}; need at least one image")
    defects = None
    if not strict:
        try:
            images, defects = pixel_rule(images)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    elif images.dtype != np.uint8:
        if not np.issubdtype(images.dtype, np.floating) or not np.isfinite(images).all():
            raise ValueError(f"{path}: images must be uint8 or finite floats in [0, 1]")
        if images.min() < 0 or images.max() > 1:
            raise ValueError(f"{path}: float images must lie in [0, 1], got "
                             f"[{images.min()}, {images.max()}]")
        images = np.round(images * 255.0).astype(np.uint8)
    _check_labels(path, labels, len(images), strict=strict)
    class_names = _class_names(path, data, num_classes)
    if strict:
        check_label_range(path, labels, class_names)
    return ImageSplit(
        dataset=f"npz:{path.name}",
        split=split,
        labels=labels,
        class_names=class_names,
        fingerprint=arrays_sha256(images, labels.astype(np.int32)),
        array=images,
        defects=defects,
    )


def read_npz_features(path: Path, split: str, num_classes: int | None = None) -> PrecomputedSplit:
    data = _load_npz(path, ("features", "labels"))
    features, labels = data["features"], np.asarray(data["labels"])
    if features.ndim not in (2, 3) or not np.issubdtype(features.dtype, np.floating):
        raise ValueError(
            f"{path}: features must be float (N, d) or (N, views, d), got "
            f"{features.dtype} {features.shape}"
        )
    if features.shape[0] == 0 or min(features.shape[1:]) < 1:
        raise ValueError(f"{path}: features have shape {features.shape}; need N >= 1 rows of "
                         "at least one value")
    _check_labels(path, labels, len(features))
    bad = ~np.isfinite(features.reshape(len(features), -1)).all(axis=1)
    if bad.any():
        raise ValueError(f"{path}: features contain NaN or Inf ({int(bad.sum())} rows, the "
                         f"first is row {int(np.flatnonzero(bad)[0])})")
    class_names = _class_names(path, data, num_classes)
    check_label_range(path, labels, class_names)
    return PrecomputedSplit(
        dataset=f"npz:{path.name}",
        split=split,
        features=features,
        labels=labels.astype(np.int32),
        class_names=class_names,
        fingerprint=arrays_sha256(features, labels.astype(np.int32)),
    )


def _check_labels(path, labels: np.ndarray, count: int, *, strict: bool = True) -> None:
    """Labels (N,) of integers (structural); non-negative too when `strict`."""
    if labels.ndim != 1 or len(labels) != count:
        raise ValueError(f"{path}: labels must be (N,) with N={count}, got {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer) or (strict and labels.size
                                                       and labels.min() < 0):
        raise ValueError(f"{path}: labels must be non-negative integers, got {labels.dtype}"
                         + (f" with minimum {labels.min()}" if labels.size and np.issubdtype(
                             labels.dtype, np.number) else ""))


def read_imagefolder(root: Path, split: str, *, strict: bool = True) -> ImageSplit:
    """ROOT/CLASS/IMAGE. Hidden folders (.git, .ipynb_checkpoints) are not classes; a class
    folder without images is refused (the class list is the folder names, so it would declare
    a class no example has). Every image's header is checked here, before anything is written:
    a bad one is refused by name (`strict`, extract), else it is a null record (the publishing
    rule, `extract.defects`).
    """
    from PIL import Image

    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"{root} has no class sub-folders (expected ROOT/CLASS/IMAGE)")
    files, labels = [], []
    for index, name in enumerate(classes):
        found = [file for file in sorted((root / name).rglob("*"))
                 if file.is_file() and file.suffix.lower() in IMAGE_EXTENSIONS
                 and not any(part.startswith(".") for part in file.relative_to(root).parts)]
        if not found:
            raise ValueError(f"class folder {root / name} holds no images with extensions "
                             f"{IMAGE_EXTENSIONS}; remove it or add its images")
        files += found
        labels += [index] * len(found)
    digest, defects = hashlib.sha256(), None if strict else []
    for row, (file, label) in enumerate(zip(files, labels, strict=True)):
        try:
            content = file.read_bytes() if strict else read_capped(file)
        except OSError as err:
            if strict:
                raise ValueError(f"cannot read image {file}: {err.strerror}") from err
            content = b""
        except ValueError as err:
            defects.append(unreadable(row, err))
            content = None
        if content is not None:
            try:
                with strict_decoding() if strict else decoding():
                    with (Image.open if strict else open_image)(io.BytesIO(content)) as image:
                        image.verify()
            except Exception as err:  # noqa: BLE001 - PIL raises many kinds for bad files
                if strict:
                    raise ValueError(f"{file} is not a readable image "
                                     f"({image_error(err)})") from err
                defects.append(unreadable(row, err))
        digest.update(f"{file.relative_to(root).as_posix()}\0{label}\0".encode())
        digest.update(hashlib.sha256(content or b"").digest())

    def load(i: int):  # the rule, not strict: both caps, and the pixel rule for float images
        return load_image(files[i].read_bytes() if strict else read_capped(files[i]),
                          strict=strict)

    return ImageSplit(
        dataset=f"imagefolder:{root.name}",
        split=split,
        labels=np.asarray(labels),
        class_names=classes,
        fingerprint=digest.hexdigest(),
        load=load,
        files=files,
        defects=defects,
    )
