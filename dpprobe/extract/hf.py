"""Hugging Face `datasets` as a data source: `hf:PATH_OR_NAME[:SPLIT][?image=COL&label=COL]`.

PATH_OR_NAME is a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
(`datasets.load_from_disk`), or the name of a dataset in the local Hugging Face cache
(`datasets.load_dataset`, offline unless HF_HUB_OFFLINE=0). The image column is the one whose
feature is `datasets.Image`, the label column the one that is a `datasets.ClassLabel` (whose
names are the declared class list); name them with `?image=COL&label=COL` when there are several
or none. A label column of plain integers needs the class count declared (`num_classes=K`).

`datasets` is imported only when an `hf:` spec is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import urllib.parse
from pathlib import Path

import numpy as np

from dpprobe.extract.defects import (
    array_image,
    check_bytes,
    first_line,
    image_mode,
    label_values,
    load_image,
    read_capped,
)
from dpprobe.extract.splits import ImageSplit

__all__ = ["HfSpec", "parse_hf_spec", "read_hf"]

SPLIT_NAMES = ("train", "test")


@dataclasses.dataclass(frozen=True)
class HfSpec:
    """A parsed `hf:` spec: where the dataset is, which of its splits, which columns."""

    location: str
    split: str | None = None
    image_column: str | None = None
    label_column: str | None = None


def parse_hf_spec(text: str) -> HfSpec:
    """'/d/ds:test?label=y' -> HfSpec('/d/ds', 'test', None, 'y') (the part after 'hf:')."""
    location, _, query = text.partition("?")
    options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    unknown = set(options) - {"image", "label"}
    if unknown:
        raise ValueError(f"hf:{text}: unknown option(s) {sorted(unknown)}; expected "
                         "?image=COLUMN&label=COLUMN")
    split = None
    head, sep, tail = location.rpartition(":")
    if sep and tail and "/" not in tail and head:
        location, split = head, tail
    if not location:
        raise ValueError("data source 'hf' needs a dataset: hf:PATH_OR_NAME[:SPLIT]")
    return HfSpec(location, split, options.get("image") or None, options.get("label") or None)


def read_hf(spec: HfSpec, *, split: str | None, num_classes: int | None,
            strict: bool = True) -> dict[str, ImageSplit]:
    """The splits of an `hf:` dataset, each an `ImageSplit` that decodes its images on demand.

    Args:
      spec: the parsed spec (`parse_hf_spec`).
      split: a spec naming one of the dataset's splits gives one split, named `split` (default
        "train"); otherwise the dataset's "train" and "test" splits (those it has), restricted
        to `split` when that names one ("all": both).
      num_classes: the declared class count, for a label column that is not a ClassLabel
        (with a ClassLabel it must agree with its names).
      strict: refuse a label outside the classes (extract); else it is a null record (the
        publishing rule, `extract.defects`).

    Returns:
      {split name: ImageSplit}, each with its class names and a sha256 fingerprint of its
      images' encoded bytes and labels.
    """
    loaded = _load(spec)
    import datasets

    if isinstance(loaded, datasets.Dataset):
        parts = {split if split not in (None, "all") else "train": loaded}
    elif spec.split is not None:
        if spec.split not in loaded:
            raise ValueError(f"hf:{spec.location} has no split {spec.split!r}; it has "
                             f"{sorted(loaded)}")
        parts = {split if split not in (None, "all") else "train": loaded[spec.split]}
    else:
        parts = {name: loaded[name] for name in SPLIT_NAMES if name in loaded}
        if not parts:
            raise ValueError(f"hf:{spec.location} has splits {sorted(loaded)}, none named "
                             "train or test; name one: hf:PATH:SPLIT (with `split=train|test`)")
        if split not in (None, "all"):
            if split not in parts:
                raise ValueError(f"hf:{spec.location} has no {split} split")
            parts = {split: parts[split]}
    return {name: _split(spec, name, part, num_classes, strict)
            for name, part in parts.items()}


def _load(spec: HfSpec):
    """The Dataset or DatasetDict: a save_to_disk folder, else a dataset of the local cache."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError("hf: data needs the package 'datasets' (pip install "
                         "datasets==5.2.0)") from err
    path = Path(spec.location).expanduser()
    if path.is_dir() and any((path / name).exists() for name in
                             ("dataset_dict.json", "state.json", "dataset_info.json")):
        try:
            return datasets.load_from_disk(str(path))
        except Exception as err:  # noqa: BLE001 - arrow and format errors alike
            raise ValueError(f"hf:{path} is not a readable save_to_disk folder "
                             f"({type(err).__name__}: {first_line(err)})") from err
    if path.exists():
        raise ValueError(f"hf:{path} is not a folder written by save_to_disk (no "
                         "dataset_dict.json or state.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return datasets.load_dataset(spec.location, split=spec.split)
    except Exception as err:  # noqa: BLE001 - hub, cache and format errors alike
        raise ValueError(f"hf:{spec.location}: no such folder, and not a dataset in the local "
                         f"Hugging Face cache ({type(err).__name__}: {first_line(err)})") from err


def _split(spec: HfSpec, name: str, dataset, num_classes: int | None,
           strict: bool = True) -> ImageSplit:
    """One split: columns found or named, labels and class names checked, fingerprinted."""
    import datasets

    where = f"hf:{spec.location}" + (f":{spec.split}" if spec.split else "")
    image_column = spec.image_column or _only(
        [c for c, f in dataset.features.items() if isinstance(f, datasets.Image)], "image",
        where, dataset)
    label_column = spec.label_column or _only(
        [c for c, f in dataset.features.items() if isinstance(f, datasets.ClassLabel)]
        or [c for c in ("label", "labels") if c in dataset.features], "label", where, dataset)
    for column in (image_column, label_column):
        if column not in dataset.features:
            raise ValueError(f"{where} has no column {column!r}; it has {dataset.column_names}")
    feature = dataset.features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        class_names = list(feature.names)
        if num_classes is not None and num_classes != len(class_names):
            raise ValueError(f"`num_classes={num_classes}` disagrees with {where}, whose "
                             f"{label_column!r} names {len(class_names)} classes")
    elif num_classes is not None:
        class_names = [str(c) for c in range(num_classes)]
    else:
        raise ValueError(f"{where}: column {label_column!r} is not a ClassLabel, so it names no "
                         "classes: declare them with `num_classes=K` (labels in [0, K))")
    found = None
    if strict:
        labels = np.asarray(dataset[label_column])
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{where}: labels in {label_column!r} must be integers, got "
                             f"{labels.dtype}{labels.shape}")
    else:  # the rule: each label on its own (a missing one is a null record)
        if not (isinstance(feature, datasets.ClassLabel) or str(
                getattr(feature, "dtype", "")).startswith(("int", "uint"))):
            raise ValueError(f"{where}: column {label_column!r} must hold integers, it is "
                             f"declared {feature}")
        labels, found = label_values(dataset[label_column])
    image_feature = dataset.features[image_column]
    encoded = isinstance(image_feature, datasets.Image)
    rows = dataset.with_format("arrow")  # the rule reads each row's size before its values

    def load(i: int):
        from PIL import Image

        if not strict:  # the rule, as for image files: the caps first, then the pixel rule
            if encoded:
                content = next(_encoded(_cells(rows, i, image_column)))
                if isinstance(content, Exception):
                    raise content
                return load_image(content)
            return array_image(_array_cell(dataset, rows, i, image_column))
        image = dataset[i][image_column]
        if not isinstance(image, Image.Image):
            return Image.fromarray(np.asarray(image, np.uint8))
        return image_mode(image, strict=True)

    return ImageSplit(dataset=f"hf:{Path(spec.location).name or spec.location}", split=name,
                      labels=labels, class_names=class_names,
                      fingerprint=(_fingerprint(dataset, image_column, labels) if strict else
                                   _rule_fingerprint(dataset, rows, image_column, labels,
                                                     encoded)),
                      load=load, defects=found)


