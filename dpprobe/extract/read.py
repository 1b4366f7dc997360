"""Reading a complete split: into memory (`load_split`) or row chunk by row chunk
(`iter_split_chunks`, for stores larger than memory).

Every read checks each chunk against the sha256 recorded when it was written
(`extract.verify.check_chunk_sums`) and names the first chunk that is unreadable or differs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from dpprobe.extract.read_local import load_local_split
from dpprobe.extract.store import open_split
from dpprobe.extract.verify import check_chunk_sums
from dpprobe.extract.zarr_io import DamagedStoreError, StorePath, first_line

if TYPE_CHECKING:
    import zarr

__all__ = ["iter_split_chunks", "load_split", "sample_rows"]


def load_split(store: StorePath, split: str,
               dtype=np.float32) -> tuple[np.ndarray, np.ndarray, dict]:
    """(features as `dtype`, labels int32, attrs) of a complete split, read into memory.

    `dtype=None` keeps the stored dtype (a float16 cache stays half the size). Every chunk's
    sha256 is checked against the one recorded when it was written. The features start on a
    64-byte boundary, so that JAX's CPU client can use them without a copy.

    A complete local split in the writer's layout is read without importing Zarr
    (`extract.read_local`); any other, or one whose files that read cannot use, through Zarr.
    """
    local = load_local_split(store, split, _aligned_empty)
    if local is not None:
        features, labels, attrs = local
    else:
        group = open_split(store, split)
        stored = group["features"]
        features = _aligned_empty(stored.shape, stored.dtype)
        labels = np.empty(stored.shape[:1], np.int32)
        _read_into(store, group, features, labels)
        attrs = dict(group.attrs)
    if dtype is not None and np.dtype(dtype) != features.dtype:
        converted = _aligned_empty(features.shape, dtype)
        converted[...] = features
        features = converted
    return features, labels, attrs


def _read_into(store: StorePath, group: zarr.Group, features: np.ndarray,
               labels: np.ndarray) -> None:
    """Decode a split's features and labels straight into the given arrays (Zarr decodes the
    chunks concurrently), then check every chunk's sha256."""
    from zarr.buffer.cpu import NDBuffer

    stored = group["features"]
    where = f"{store}/{group.path}"
    if stored.shape != features.shape or stored.dtype != features.dtype:
        raise DamagedStoreError(f"{where}: stored features are {stored.dtype} {stored.shape}, "
                                f"their attributes say {features.dtype} {features.shape}")
    rows = stored.chunks[0]
    try:
        stored.get_basic_selection(Ellipsis, out=NDBuffer.from_numpy_array(features))
        labels[...] = group["labels"][:]
    except Exception:  # noqa: BLE001 - find the chunk that fails, and name it
        for name, array in (("features", stored), ("labels", group["labels"])):
            for start in range(0, array.shape[0], rows):
                try:
                    array[start:start + rows]
                except Exception as err:  # noqa: BLE001
                    raise _unreadable(f"{where}/{name}", start, rows, array.shape[0],
                                      err) from err
        raise
    check_chunk_sums(where, np.asarray(group["chunk_sha256"][:]), features, labels, rows)


def iter_split_chunks(
    store: StorePath, split: str, dtype=np.float32, row_range: tuple[int, int] | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Stream (features, labels) row chunk by row chunk, for stores larger than memory.

    `dtype=None` keeps the stored dtype (float16 halves the memory of each chunk). Each chunk
    is checked against its recorded sha256; a damaged one raises `DamagedStoreError`.
    `row_range` = (start, stop): only those rows (the chunks that hold them, each checked whole,
    cut to the range), e.g. one process's share of a multi-process job.
    """
    group = open_split(store, split)
    features, labels = group["features"], group["labels"]
    sums = np.asarray(group["chunk_sha256"][:])
    rows, (first, last) = features.chunks[0], row_range or (0, features.shape[0])
    where = f"{store}/{split}"
    for start in range(first - first % rows, min(last, features.shape[0]), rows):
        try:
            chunk = np.asarray(features[start:start + rows])
            chunk_labels = np.asarray(labels[start:start + rows])
        except Exception as err:  # noqa: BLE001
            raise _unreadable(f"{where}/features", start, rows, features.shape[0],
                              err) from err
        check_chunk_sums(where, sums, chunk, chunk_labels, rows, start=start)
        if first > start or last < start + len(chunk):
            cut = slice(max(first - start, 0), last - start)
            chunk, chunk_labels = chunk[cut], chunk_labels[cut]
        yield (chunk if dtype is None else chunk.astype(dtype, copy=False), chunk_labels)


def _unreadable(where: str, start: int, rows: int, num_rows: int,
                err: BaseException) -> DamagedStoreError:
    return DamagedStoreError(f"{where}: chunk {start // rows} (rows {start}:"
                             f"{min(start + rows, num_rows)}) is unreadable "
                             f"({type(err).__name__}: {first_line(err)})")


def _aligned_empty(shape: tuple[int, ...], dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an `alignment`-byte boundary.

    NumPy aligns to 16 bytes; JAX's CPU client uses a 64-byte-aligned host array in place
    (`jax.device_put` costs nothing) and copies any other.
    """
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + size].view(dtype).reshape(shape)


def sample_rows(store, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`rows` rows of the train split drawn without replacement (all if it has fewer), read
    chunk by chunk (each chunk's sha256 checked); the draw is from OS entropy.

    Args:
      store: the feature store.
      rows: how many rows.

    Returns:
      (features as float32, labels), in the split's order.
    """
    num_rows = int(open_split(store, "train")["labels"].shape[0])
    chosen = np.sort(np.random.default_rng().choice(num_rows, min(rows, num_rows),
                                                    replace=False))
    features, labels, offset = [], [], 0
    for chunk, chunk_labels in iter_split_chunks(store, "train", dtype=np.float32):
        local = chosen[(chosen >= offset) & (chosen < offset + len(chunk))] - offset
        features.append(chunk[local])
        labels.append(chunk_labels[local])
        offset += len(chunk)
    return np.concatenate(features), np.concatenate(labels)
