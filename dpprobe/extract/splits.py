"""The labelled splits that a data source yields: images (`ImageSplit`) or embeddings computed
elsewhere (`PrecomputedSplit`), each with the sha256 fingerprint of its exact content that goes
into the store's provenance."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from dpprobe.extract.defects import (
    NULL,
    NULL_LABEL,
    Defect,
    image_error,
    label_defects,
    strict_decoding,
)

__all__ = ["ImageSplit", "PrecomputedSplit", "arrays_sha256", "check_label_range", "image_mode_of"]


@dataclasses.dataclass
class ImageSplit:
    """One labelled split of images.

    Either `array` holds every image as uint8 (N, H, W) or (N, H, W, 3), or `load` reads image
    i from disk. `images(indices)` returns PIL images either way.

    `defects` None (a strict reader, `dpprobe extract`): a label outside the declared classes
    is refused. A list (a publishing job's reader, `extract.defects`): the records the rule
    changed so far; a label outside the classes joins them, and every null record's label
    becomes `NULL_LABEL`.
    """

    dataset: str
    split: str
    labels: np.ndarray
    class_names: list[str]
    fingerprint: str
    array: np.ndarray | None = None
    load: Callable[[int], object] | None = None
    spec: str = ""
    files: Sequence | None = None  # where image i comes from, to name it in errors
    defects: list[Defect] | None = None

    def __post_init__(self):
        raw = np.asarray(self.labels)
        if raw.ndim != 1:
            raise ValueError(f"{self.dataset}: labels must be 1-D, got shape {raw.shape}")
        if len(raw) == 0:
            raise ValueError(f"{self.dataset}: the {self.split} split holds no examples")
        if self.array is not None and len(self.array) != len(raw):
            raise ValueError(f"{self.dataset}: {len(self.array)} images but {len(raw)} labels")
        if self.defects is None:
            self.labels = raw.astype(np.int32)
            check_label_range(self.dataset, self.labels, self.class_names)
            return
        if not self.class_names:
            raise ValueError(f"{self.dataset}: no classes declared")
        # The rule, before the cast to int32 (which could wrap a huge label into the classes);
        # a row the reader already made null keeps its own reason.
        known = {d.row for d in self.defects if d.kind == NULL}
        self.defects = sorted(self.defects + [d for d in label_defects(raw, self.class_names)
                                              if d.row not in known],
                              key=lambda defect: defect.row)
        self.labels = np.where((raw >= 0) & (raw < len(self.class_names)), raw,
                               NULL_LABEL).astype(np.int32)
        self.null_rows([d.row for d in self.defects if d.kind == NULL])

    def null_rows(self, rows: Sequence[int]) -> None:
        """Make `rows` null records (label `NULL_LABEL`): the publishing rule's outcome for a
        record it cannot train on (their defects say why, for the owner), with zero pixels."""
        rows = np.asarray(rows, dtype=np.int64)
        self.labels[rows] = NULL_LABEL
        if self.array is not None and rows.size:
            if not self.array.flags.writeable:
                self.array = self.array.copy()
            self.array[rows] = 0

    def describe(self, i: int) -> str:
        """Where example i comes from (its file, or its row)."""
        if self.files is not None:
            return str(self.files[i])
        return f"{self.spec or self.dataset} {self.split} row {i}"

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def images(self, indices: Sequence[int]) -> list:
        from PIL import Image

        if self.array is not None:
            return [Image.fromarray(self.array[i]) for i in indices]
        images = []
        for i in indices:
            try:
                with strict_decoding():
                    images.append(self.load(int(i)))
            except (OSError, ValueError, SyntaxError) as err:  # PIL's errors for bad files
                raise ValueError(f"cannot read image {self.describe(int(i))}: "
                                 f"{image_error(err)}") from err
        return images

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

    def __post_init__(self):
        check_label_range(self.dataset, np.asarray(self.labels), self.class_names)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    provenance = ImageSplit.provenance


def image_mode_of(splits) -> str | None:
    """The channels a backbone that keeps them (ScatterNet) should give every image of these
    splits: "RGB" when any split is read image by image (files, rows of an image column), as
    torchvision's `ImageFolder` and `dpprobe finetune` read them, so that one grayscale file
    among colour ones is converted, not refused; None (each image's own) when every split is
    an array, which holds one mode. A rule on the kind of source, never on its pixels: the
    store's feature shape, which is published, does not depend on any one record."""
    if any(isinstance(split, ImageSplit) and split.array is None for split in splits):
        return "RGB"
    return None


def check_label_range(source, labels: np.ndarray, class_names: Sequence[str]) -> None:
    """Labels must lie in the declared class set [0, K)."""
    if not class_names:
        raise ValueError(f"{source}: no classes declared")
    if labels.size and (labels.min() < 0 or labels.max() >= len(class_names)):
        raise ValueError(
            f"{source}: labels must lie in [0, {len(class_names)}) (the declared classes), "
            f"got [{labels.min()}, {labels.max()}]")


def arrays_sha256(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()