def _cells(rows, i: int, column: str):
    """Row i's cell of `column` as a one-row Arrow array: a view of the (memory-mapped) table,
    never a copy (a scalar, or `combine_chunks`, would copy the row whatever its size)."""
    return next(chunk for chunk in rows[i][column].chunks if len(chunk))


def _encoded(cells):
    """Each row of an Arrow struct array of images (`bytes`, `path`), in turn, by the byte cap:
    a view of its embedded bytes (their length read from the offsets before anything is
    copied), or the bytes of the file at its path (`read_capped`); or, for a null record (no
    image, over the cap, an unreadable file), the ValueError or OSError that says why."""
    import pyarrow as pa

    valid = cells.is_valid().to_numpy(zero_copy_only=False)
    content, paths = cells.field("bytes"), cells.field("path").to_pylist()
    present = content.is_valid().to_numpy(zero_copy_only=False)
    _, offsets, data = content.buffers()
    offsets = np.frombuffer(offsets, np.int64 if pa.types.is_large_binary(content.type)
                            else np.int32)[content.offset:content.offset + len(content) + 1]
    for row in range(len(cells)):
        try:
            if valid[row] and present[row]:
                size = int(offsets[row + 1] - offsets[row])
                check_bytes(size)
                yield data.slice(int(offsets[row]), size)
            elif valid[row] and paths[row]:
                yield read_capped(paths[row])
            else:
                raise ValueError("no image")
        except (ValueError, OSError) as err:
            yield err


