"""The public per-record rule of a publishing job, and the defects it finds for the data's owner.

A publishing job (`finetune`) must never let one record decide what it publishes: an abort
that only some record's content triggers, or a message quoting a record's value, tells D from
D with that record nulled with certainty (an unbounded epsilon for that record). So the
readers, opened with `strict=False`, apply one rule to every record alike instead of refusing
the dataset:

  - a label outside the declared classes, a NaN or Inf pixel, or an image that cannot be read
    makes a null record (label `NULL_LABEL`, zero pixels), which the trainer turns into a zero
    gradient (`dp.clipping.valid_labels`); so does a label that is not an integer or is
    missing, a missing image, a row of pixels that is None, ragged, of another length or
    holds a value of another type (`integer_pixels`, `array_image`), an image of more than
    `MAX_PIXELS` pixels (width x height, read from its header: it is never decoded) and an
    encoded image of more than `MAX_FILE_BYTES` bytes (told from its size: it is never read),
    whatever its source (`read_capped`, `check_bytes`, `load_image`);
  - Pillow's warnings about a record (its size, its EXIF, its palette) are never shown while
    it is decoded (`decoding`): a decompression-bomb warning makes a null record, the others
    are ignored;
  - float pixels are clamped to [0, 1], integer pixels to [0, 255], those of float and 16- or
    32-bit image files too (`image_mode`);
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
  whole source that no record's content decides (a dtype that is not a number, an array's
  shape). So replacing one record by a null record changes one row of the trainer's input
  and nothing else, which is the zero-out neighbouring relation the accounting assumes; and
  loading one record costs at most what the two caps allow, whatever its source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import warnings
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_FILE_BYTES", "MAX_PIXELS", "NULL", "NULL_LABEL", "Defect", "array_image",
           "check_bytes", "decoding", "first_line", "image_error", "image_mode",
           "integer_pixels", "label_defects", "label_values", "load_image", "open_image",
           "pixel_rule", "read_capped", "strict_decoding", "unreadable"]

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
    every = finite.all()
    if rows.shape[1]:
        safe = rows if every else np.where(finite[:, None], rows, low)
        smallest, largest = safe.min(axis=1), safe.max(axis=1)
        for i in np.flatnonzero(finite & ((smallest < low) | (largest > high))):
            defects.append(Defect(int(i), CLAMPED, f"pixels in [{smallest[i]}, {largest[i]}], "
                                  f"clamped to [{low}, {high}]"))
    # One float64 copy, clamped, scaled and rounded in place: a record at the pixel cap then
    # holds it once, not once a step.
    out = (images if every else np.where(finite.reshape((-1,) + (1,) * (images.ndim - 1)),
                                         images, low)).astype(np.float64)
    np.clip(out, low, high, out=out)
    out *= scale
    np.round(out, out=out)
    return out.astype(np.uint8), sorted(defects, key=lambda d: d.row)


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


def check_bytes(size: int) -> None:
    """The byte cap, told from a size alone, before anything is read: a ValueError for an
    encoded image of more than `MAX_FILE_BYTES` bytes (a null record)."""
    if size > MAX_FILE_BYTES:
        raise ValueError(f"more than {MAX_FILE_BYTES} bytes, the most a publishing job reads")


def read_capped(path) -> bytes:
    """An image file's bytes under the byte cap: its size checked before it is read, and at most
    `MAX_FILE_BYTES` + 1 bytes read (a file that grew since is refused all the same)."""
    check_bytes(os.stat(path).st_size)
    with open(path, "rb") as f:
        content = f.read(MAX_FILE_BYTES + 1)
    check_bytes(len(content))
    return content


def load_image(content: bytes, *, strict: bool = False):
    """One record's encoded image by the rule, whatever its source (an image file's bytes from
    `read_capped`, a dataset's embedded bytes): the byte cap (`check_bytes`), the pixel cap from
    its header (`open_image`), then decoded and brought to L or RGB (`image_mode`). Use it
    within `decoding`. Its memory and time are bounded by the two caps.

    Args:
      content: the encoded image (bytes, or a buffer).
      strict: an owner's reader (`extract`, within `strict_decoding`): no caps but Pillow's
        bomb check, and `image_mode`'s strict float rule.

    Raises:
      ValueError, OSError (or another of Pillow's errors): a record the rule makes null.
    """
    from PIL import Image

    if not strict:
        check_bytes(len(content))
    with (Image.open if strict else open_image)(io.BytesIO(content)) as image:
        image.load()
        out = image_mode(image, strict=strict)
        return image.copy() if out is image else out  # closing `image` frees its pixels


def image_mode(image, *, strict: bool = False):
    """A decoded image as L or RGB (itself when it is one), any other mode as RGB. Float and
    32- or 16-bit integer images (Pillow's modes F, I, I;16) go through `pixel_rule` (NaN or
    Inf: a null record; floats clamped to [0, 1] and scaled to 255, integers clamped to
    [0, 255]), never Pillow's conversion (which reads floats as 0-255, and NaN as 0); other
    modes are converted by Pillow.

    Args:
      image: a loaded PIL image.
      strict: an owner's reader (`extract`): a float image outside [0, 1] is refused too.

    Raises:
      ValueError: a record the rule makes null (or, `strict`, a float image it would clamp),
        quoting its pixels.
    """
    from PIL import Image

    if image.mode in ("L", "RGB"):
        return image
    if image.mode != "F" and not image.mode.startswith("I"):
        return image.convert("RGB")
    pixels = np.asarray(image)
    out, found = pixel_rule(pixels[None])
    null = [d for d in found if d.kind == NULL]
    if null:
        raise ValueError(null[0].detail)
    if strict and found and pixels.dtype.kind == "f":
        raise ValueError(f"float pixels must lie in [0, 1], got [{pixels.min()}, "
                         f"{pixels.max()}]")
    return Image.fromarray(out[0]).convert("RGB")  # RGB, as Pillow's conversion of any mode


def array_image(value):
    """One record given as pixels (a row of an `hf:` array column: nested lists or an
    array), by the rule: (H, W), (H, W, 1) or (H, W, 3) numbers through
    `pixel_rule`, at most `MAX_PIXELS` pixels; anything else (None, ragged, strings, another
    shape, more pixels, NaN) raises ValueError: a null record.
    """
    from PIL import Image

    if value is None:
        raise ValueError("no image")
    pixels = np.asarray(value)
    if pixels.dtype.hasobject:  # Python numbers to a numeric dtype; None or ragged raise here
        pixels = np.array(pixels.tolist())
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if pixels.ndim not in (2, 3) or (pixels.ndim == 3 and pixels.shape[-1] != 3) or (
            0 in pixels.shape):
        raise ValueError(f"pixels of shape {pixels.shape}, not (H, W[, 1 or 3])")
    if pixels.shape[0] * pixels.shape[1] > MAX_PIXELS:
        raise ValueError(f"{pixels.shape[1]}x{pixels.shape[0]} pixels, more than the "
                         f"{MAX_PIXELS} a publishing job decodes")
    out, found = pixel_rule(pixels[None])
    null = [d for d in found if d.kind == NULL]
    if null:
        raise ValueError(null[0].detail)
    return Image.fromarray(out[0])


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
    """Records of pixels as (N, *shape), each record on its own (CIFAR's `data`).

    A numeric array shaped (N, *shape) or (N, prod(shape)) is taken as it is (`pixel_rule`
    clamps it, or refuses its dtype). A sequence of records (a list, an object array) is read
    record by record: a record of prod(shape) integers, flat or nested as `shape` (a list or an
    integer array), is kept as int64 clipped to [-1, 256] for `pixel_rule` to clamp; any other
    record (None, a row a pixel short or long, ragged, a float, a string) is a null record.

    Args:
      values: the records.
      shape: one record's shape (public: the format's).

    Returns:
      (the pixels, with zeros for a null record; the rows of the null records).

    Raises:
      ValueError: for a fault of the whole source, which no record decides: an array of
        another shape, or `values` neither an array nor a sequence of records.
    """
    size = math.prod(shape)
    if isinstance(values, np.ndarray) and values.dtype != object:
        if values.ndim < 1 or values.shape[1:] not in (tuple(shape), (size,)):
            raise ValueError(f"an array of shape {values.shape}, not (N, {size}) or "
                             f"(N, {', '.join(map(str, shape))})")
        return values.reshape((-1, *shape)), np.zeros(0, np.int64)
    if not isinstance(values, (list, tuple, np.ndarray)) or getattr(values, "ndim", 1) == 0:
        raise ValueError(f"{type(values).__name__}, not an array or a list of records")
    out, bad = np.zeros((len(values), *shape), np.int64), []
    for row, record in enumerate(values):
        pixels = _record_integers(record, tuple(shape), size)
        if pixels is None:
            bad.append(row)
        else:
            out[row] = pixels
    return out, np.asarray(bad, np.int64)


def _record_integers(record, shape: tuple[int, ...], size: int) -> np.ndarray | None:
    """One record's integers as int64 (`shape`) clipped to [-1, 256], or None: a null record."""
    if isinstance(record, np.ndarray) and record.dtype != object:
        if record.shape not in (shape, (size,)) or record.dtype.kind not in "iu":
            return None
        # Through float64, which orders any integer rightly: a cast to int64 could wrap one.
        return np.clip(record.astype(np.float64), -1, 256).astype(np.int64).reshape(shape)
    if not isinstance(record, (list, tuple, np.ndarray)):
        return None
    try:
        array = np.array(record, dtype=object)
    except (ValueError, TypeError):  # nested and ragged
        return None
    if array.shape not in (shape, (size,)):
        return None
    values = array.reshape(-1)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
               for v in values):
        return None
    return np.array([min(max(int(v), -1), 256) for v in values], np.int64).reshape(shape)
