"""The public per-record rule of a publishing job, and the defects it finds for the data's owner.

A publishing job (`finetune`) must never let one record decide what it publishes: an abort
that only some record's content triggers, or a message quoting a record's value, tells D from
D with that record nulled with certainty (an unbounded epsilon for that record). So the
readers, opened with `strict=False`, apply one rule to every record alike instead of refusing
the dataset:

  - a label outside the declared classes, a NaN or Inf pixel, or an image that cannot be read
    makes a null record (label `NULL_LABEL`, zero pixels), which the trainer turns into a zero
    gradient (`dp.clipping.valid_labels`); so does a label that is not an integer or is
    missing, a missing image, an image file of more than `MAX_PIXELS` pixels (width x
    height, read from its header: it is never decoded) and one of more than
    `MAX_FILE_BYTES` bytes (told from its size: it is never read);
  - Pillow's warnings about a record (its size, its EXIF, its palette) are never shown while
    it is decoded (`decoding`): a decompression-bomb warning makes a null record, the others
    are ignored;
  - float pixels are clamped to [0, 1], integer pixels to [0, 255];
  - images of other sizes or modes are brought to the model's input by the public resize,
    crop and channel rule (`finetune.images`).

Each application of the rule is kept as a `Defect` (row, kind, and a detail that quotes the
value). Defects are for the data's owner only (`dpprobe verify --data SPEC` lists them); a
publishing job never prints them, nor counts them.

`dpprobe extract` keeps its strict readers: its store stays with the owner, and refusing a bad
row there, by name and value, is what the owner needs.

Formal guarantee:
  Each record's outcome (kept, clamped, resized, or made a null record) is a function of that
  record alone, the same function for every record; the rule raises only for faults of the
  whole source that no record's content decides (a dtype that is not a number). So replacing
  one record by a null record changes one row of the trainer's input and nothing else, which
  is the zero-out neighbouring relation the accounting assumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_FILE_BYTES", "MAX_PIXELS", "NULL", "NULL_LABEL", "Defect", "decoding",
           "first_line", "image_error", "integer_pixels", "label_defects", "label_values",
           "open_image", "pixel_rule", "strict_decoding", "unreadable"]

# The label of a null record: outside every class list, as the trainer's canaries use it.
NULL_LABEL = -1
# Defect kinds: what the rule did to the record.
NULL, CLAMPED, RESIZED = "null record", "clamped", "resized"
# The most pixels (width x height) a publishing job decodes in one image file: a larger one is
# a null record, told from its header alone (public; below Pillow's own bomb limit).
MAX_PIXELS = 40_000_000
# The largest image file a publishing job reads (bytes): a larger one is a null record, told
# from its size alone, so that no file's size decides the job's memory or time.
MAX_FILE_BYTES = 256 * 2**20


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclasses.dataclass(frozen=True)
class Defect:
    """One record the rule changed: its row, what the rule did (`NULL`, `CLAMPED`,
    `RESIZED`), and why, with the record's value (private: for the data's owner only)."""

    row: int
    kind: str
    detail: str


def label_defects(labels: np.ndarray, class_names: Sequence[str]) -> list[Defect]:
    """The rows whose label lies outside the declared classes [0, K): null records.

    Args:
      labels: (N,) integer labels, as read (before any cast that could wrap them).
      class_names: the declared class list (public).

    Returns:
      one `Defect` of kind `NULL` per such row, quoting its label.
    """
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= len(class_names)))
    return [Defect(int(i), NULL, f"label {labels[i]} outside the declared classes "
                   f"[0, {len(class_names)})") for i in bad]


def pixel_rule(images: np.ndarray) -> tuple[np.ndarray, list[Defect]]:
    """Images of any real dtype as uint8, by the per-record rule: a row holding NaN or Inf is a
    null record (zero pixels); float pixels are clamped to [0, 1] (then scaled to 255), integer
    pixels to [0, 255]. A function of each row alone.

    Args:
      images: (N, H, W[, C]) uint8, integer or float pixels.

    Returns:
      (uint8 images, the defects: `NULL` rows and `CLAMPED` rows with their range).
    """
    if images.dtype == np.uint8:
        return images, []
    if np.issubdtype(images.dtype, np.floating):
        low, high, scale = 0.0, 1.0, 255.0
    elif np.issubdtype(images.dtype, np.integer):
        low, high, scale = 0, 255, 1.0
    else:
        raise ValueError(f"images must be uint8, integers or floats, got {images.dtype}")
    rows = images.reshape(len(images), -1)
    finite = (np.isfinite(rows).all(axis=1) if scale != 1.0
              else np.ones(len(images), dtype=bool))
    defects = [Defect(int(i), NULL, "pixels hold NaN or Inf") for i in np.flatnonzero(~finite)]
    if rows.shape[1]:
        safe = np.where(finite[:, None], rows, low)
        smallest, largest = safe.min(axis=1), safe.max(axis=1)
        for i in np.flatnonzero(finite & ((smallest < low) | (largest > high))):
            defects.append(Defect(int(i), CLAMPED, f"pixels in [{smallest[i]}, {largest[i]}], "
                                  f"clamped to [{low}, {high}]"))
    clamped = np.clip(np.where(finite.reshape((-1,) + (1,) * (images.ndim - 1)), images, low),
                      low, high)
    out = np.round(clamped.astype(np.float64) * scale).astype(np.uint8)
    return out, sorted(defects, key=lambda d: d.row)


@contextlib.contextmanager
def decoding():
    """Around every Pillow open, verify or decode of a record on a publishing job's path:
    Pillow's `DecompressionBombWarning` is raised as an error (the record becomes a null
    record) and every other warning is ignored, so that nothing on stderr quotes a record."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