def _array_cell(dataset, rows, i: int, column: str):
    """Row i of an array column as NumPy (its own dtype), its size as stored checked against
    the byte cap before it is converted. ValueError: over the cap (a null record)."""
    check_bytes(_cells(rows, i, column).nbytes)
    return dataset.with_format("numpy")[i][column]


def _only(candidates: list[str], kind: str, where: str, dataset) -> str:
    if len(candidates) != 1:
        found = f"columns {candidates}" if candidates else "no such column"
        raise ValueError(f"{where}: cannot tell the {kind} column ({found}; columns "
                         f"{dataset.column_names}); name it: ?{kind}=COLUMN")
    return candidates[0]


def _fingerprint(dataset, image_column: str, labels: np.ndarray) -> str:
    """sha256 of every image's encoded bytes (or file) and of the labels (a strict reader's:
    every image read in full)."""
    import datasets

    digest = hashlib.sha256()
    if isinstance(dataset.features[image_column], datasets.Image):
        raw = dataset.cast_column(image_column, datasets.Image(decode=False))
        for batch in raw.iter(batch_size=1024):
            for item in batch[image_column]:
                content = item.get("bytes")
                if content is None and item.get("path"):
                    content = Path(item["path"]).read_bytes()
                digest.update(content or b"")
    else:
        for batch in dataset.with_format("numpy").iter(batch_size=1024):
            digest.update(np.ascontiguousarray(batch[image_column]).tobytes())
    digest.update(np.ascontiguousarray(labels.astype(np.int64)).tobytes())
    return digest.hexdigest()


def _rule_fingerprint(dataset, rows, image_column: str, labels: np.ndarray,
                      encoded: bool) -> str:
    """The fingerprint of a publishing job's data (never published): sha256 of each row's
    image as the rule reads it (encoded bytes, or an array row's values), a row the rule makes
    null before decoding (no image, over the byte cap, unreadable) counting as no bytes, and
    of the labels. Each row is read under the byte cap, as `load` reads it."""
    digest = hashlib.sha256()
    if encoded:
        for batch in rows.iter(batch_size=1024):
            for chunk in batch[image_column].chunks:
                for content in _encoded(chunk):
                    if not isinstance(content, Exception):
                        digest.update(content)
    else:
        for i in range(len(dataset)):
            with contextlib.suppress(Exception):  # as `load`'s: any error is a null record's
                pixels = np.asarray(_array_cell(dataset, rows, i, image_column))
                if pixels.dtype != object:  # ragged: no bytes (an object array's are pointers)
                    digest.update(np.ascontiguousarray(pixels).tobytes())
    digest.update(np.ascontiguousarray(labels.astype(np.int64)).tobytes())
    return digest.hexdigest()
