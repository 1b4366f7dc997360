"""CIFAR-10/100 python-pickle batches (data_batch_1..5 + test_batch, or train + test) into
labelled splits (`extract.splits`).

A strict reader (`dpprobe extract`) refuses a batch whose pixels or labels are not those of a
CIFAR batch, naming the file. A publishing job's reader (`strict=False`) applies the per-record
rule of `extract.defects` to each row on its own: a row that is None, a pixel short or long,
ragged, or holds a value that is not an integer, and a label that is not an integer or lies
outside the classes, make null records; only faults of a whole batch (not a dict with `data` and
labels, an array of another shape, as many labels as rows) are refused.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from dpprobe.extract.defects import (
    NULL,
    Defect,
    first_line,
    integer_pixels,
    label_values,
    pixel_rule,
)
from dpprobe.extract.splits import ImageSplit, arrays_sha256, check_label_range

__all__ = ["read_cifar"]

# One record's shape in a batch's `data`: channels, height, width (the format's, public).
SHAPE = (3, 32, 32)


def read_cifar(root: Path, kind: str, *, strict: bool = True) -> dict[str, ImageSplit]:
    """The train and test splits of a CIFAR-10 (`kind` "cifar10") or CIFAR-100 folder.

    Args:
      root: the folder of python-pickle batches.
      kind: "cifar10" or "cifar100" (which batch names, label key and class names).
      strict: refuse a batch with a pixel or label out of range (extract); else the
        per-record rule (`extract.defects`): each row and label on its own.

    Returns:
      {"train": split, "test": split}, images (N, 32, 32, 3) uint8; not `strict`, each split's
      `defects` lists the rows the rule changed (for the data's owner only).

    Raises:
      FileNotFoundError, ValueError: a missing or unreadable batch, or (not `strict`) a fault of
        a whole batch, which no record's content decides.
    """
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
        meta = _unpickle(root / meta_file, (names_key,))
        try:
            class_names = [n.decode() for n in meta[names_key]]
        except (TypeError, AttributeError) as err:
            raise ValueError(f"{root / meta_file}: {names_key!r} is not a list of names") from err
    splits = {}
    for split, names in parts.items():
        images, labels, defects = [], [], []
        for name in names:
            file = root / name
            if not file.exists():
                raise FileNotFoundError(f"CIFAR batch {file} is missing")
            batch = _unpickle(file, (b"data", label_key))
            if strict:
                data, batch_labels = _strict_batch(file, batch, label_key)
            else:
                data, batch_labels, found = _batch_by_the_rule(file, batch, label_key)
                defects += [Defect(d.row + len(labels), d.kind, d.detail) for d in found]
            images.append(data)
            labels.extend(batch_labels.tolist())
        array = np.concatenate(images).transpose(0, 2, 3, 1).copy()
        labels = np.asarray(labels, np.int64)
        names_out = class_names or [str(c) for c in range(10 if kind == "cifar10" else 100)]
        if strict:
            check_label_range(root / names[0], labels, names_out)
        splits[split] = ImageSplit(
            dataset=kind,
            split=split,
            labels=labels,
            class_names=names_out,
            fingerprint=arrays_sha256(array, labels.astype(np.int32)),
            array=array,
            defects=None if strict else defects,
        )
    return splits


def _strict_batch(file: Path, batch: dict, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """A batch's (N, 3, 32, 32) uint8 pixels and (N,) labels, refused by value (extract)."""
    try:
        data = np.asarray(batch[b"data"], np.uint8).reshape(-1, *SHAPE)
        labels = np.asarray(batch[label_key], np.int64).reshape(-1)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{file}: not a CIFAR batch of 3x32x32 images ({first_line(err)})"
                         ) from err
    _check_count(file, data, labels)
    return data, labels


def _batch_by_the_rule(file: Path, batch: dict,
                       label_key: bytes) -> tuple[np.ndarray, np.ndarray, list[Defect]]:
    """A batch's uint8 pixels, int64 labels and defects by the per-record rule: each row and
    each label on its own (`integer_pixels`, `pixel_rule`, `label_values`). Raises ValueError
    for a fault of the whole batch only, in words that quote no record."""
    try:
        data, null_rows = integer_pixels(batch[b"data"], SHAPE)
        data, found = pixel_rule(data)
    except ValueError as err:  # the batch's form, never a record's value
        raise ValueError(f"{file}: not a CIFAR batch of 3x32x32 images ({first_line(err)})"
                         ) from err
    try:
        labels, found_labels = label_values(batch[label_key])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{file}: its labels are not a sequence ({type(err).__name__})") from err
    _check_count(file, data, labels)
    null = set(null_rows.tolist())
    found = [d for d in found if d.row not in null] + [
        Defect(row, NULL, "not 3072 integer pixels (None, a row of another length, or a "
               "value that is not an integer)") for row in sorted(null)]
    return data, labels, found + found_labels


def _check_count(file: Path, data: np.ndarray, labels: np.ndarray) -> None:
    """As many labels as images (a fault of the whole batch: it tells no record apart)."""
    if len(labels) != len(data):
        raise ValueError(f"{file}: {len(data)} images but {len(labels)} labels")


def _unpickle(file: Path, keys: tuple) -> dict:
    """A CIFAR python-pickle file (trusted local dataset files), refused by name if it is not
    a dict holding `keys`."""
    try:
        with open(file, "rb") as f:
            value = pickle.load(f, encoding="bytes")  # noqa: S301
    except Exception as err:  # noqa: BLE001 - unpickling raises anything for a bad file
        raise ValueError(f"{file} is not a readable CIFAR pickle ({type(err).__name__}: "
                         f"{first_line(err)})") from err
    if not isinstance(value, dict) or any(k not in value for k in keys):
        raise ValueError(f"{file} is not a CIFAR batch (expected a dict with keys {keys})")
    return value
