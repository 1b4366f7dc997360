"""Data sources: a data spec names one, `open_source` opens its splits.

A data spec is `fashion-mnist`, `digits`, `npz:PATH`, `imagefolder:PATH`, `cifar10:PATH` /
`cifar100:PATH` (the python-pickle batches directory), or `hf:PATH_OR_NAME[:SPLIT][?image=COL&
label=COL]` (Hugging Face `datasets`: a `save_to_disk` folder or a dataset of the local cache,
`extract.hf`); the file formats are read by `extract.datasets` (CIFAR's by `extract.cifar`).
`from_torch_dataset` wraps any torch `Dataset` (Python API). Every split carries a sha256
fingerprint of its exact content, which goes into the store's provenance.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dpprobe.extract.cifar import read_cifar
from dpprobe.extract.datasets import (
    FASHION_MNIST_DIR,
    FASHION_MNIST_SHA256,
    IMAGE_EXTENSIONS,
    read_digits,
    read_fashion_mnist,
    read_imagefolder,
    read_npz_features,
    read_npz_images,
)
from dpprobe.extract.hf import parse_hf_spec, read_hf
from dpprobe.extract.splits import ImageSplit, PrecomputedSplit, arrays_sha256

__all__ = [
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_SHA256",
    "IMAGE_EXTENSIONS",
    "SOURCES",
    "ImageSplit",
    "PrecomputedSplit",
    "from_torch_dataset",
    "open_source",
    "parse_data_spec",
]

SOURCES = ("fashion-mnist", "digits", "npz", "imagefolder", "cifar10", "cifar100", "hf")
_WITH_PATH = ("npz", "imagefolder", "cifar10", "cifar100", "hf")


def parse_data_spec(spec: str) -> tuple[str, str | None]:
    """'npz:/a/b.npz' -> ('npz', '/a/b.npz'); 'digits' -> ('digits', None)."""
    kind, sep, path = spec.partition(":")
    if kind not in SOURCES:
        raise ValueError(f"unknown data source {spec!r}; expected one of {', '.join(SOURCES)} "
                         "(npz, imagefolder, cifar10, cifar100 and hf take ':PATH')")
    if kind in _WITH_PATH and not path:
        raise ValueError(f"data source {kind!r} needs a path: {kind}:PATH")
    if kind in ("fashion-mnist", "digits") and sep:
        raise ValueError(f"data source {kind!r} takes no path (use `data_dir`)")
    return kind, (path or None)


def open_source(
    spec: str,
    *,
    split: str | None = None,
    data_dir: str | os.PathLike | None = None,
    precomputed: bool = False,
    num_classes: int | None = None,
    strict: bool = True,
) -> dict[str, ImageSplit | PrecomputedSplit]:
    """Open the splits of a data source.

    Args:
      spec: the data spec (see module docstring).
      split: for single-split sources (npz, imagefolder), the split name to give the data
        ("train" or "test"); for multi-split sources, restrict to that split ("all" = both).
      data_dir: override Fashion-MNIST's directory.
      precomputed: read `features` (not `images`) from an npz (`backbone="none"` in `run_extract`).
      num_classes: the declared class count K, for sources without class names (an npz
        without `class_names`); must agree with the source's own names when it has them.
        The class list is a public input: it is never inferred from the labels.
      strict: refuse a record that is out of range or unreadable, naming it and its value
        (`dpprobe extract`, the owner's tool); False applies the publishing job's per-record
        rule instead (`extract.defects`: clamped, or a null record), and each image split
        lists what it did in `defects` (for the owner, never to be published).

    Returns:
      {split name: split}.
    """
    kind, path = parse_data_spec(spec)
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"`num_classes` must be >= 1, got {num_classes}")
    if precomputed and kind != "npz":
        raise ValueError("`backbone=none` needs an npz:PATH source holding features and labels")
    if kind == "fashion-mnist":
        splits = read_fashion_mnist(Path(data_dir) if data_dir else FASHION_MNIST_DIR)
    elif kind == "digits":
        splits = read_digits()
    elif kind in ("cifar10", "cifar100"):
        splits = read_cifar(Path(path), kind, strict=strict)
    elif kind == "hf":
        splits = read_hf(parse_hf_spec(path), split=split, num_classes=num_classes,
                         strict=strict)
    else:
        name = split if split and split != "all" else "train"
        if split == "all":
            raise ValueError(f"{kind} sources hold one split; name it with `split=train|test`")
        if kind == "npz":
            one = (read_npz_features(Path(path), name, num_classes) if precomputed
                   else read_npz_images(Path(path), name, num_classes, strict=strict))
        else:
            one = read_imagefolder(Path(path), name, strict=strict)
        splits = {name: one}
    for one in splits.values():
        _check_declared(one, num_classes, spec)
        one.spec = spec
        if not strict and isinstance(one, ImageSplit) and one.defects is None:
            one.defects = []  # a built-in dataset: the rule finds nothing to change
    if split and split != "all":
        return {split: splits[split]}
    return splits


def _check_declared(split: ImageSplit | PrecomputedSplit, num_classes: int | None,
                    spec: str) -> None:
    if num_classes is not None and num_classes != split.num_classes:
        raise ValueError(f"`num_classes={num_classes}` disagrees with {spec}, which names "
                         f"{split.num_classes} classes")


def from_torch_dataset(
    dataset,
    *,
    split: str = "train",
    class_names: Sequence[str] | None = None,
    name: str | None = None,
    fingerprint: str | None = None,
    num_classes: int | None = None,
) -> ImageSplit:
    """Wrap any torch `Dataset` of (image, label) pairs as a split (Python API).

    Images may be PIL images, uint8 arrays or CHW tensors. Labels come from
    `dataset.targets` when present, else from one pass over the dataset. Without a given
    `fingerprint`, the recorded one hashes the dataset's type, length and labels only (say so
    by passing a content hash if you have one). The class list comes from `class_names`, the
    dataset's `classes`, or `num_classes` (names "0".."K-1"); it is never inferred from the
    labels, and labels outside it are refused.
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

    classes = list(class_names or getattr(dataset, "classes", None) or [])
    if not classes:
        if num_classes is None:
            raise ValueError(f"{type(dataset).__name__} has no `classes`: declare them with "
                             "class_names=[...] or num_classes=K")
        classes = [str(c) for c in range(num_classes)]
    elif num_classes is not None and num_classes != len(classes):
        raise ValueError(f"num_classes={num_classes} disagrees with the {len(classes)} class "
                         "names")
    if fingerprint is None:
        fingerprint = "labels-only:" + arrays_sha256(
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