@contextlib.contextmanager
def strict_decoding():
    """Around a Pillow open or decode on an owner's path (`extract`, `predict`: strict readers,
    which refuse a bad image by name): a decompression bomb, Pillow's warning or its error, is
    raised as a ValueError for the caller to name the file, not printed as a warning nor left an
    unexpected error; other warnings are left as they are."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            yield
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ValueError(f"a possible decompression bomb ({first_line(err)})") from err


def open_image(source):
    """`PIL.Image.open(source)` (a path or a binary file), refused (ValueError) when its header
    says more than `MAX_PIXELS` pixels, before anything is decoded. Use it within `decoding`."""
    from PIL import Image

    image = Image.open(source)
    width, height = image.size
    if width * height > MAX_PIXELS:
        image.close()
        raise ValueError(f"{width}x{height} pixels, more than the {MAX_PIXELS} a publishing "
                         "job decodes")
    return image


def unreadable(row: int, err: BaseException) -> Defect:
    """The null record of an image that cannot be read, and why (for the owner)."""
    return Defect(row, NULL, f"not a readable image ({image_error(err)})")


def image_error(err: BaseException) -> str:
    """Why Pillow could not read an image, in one line without an object's address."""
    from PIL import UnidentifiedImageError

    return ("not an image format Pillow reads" if isinstance(err, UnidentifiedImageError)
            else first_line(err))


def label_values(values) -> tuple[np.ndarray, list[Defect]]:
    """Labels as read, element by element: (N,) int64, a value that is not an integer (None, a
    string, a float, an integer beyond int64) made `NULL_LABEL` with a `NULL` defect quoting it.
    The range check against the classes is `label_defects`'.

    Args:
      values: (N,) labels: an array, or a sequence of any values.
    """
    if isinstance(values, np.ndarray) and np.issubdtype(values.dtype, np.integer):
        return values.reshape(-1).astype(np.int64), []
    if not isinstance(values, np.ndarray):
        values = list(values)
    out, found = np.full(len(values), NULL_LABEL, np.int64), []
    limit = np.iinfo(np.int64).max
    for row, value in enumerate(values):
        if (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
                and -limit <= value <= limit):
            out[row] = value
        else:
            found.append(Defect(row, NULL, f"label {value!r:.40} is not an int64 integer"))
    return out, found


def integer_pixels(values, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Records of pixels, as (N, *shape): an array as it is (`pixel_rule` clamps it, or refuses
    its dtype); Python objects element by element, as int64 clipped to [-1, 256] for
    `pixel_rule` to clamp, a record holding a value that is not an integer being null.

    Returns:
      (the pixels, the rows holding a value that is not an integer: null records).
    """
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values.reshape((-1, *shape)), np.zeros(0, np.int64)
    array = np.array(values, dtype=object).reshape((-1, *shape))
    flat = array.reshape(-1)
    bad = np.array([not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_))
                    for v in flat], bool)
    out = np.array([0 if b else min(max(int(v), -1), 256)
                    for v, b in zip(flat, bad, strict=True)], np.int64)
    return out.reshape(array.shape), np.flatnonzero(bad.reshape(len(array), -1).any(axis=1))
