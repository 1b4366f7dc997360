"""Labelled image sources: Fashion-MNIST (Debian's IDX files), scikit-learn digits, npz, folders.

A data spec names a source: `fashion-mnist`, `digits`, `npz:PATH`, `imagefolder:PATH`,
`cifar10:PATH` / `cifar100:PATH` (the python-pickle batches directory). Every split carries a
sha256 fingerprint of its exact content, which goes into the store's provenance.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "FASHION_MNIST_DIR",
    "IMAGE_EXTENSIONS",
    "ImageSplit",
    "PrecomputedSplit",
    "from_torch_dataset",
    "open_source",
    "parse_data_spec",
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
SOURCES = ("fashion-mnist", "digits", "npz", "imagefolder", "cifar10", "cifar100")


@dataclasses.dataclass
class ImageSplit:
    """One labelled split of images.

    Either `array` holds every image as uint8 (N, H, W) or (N, H, W, 3), or `load` reads image
    i from disk. `images(indices)` returns PIL images either way.
    """

    dataset: str
    split: str
    labels: np.ndarray
    class_names: list[str]
    fingerprint: str
    array: np.ndarray | None = None
    load: Callable[[int], object] | None = None
    spec: str = ""

    def __post_init__(self):
        self.labels = np.asarray(self.labels, dtype=np.int32)
        if self.labels.ndim != 1:
            raise ValueError(f"labels must be 1-D, got shape {self.labels.shape}")
        if self.array is not None and len(self.array) != len(self.labels):
            raise ValueError(f"{len(self.array)} images but {len(self.labels)} labels")
        if self.labels.size and (self.labels.min() < 0 or self.labels.max() >= self.num_classes):
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}), "
                f"got [{self.labels.min()}, {self.labels.max()}]"
            )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def images(self, indices: Sequence[int]) -> list:
        from PIL import Image

        if self.array is not None:
            return [Image.fromarray(self.array[i]) for i in indices]
        return [self.load(int(i)) for i in indices]

    def provenance(self) -> dict:
        return {
            "name": self.dataset,
            "spec": self.spec,
            "split": self.split,
            "num_examples": len(self),
            "num_classes": self.num_classes,
            "class_names": list(self.class_names),
            "fingerprint": self.fingerprint,
        }


@dataclasses.dataclass
class PrecomputedSplit:
    """Embeddings computed elsewhere (`--backbone none`), from an npz with features, labels."""

    dataset: str
    split: str
    features: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    fingerprint: str
    spec: str = ""

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    provenance = ImageSplit.provenance


def parse_data_spec(spec: str) -> tuple[str, str | None]:
    """'npz:/a/b.npz' -> ('npz', '/a/b.npz'); 'digits' -> ('digits', None)."""
    kind, sep, path = spec.partition(":")
    if kind not in SOURCES:
        raise ValueError(f"unknown data source {spec!r}; expected one of {', '.join(SOURCES)} "
                         "(npz, imagefolder, cifar10 and cifar100 take ':PATH')")
    if kind in ("npz", "imagefolder", "cifar10", "cifar100") and not path:
        raise ValueError(f"data source {kind!r} needs a path: {kind}:PATH")
    if kind in ("fashion-mnist", "digits") and sep:
        raise ValueError(f"data source {kind!r} takes no path (use --data-dir)")
    return kind, (path or None)


def open_source(
    spec: str,
    *,
    split: str | None = None,
    data_dir: str | os.PathLike | None = None,
    precomputed: bool = False,
) -> dict[str, ImageSplit | PrecomputedSplit]:
    """Open the splits of a data source.

    Args:
      spec: the data spec (see module docstring).
      split: for single-split sources (npz, imagefolder), the split name to give the data
        ("train" or "test"); for multi-split sources, restrict to that split ("all" = both).
      data_dir: override Fashion-MNIST's directory.
      precomputed: read `features` (not `images`) from an npz (`--backbone none`).

    Returns:
      {split name: split}.
    """
    kind, path = parse_data_spec(spec)
    if precomputed and kind != "npz":
        raise ValueError("--backbone none needs an npz:PATH source holding features and labels")
    if kind == "fashion-mnist":
        splits = _fashion_mnist(Path(data_dir) if data_dir else FASHION_MNIST_DIR)
    elif kind == "digits":
        splits = _digits()
    elif kind in ("cifar10", "cifar100"):
        splits = _cifar(Path(path), kind)
    else:
        name = split if split and split != "all" else "train"
        if split == "all":
            raise ValueError(f"{kind} sources hold one split; name it with --split train|test")
        if kind == "npz":
            one = _npz_features(Path(path), name) if precomputed else _npz_images(Path(path), name)
        else:
            one = _imagefolder(Path(path), name)
        one.spec = spec
        return {name: one}
    for one in splits.values():
        one.spec = spec
    if split and split != "all":
        return {split: splits[split]}
    return splits


def _sha256(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _read_idx(path: Path, expected_sha256: str | None) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if expected_sha256 is not None:
        actual = hashlib.sha256(raw).hexdigest()
        if actual != expected_sha256:
            raise ValueError(
                f"{path}: sha256 of the decompressed bytes is {actual}, expected "
                f"{expected_sha256}; the file is corrupt or not Fashion-MNIST"
            )
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _fashion_mnist(directory: Path) -> dict[str, ImageSplit]:
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        arrays = {}
        for part in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            stem = f"{prefix}-{part}"
            file = directory / f"{stem}.gz"
            if not file.exists():
                raise FileNotFoundError(
                    f"Fashion-MNIST file {file} is missing. Install Debian's package "
                    "(`sudo apt-get install dataset-fashion-mnist`) or pass --data-dir DIR "
                    "holding the four gzipped IDX files."
                )
            arrays[part] = _read_idx(file, FASHION_MNIST_SHA256[stem])
        images, labels = arrays["images-idx3-ubyte"], arrays["labels-idx1-ubyte"]
        splits[split] = ImageSplit(
            dataset="fashion-mnist",
            split=split,
            labels=labels,
            class_names=FASHION_MNIST_CLASSES,
            fingerprint=_sha256(images, labels),
            array=images,
        )
    return splits


def _digits() -> dict[str, ImageSplit]:
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
            fingerprint=_sha256(images[idx], labels[idx]),
            array=images[idx],
        )
        for split, idx in parts.items()
    }


def _load_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    if not path.exists():
        raise FileNotFoundError(f"npz file {path} does not exist")
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in keys if k not in data.files]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; it holds {data.files}")
        return {k: data[k] for k in keys + tuple(k for k in ("class_names",) if k in data.files)}


def _class_names(data: dict, labels: np.ndarray) -> list[str]:
    if "class_names" in data:
        return [str(c) for c in data["class_names"]]
    return [str(c) for c in range(int(labels.max()) + 1 if labels.size else 0)]


def _npz_images(path: Path, split: str) -> ImageSplit:
    data = _load_npz(path, ("images", "labels"))
    images, labels = data["images"], np.asarray(data["labels"])
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] != 3):
        raise ValueError(f"{path}: images must be (N, H, W) or (N, H, W, 3), got {images.shape}")
    if images.dtype != np.uint8:
        if not np.issubdtype(images.dtype, np.floating) or not np.isfinite(images).all():
            raise ValueError(f"{path}: images must be uint8 or finite floats in [0, 1]")
        if images.min() < 0 or images.max() > 1:
            raise ValueError(f"{path}: float images must lie in [0, 1], got "
                             f"[{images.min()}, {images.max()}]")
        images = np.round(images * 255.0).astype(np.uint8)
    _check_labels(path, labels, len(images))
    return ImageSplit(
        dataset=f"npz:{path.name}",
        split=split,
        labels=labels,
        class_names=_class_names(data, labels),
        fingerprint=_sha256(images, labels.astype(np.int32)),
        array=images,
    )


def _npz_features(path: Path, split: str) -> PrecomputedSplit:
    data = _load_npz(path, ("features", "labels"))
    features, labels = data["features"], np.asarray(data["labels"])
    if features.ndim not in (2, 3) or not np.issubdtype(features.dtype, np.floating):
        raise ValueError(
            f"{path}: features must be float (N, d) or (N, views, d), got "
            f"{features.dtype} {features.shape}"
        )
    _check_labels(path, labels, len(features))
    if not np.isfinite(features).all():
        raise ValueError(f"{path}: features contain NaN or Inf")
    return PrecomputedSplit(
        dataset=f"npz:{path.name}",
        split=split,
        features=features,
        labels=labels.astype(np.int32),
        class_names=_class_names(data, labels),
        fingerprint=_sha256(features, labels.astype(np.int32)),
    )


def _check_labels(path, labels: np.ndarray, count: int) -> None:
    if labels.ndim != 1 or len(labels) != count:
        raise ValueError(f"{path}: labels must be (N,) with N={count}, got {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer) or (labels.size and labels.min() < 0):
        raise ValueError(f"{path}: labels must be non-negative integers")


def _imagefolder(root: Path, split: str) -> ImageSplit:
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{root} has no class sub-folders (expected ROOT/CLASS/IMAGE)")
    files, labels = [], []
    for index, name in enumerate(classes):
        for file in sorted((root / name).rglob("*")):
            if file.is_file() and file.suffix.lower() in IMAGE_EXTENSIONS:
                files.append(file)
                labels.append(index)
    if not files:
        raise ValueError(f"{root} holds no images with extensions {IMAGE_EXTENSIONS}")
    digest = hashlib.sha256()
    for file, label in zip(files, labels, strict=True):
        digest.update(f"{file.relative_to(root).as_posix()}\0{label}\0".encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())

    def load(i: int):
        from PIL import Image

        with Image.open(files[i]) as image:
            image.load()
            return image.convert("RGB") if image.mode not in ("L", "RGB") else image.copy()

    return ImageSplit(
        dataset=f"imagefolder:{root.name}",
        split=split,
        labels=np.asarray(labels),
        class_names=classes,
        fingerprint=digest.hexdigest(),
        load=load,
    )


def _cifar(root: Path, kind: str) -> dict[str, ImageSplit]:
    """CIFAR-10/100 python-pickle batches (data_batch_1..5 + test_batch, or train + test)."""
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR directory {root} does not exist")
    if kind == "cifar10":
        parts = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
        label_key, meta_file, names_key = b"labels", "batches.meta", b"label_names"
    else:
        parts = {"train": ["train"], "test": ["test"]}
        label_key, meta_file, names_key = b"fine_labels", "meta", b"fine_label_names"
    class_names = None
    if (root / meta_file).exists():
        with open(root / meta_file, "rb") as f:
            meta = pickle.load(f, encoding="bytes")  # noqa: S301 - trusted local dataset files
        class_names = [n.decode() for n in meta[names_key]]
    splits = {}
    for split, names in parts.items():
        images, labels = [], []
        for name in names:
            file = root / name
            if not file.exists():
                raise FileNotFoundError(f"CIFAR batch {file} is missing")
            with open(file, "rb") as f:
                batch = pickle.load(f, encoding="bytes")  # noqa: S301
            images.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch[label_key])
        array = np.concatenate(images).transpose(0, 2, 3, 1).copy()
        labels = np.asarray(labels, np.int32)
        names_out = class_names or [str(c) for c in range(10 if kind == "cifar10" else 100)]
        splits[split] = ImageSplit(
            dataset=kind,
            split=split,
            labels=labels,
            class_names=names_out,
            fingerprint=_sha256(array, labels),
            array=array,
        )
    return splits


def from_torch_dataset(
    dataset,
    *,
    split: str = "train",
    class_names: Sequence[str] | None = None,
    name: str | None = None,
    fingerprint: str | None = None,
) -> ImageSplit:
    """Wrap any torch `Dataset` of (image, label) pairs as a split (Python API).

    Images may be PIL images, uint8 arrays or CHW tensors. Labels come from
    `dataset.targets` when present, else from one pass over the dataset. Without a given
    `fingerprint`, the recorded one hashes the dataset's type, length and labels only (say so
    by passing a content hash if you have one).
    """
    targets = getattr(dataset, "targets", None)
    if targets is None:
        targets = [dataset[i][1] for i in range(len(dataset))]
    labels = np.asarray([int(t) for t in targets], np.int32)

    def load(i: int):
        from PIL import Image

        image = dataset[i][0]
        if isinstance(image, Image.Image):
            return image if image.mode in ("L", "RGB") else image.convert("RGB")
        if hasattr(image, "detach"):  # a torch tensor, CHW
            import torchvision.transforms.functional as TF

            return TF.to_pil_image(image)
        return Image.fromarray(np.asarray(image))

    classes = list(class_names or getattr(dataset, "classes", None) or
                   [str(c) for c in range(int(labels.max()) + 1 if labels.size else 0)])
    if fingerprint is None:
        fingerprint = "labels-only:" + _sha256(
            np.frombuffer(f"{type(dataset).__qualname__}:{len(dataset)}".encode(), np.uint8),
            labels)
    return ImageSplit(
        dataset=name or type(dataset).__name__,
        split=split,
        labels=labels,
        class_names=classes,
        fingerprint=fingerprint,
        load=load,
    )
