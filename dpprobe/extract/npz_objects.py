"""npz object arrays for a publishing job (`read_npz_images(strict=False)`): `images` saved with
dtype object (rows of their own shapes, lists, None) and `labels` of Python values.

NumPy stores an object array as a pickle, which `np.load(allow_pickle=False)` refuses. A
publishing job reads it with an unpickler that builds NumPy arrays of Python values and nothing
else (no code of the file's choosing runs), then applies the per-record rule to each row on its
own, as to an image file: `extract.defects.array_image` (None, ragged, strings, another shape,
more than `MAX_PIXELS` pixels or a NaN make a null record; floats are clamped to [0, 1],
integers to [0, 255]). Its rows have their own sizes, so the model's input size is public input
(`--resize` / `--crop`), as for image files. `dpprobe extract` still refuses an object array.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np

from dpprobe.extract.defects import array_image, label_values
from dpprobe.extract.splits import ImageSplit

__all__ = ["object_array", "object_images_split"]

# What an object array's pickle may name: NumPy's array and scalar reconstruction, nothing else.
_NUMPY_ONLY = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
               for name in ("_reconstruct", "scalar")} | {("numpy", "ndarray"),
                                                           ("numpy", "dtype")}


class _NumpyOnly(pickle.Unpickler):
    """An unpickler of NumPy arrays of Python values: any other class is refused."""

    def find_class(self, module, name):
        if (module, name) in _NUMPY_ONLY:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a NumPy array")


def object_array(data, key: str) -> np.ndarray | None:
    """Member `key` of an open `np.load` archive read by `_NumpyOnly` when it is an object
    array; None when it is not (np.load reads it) or its header is of a version this reader
    does not parse.

    Raises:
      ValueError: the pickle names a class outside NumPy's arrays, or is damaged (a fault of
        the whole file).
    """
    with data.zip.open(f"{key}.npy") as member:
        version = np.lib.format.read_magic(member)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None or not read(member)[2].hasobject:
            return None
        try:
            array = _NumpyOnly(member).load()
        except Exception as err:  # noqa: BLE001 - unpickling raises anything for a bad file
            raise ValueError(f"array {key!r} is an object array that cannot be read as NumPy "
                             f"arrays of Python values ({type(err).__name__})") from err
    if not isinstance(array, np.ndarray) or array.ndim < 1:
        raise ValueError(f"array {key!r} is not an array of rows")
    return array


def object_images_split(path: Path, split: str, images: np.ndarray, labels: np.ndarray,
                        class_names: list[str]) -> ImageSplit:
    """The split of an npz whose `images` is an object array: each row an image of its own
    (decoded by `array_image` when it is loaded, a null record where the rule says so), labels
    each on its own (`label_values`).

    Args:
      path: the npz (for the split's name).
      split: the split's name.
      images: (N, ...) object array, a record per row.
      labels: (N,) labels, of any dtype (an object array of Python values included).
      class_names: the declared class list.
    """
    labels, found = label_values(labels)
    digest = hashlib.sha256()
    for row in images:  # each row's values (none for a row that is not numbers)
        pixels = np.asarray(row) if isinstance(row, np.ndarray) else None
        if pixels is not None and not pixels.dtype.hasobject:
            digest.update(np.ascontiguousarray(pixels).tobytes())
    digest.update(labels.tobytes())
    return ImageSplit(dataset=f"npz:{path.name}", split=split, labels=labels,
                      class_names=class_names, fingerprint=digest.hexdigest(),
                      load=lambda i: array_image(images[i]), defects=found)
