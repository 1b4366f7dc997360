"""What `dpprobe predict` reads: a store's split (features), a data spec as `extract` parses it
(images, or an npz of features), or image files; each opened as chunks of (inputs, ids,
labels) and checked against the model before anything is written: a store extracted with
another backbone or preprocessing, a class list other than the model's, features of another
dimension, images for a model that takes features, or features for one that takes images."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["Input", "open_input"]

# Rows per chunk (memory only; a multiple of both evaluation blocks).
CHUNK_ROWS = 1024
# Images per chunk: a backbone embeds about this many in seconds on a CPU, so the progress bar,
# which counts the chunks read, moves every few seconds.
IMAGE_CHUNK_ROWS = 64


@dataclasses.dataclass
class Input:
    """An opened input: chunks of (inputs, ids, labels or None)."""

    describe: str
    num_rows: int
    chunks: Iterator
    has_labels: bool
    paths: tuple[str, ...]  # what it reads (never to be overwritten)
    images: bool = True  # images, through the model's backbone or network (else features)


def open_input(config, model) -> Input:
    """The input of `config.data` for `model` (see the module docstring)."""
    from dpprobe import extract

    data = config.data
    if len(data) == 1 and _is_store(data[0]):
        return _store(data[0], config.split, model)
    if len(data) == 1 and not os.path.exists(data[0]):
        extract.parse_data_spec(data[0])  # a one-line error for what is neither
        return _spec(data[0], config, model)
    archives = [path for path in data if path.endswith(".npz") and os.path.isfile(path)]
    if archives:
        raise ValueError(f"{archives[0]} is an npz archive: give it as npz:{archives[0]}")
    return _files(data, model)


def _is_store(path: str) -> bool:
    from dpprobe.extract import FORMAT  # light: extract imports torch and zarr lazily

    try:
        with open(os.path.join(path, "zarr.json")) as f:
            return json.load(f).get("attributes", {}).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _check_classes(model, class_names, where: str) -> None:
    if [str(c) for c in class_names] != model.class_names:
        raise ValueError(f"{where} declares {len(class_names)} classes "
                         f"({', '.join(map(str, class_names[:4]))}, ...), {model.path} was "
                         f"trained on {len(model.class_names)} "
                         f"({', '.join(model.class_names[:4])}, ...)")


def _store(store: str, split: str, model) -> Input:
    from dpprobe import extract

    if model.kind != "linear":
        raise ValueError(f"{model.path} is a fine-tuned network: it takes images, not the "
                         f"features of store {store}")
    group = extract.open_split(store, split)
    attrs = dict(group.attrs)
    record = model.document["backbone"]
    ours = extract.store.store_identity(attrs)
    differ = [k for k in ("backbone", "preprocessing", "feature_dim") if ours[k] != record[k]]
    if differ:
        raise ValueError(f"{store}/{split} was extracted with another {', '.join(differ)} "
                         f"than {model.path} was trained on "
                         f"({(record.get('backbone') or {}).get('name')}); extract it with the "
                         "model's backbone, or give images")
    _check_classes(model, ours["class_names"], f"{store}/{split}")
    num_rows = int(attrs["num_examples"])

    def chunks():
        start = 0
        for features, labels in extract.iter_split_chunks(store, split, dtype=None):
            if features.ndim == 3:
                raise ValueError(f"{store}/{split} holds {features.shape[1]} views per example; "
                                 "predict takes one row per input (the test split has none)")
            yield features, np.arange(start, start + len(labels)), labels
            start += len(labels)

    return Input(f"{store}/{split}", num_rows, chunks(), True, (store,), images=False)


def _spec(spec: str, config, model) -> Input:
    from dpprobe import extract

    kind, path = extract.parse_data_spec(spec)
    precomputed = kind == "npz" and _npz_has(path, "features")
    if precomputed and model.kind != "linear":
        raise ValueError(f"{path} holds features; {model.path} is a fine-tuned network that "
                         "takes images")
    # An npz without class names holds labels in [0, K): the model's classes.
    unnamed = kind == "npz" and not _npz_has(path, "class_names")
    splits = extract.open_source(spec, split=config.split, data_dir=config.data_dir,
                                 precomputed=precomputed,
                                 num_classes=len(model.class_names) if unnamed else None)
    split = splits[config.split] if config.split in splits else next(iter(splits.values()))
    _check_classes(model, split.class_names, spec)
    labels = np.asarray(split.labels, np.int32)

    rows = CHUNK_ROWS if precomputed else IMAGE_CHUNK_ROWS

    def chunks():
        for start in range(0, len(split), rows):
            stop = min(start + rows, len(split))
            if precomputed:
                batch = np.asarray(split.features[start:stop])
            elif split.array is not None:
                batch = split.array[start:stop]
            else:
                batch = split.images(range(start, stop))
                for row, image in zip(range(start, stop), batch, strict=True):
                    image.filename = split.describe(row)  # named if the model refuses it
            files = getattr(split, "files", None)
            ids = [str(files[i]) for i in range(start, stop)] if files else range(start, stop)
            yield batch, np.asarray(list(ids), dtype=object), labels[start:stop]

    paths = (path,) if path else ()
    return Input(f"{spec} ({split.split})", len(split), chunks(), True, paths,
                 images=not precomputed)


def _npz_has(path: str, key: str) -> bool:
    try:
        with np.load(path, allow_pickle=False) as data:
            return key in data.files
    except Exception:  # noqa: BLE001 - `open_source` says what is wrong with the file
        return False


def _files(paths, model) -> Input:
    """Image files, or folders of them (searched recursively, sorted); no labels."""
    from dpprobe.extract.sources import IMAGE_EXTENSIONS

    if not model.takes_images:
        raise ValueError(f"{model.path} was trained on precomputed embeddings: give it "
                         "features (a store or an npz:PATH with features), not images")
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).rglob("*")
                           if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
            if not found:
                raise ValueError(f"{path} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist")

    def chunks():
        for start in range(0, len(files), IMAGE_CHUNK_ROWS):
            batch = files[start:start + IMAGE_CHUNK_ROWS]
            yield batch, np.asarray(batch, dtype=object), None

    return Input(f"{len(files)} image file(s)", len(files), chunks(), False, tuple(paths))
