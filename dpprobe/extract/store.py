"""The feature store's format: a chunked Zarr v3 store with labels and full provenance.

Layout:

    STORE/                      attrs: format, format_version, backbone (shared by every split)
    STORE/{train,test}/         attrs: provenance (backbone, weights, preprocessing, dataset
                                       fingerprint, dims, dtype, created) and `complete`
    STORE/SPLIT/features        (N, d) or (N, views, d), float16/float32, chunked by rows
    STORE/SPLIT/labels          (N,) int32, same row chunks
    STORE/SPLIT/chunks_done     (num_chunks,) uint8, one Zarr chunk per entry
    STORE/SPLIT/chunk_sha256    (num_chunks, 32) uint8: sha256 of each chunk's stored rows

A row chunk is written (features, labels, checksum), then its `chunks_done` entry is set;
`complete` is set only once every entry is set. Every chunk the writer writes reaches the disk,
also one whose values all equal the array's fill value (Zarr 3 skips those by default,
`write_empty_chunks=False`: a labels chunk holding only class 0, rows sorted by class, or a
features chunk of zeros would then leave no file). Writing them keeps one simple rule, a
complete split has a file for every chunk, which a reader checks without decoding anything.
Stores written before that rule (format version 1 as written by dpprobe 0.1.0) may lack such
chunk files: a missing features or labels chunk is accepted exactly when the sha256 recorded for
that chunk equals the sha256 of the rows Zarr reads in its place (the fill value), so those
stores open and verify without re-extraction, and a chunk that held anything else is still
reported missing. Zarr's local store writes every file
atomically (temp file + rename), so a writer killed at any point (SIGKILL included) leaves a
split that is not complete and whose done chunks are intact; rerunning the same job rewrites
exactly the chunks that were not done. Chunks are independent files, so separate processes
(`--shard k/n`, Ray tasks) can fill disjoint chunks of one split.

This module holds the format and its invariants (opening a store, checking a complete split
against its metadata, what the splits of one store share). Around it: `extract.zarr_io` reaches
the store's Zarr nodes (local or by URL) with errors naming the damaged file,
`extract.writer` writes a split (`SplitWriter`), `extract.read` reads one into memory or
chunk by chunk, and `extract.verify` checks a whole store (`dpprobe verify`).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import math
import os
from typing import TYPE_CHECKING

import numpy as np

from dpprobe.extract.zarr_io import (
    DamagedStoreError,
    StorePath,
    check_url_backend,
    first_line,
    is_local,
    open_array,
    open_group,
    open_root,
    read_json,
    split_names,
)

if TYPE_CHECKING:
    import zarr

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DamagedStoreError",
    "IncompleteSplitError",
    "StorePath",
    "check_chunk_files",
    "check_out_path",
    "choose_rows_per_chunk",
    "failed_split",
    "mark_failed",
    "chunk_checksum",
    "identity_differences",
    "jsonable",
    "local_split_attrs",
    "open_split",
    "shard_chunks",
    "split_attrs",
    "store_identity",
    "store_summary",
    "timestamp",
]

FORMAT = "dpprobe.features"
FORMAT_VERSION = 1
FEATURE_DTYPES = ("float16", "float32")
# Preprocessing keys that may differ between the splits of one store: the train split's
# augmented views (the test split is never augmented) and the autocast speed knob.
_PER_SPLIT_PREPROCESSING = ("views", "augment", "augment_seed", "amp")


class IncompleteSplitError(RuntimeError):
    """The split exists but its extraction did not finish."""


def choose_rows_per_chunk(
    num_rows: int, row_shape: tuple[int, ...], itemsize: int, target_bytes: int = 8 << 20
) -> int:
    """Rows per chunk for ~`target_bytes` per chunk, a multiple of 64, within [64, num_rows]."""
    row_bytes = max(1, int(np.prod(row_shape)) * itemsize)
    rows = max(64, (target_bytes // row_bytes) // 64 * 64)
    return int(max(1, min(rows, num_rows)))


def chunk_checksum(features: np.ndarray, labels: np.ndarray) -> bytes:
    """sha256 of a chunk's rows exactly as stored (dtype, shape, bytes; then labels)."""
    digest = hashlib.sha256()
    for array in (np.ascontiguousarray(features), np.ascontiguousarray(labels, np.int32)):
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array)  # the contiguous buffer itself: `tobytes()` would copy it first
    return digest.digest()


def shard_chunks(num_chunks: int, shard: tuple[int, int] | None) -> list[int]:
    """The contiguous run of chunk indices that shard k of n owns (all chunks if None)."""
    if shard is None:
        return list(range(num_chunks))
    index, count = shard
    if not (count >= 1 and 0 <= index < count):
        raise ValueError(f"shard must be k/n with 0 <= k < n, got {index}/{count}")
    return [int(c) for c in np.array_split(np.arange(num_chunks), count)[index]]


def check_out_path(store: StorePath) -> bool:
    """Refuse an output path that is neither new nor a dpprobe feature store.

    dpprobe never writes into (or deletes from) a folder it did not create: `--out` must be a
    new path, an empty folder, or a store recognized by its root attributes. Returns whether
    the store already exists. URLs are checked when opened.
    """
    if not is_local(store):
        check_url_backend(store)
        return False
    path = os.fspath(store)
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path):
        raise ValueError(f"`out` {path} is an existing file, not a dpprobe feature store; "
                         "give a new path")
    entries = [name for name in os.listdir(path) if not name.startswith(".dpprobe-")]
    if not entries:
        return False
    root = _root_metadata(path)
    if not _ours(root):
        what = "a Zarr store not written by dpprobe" if root is not None else "a folder"
        raise ValueError(f"`out` {path} is {what} (not a dpprobe feature store); dpprobe only "
                         "writes into a new path or its own store: give another `out`")
    return True


CREATE_LOCK = ".dpprobe-create.lock"  # `extract.SplitWriter` creates a store's root under it


def _root_metadata(path: str) -> dict | None:
    """A local store's root zarr.json, read again under the writers' creation lock when it
    does not look like ours yet: a shard started beside another may find the root that the
    other has written but not yet given its attributes (two writes, under that lock)."""
    root = read_json(os.path.join(path, "zarr.json"))
    lock = os.path.join(path, CREATE_LOCK)
    if _ours(root) or not os.path.isfile(lock):
        return root
    with open(lock) as handle:  # only read: never a file in a folder dpprobe did not make
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            return read_json(os.path.join(path, "zarr.json"))
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ours(root: dict | None) -> bool:
    """Whether a root zarr.json's attributes name dpprobe's store format."""
    return root is not None and (root.get("attributes") or {}).get("format") == FORMAT


def store_identity(attrs: dict) -> dict:
    """What every split of one store must share: backbone (weights identity included),
    preprocessing (except the train split's views and the autocast), feature dim and the
    declared class list."""
    preprocessing = {k: v for k, v in (attrs.get("preprocessing") or {}).items()
                     if k not in _PER_SPLIT_PREPROCESSING}
    dataset = attrs.get("dataset") or {}
    return jsonable({
        "backbone": attrs.get("backbone"),
        "preprocessing": preprocessing,
        "feature_dim": (attrs.get("feature_shape") or [None])[-1],
        "class_names": attrs.get("class_names", dataset.get("class_names")),
    })


def identity_differences(one: dict, other: dict) -> list[str]:
    """The names of the `store_identity` fields in which two splits' attributes differ."""
    a, b = store_identity(one), store_identity(other)
    return [key for key in a if a[key] != b[key]]


def open_split(store: StorePath, split: str, *, require_complete: bool = True) -> zarr.Group:
    """The Zarr group of a split; raises a clear error if missing, incomplete or damaged.

    A complete split is checked against its own metadata before it is returned: array shapes,
    dtypes and chunking as recorded, every chunk marked done and (on local disk) every chunk
    file present. A missing chunk file would otherwise read as zeros.
    """
    root = open_root(store, "r")
    if dict(root.attrs).get("format") != FORMAT:
        raise ValueError(f"{store} is not a dpprobe feature store")
    present = split_names(root, store)
    if split not in present:
        raise KeyError(f"{store} has no {split!r} split (it has {present}); extract it first")
    group = open_group(root, store, split)
    attrs = dict(group.attrs)
    if require_complete and not attrs.get("complete", False):
        done = np.asarray(open_array(group, store, split, "chunks_done")[:])
        raise IncompleteSplitError(
            f"{store}/{split} is incomplete ({int(done.sum())}/{done.size} chunks done): its "
            "extraction was interrupted. Rerun the same `dpprobe extract` command to resume."
        )
    if require_complete:
        _check_complete_split(group, store, split, attrs)
    return group


def _check_complete_split(group: zarr.Group, store: StorePath, split: str, attrs: dict) -> None:
    """Refuse a complete split whose arrays do not match its attributes or whose chunks are
    not all done and present (one line naming split, array and chunk)."""
    where = f"{store}/{split}"
    try:
        num_rows = int(attrs["num_examples"])
        row_shape = tuple(int(v) for v in attrs["feature_shape"])
        rows = int(attrs["rows_per_chunk"])
        dtype = np.dtype(attrs["dtype"])
    except (KeyError, TypeError, ValueError) as err:
        raise DamagedStoreError(f"{where}/zarr.json: attributes unreadable ({err!r})") from err
    num_chunks = math.ceil(num_rows / rows)
    expected = {
        "features": ((num_rows, *row_shape), (rows, *row_shape), dtype),
        "labels": ((num_rows,), (rows,), np.dtype(np.int32)),
        "chunks_done": ((num_chunks,), (1,), np.dtype(np.uint8)),
        "chunk_sha256": ((num_chunks, 32), (1, 32), np.dtype(np.uint8)),
    }
    arrays = {}
    for name, (shape, chunks, kind) in expected.items():
        array = arrays[name] = open_array(group, store, split, name)
        if tuple(array.shape) != shape or tuple(array.chunks) != chunks or array.dtype != kind:
            raise DamagedStoreError(
                f"{where}/{name}/zarr.json says {array.dtype} {tuple(array.shape)} in chunks "
                f"{tuple(array.chunks)}, the split's attributes say {kind} {shape} in chunks "
                f"{chunks}: the metadata was altered")
    if is_local(store):
        check_chunk_files(group, store, split)
    try:
        done = np.asarray(arrays["chunks_done"][:])
    except Exception as err:  # noqa: BLE001
        raise DamagedStoreError(f"{where}/chunks_done is unreadable "
                                f"({type(err).__name__}: {first_line(err)})") from err
    if not done.all():
        raise DamagedStoreError(f"{where} is marked complete but chunks "
                                f"{np.flatnonzero(done == 0).tolist()[:10]} are not marked done")


def check_chunk_files(group: zarr.Group, store: StorePath, split: str) -> None:
    """Refuse a local split whose chunk files are not all on disk, naming the first missing one.

    `chunks_done` and `chunk_sha256` never hold fill values once their chunk is written. A
    missing `features` or `labels` chunk file is accepted exactly when the sha256 recorded for
    that row chunk equals that of the rows Zarr reads in its place (the arrays' fill value):
    the chunk held only fill values and an older writer skipped it (see the module docstring).
    """
    sums = None
    for name in ("chunks_done", "chunk_sha256", "features", "labels"):
        array = open_array(group, store, split, name)
        for chunk in _missing_chunks(array, os.path.join(store, split, name)):
            if name in ("features", "labels"):
                if sums is None:
                    sums = np.asarray(open_array(group, store, split, "chunk_sha256")[:])
                if _is_fill_chunk(group, store, split, sums, chunk):
                    continue
            key = array.metadata.encode_chunk_key((chunk,) + (0,) * (array.ndim - 1))
            raise DamagedStoreError(f"{store}/{split}/{name}: chunk {chunk} (file {key}) is "
                                    "missing; the store is damaged (re-extract the split)")


def _missing_chunks(array: zarr.Array, base: str) -> list[int]:
    """Row-chunk indices of a local array whose chunk file is not on disk."""
    rest = (0,) * (array.ndim - 1)
    num_chunks = math.ceil(array.shape[0] / array.chunks[0])
    return [chunk for chunk in range(num_chunks) if not os.path.isfile(
        os.path.join(base, array.metadata.encode_chunk_key((chunk, *rest))))]


def _is_fill_chunk(group: zarr.Group, store: StorePath, split: str, sums: np.ndarray,
                   chunk: int) -> bool:
    """Whether row chunk `chunk`, as Zarr reads it (fill values for a missing file), has the
    sha256 recorded when it was written."""
    features = open_array(group, store, split, "features")
    rows = features.chunks[0]
    start, stop = chunk * rows, min((chunk + 1) * rows, features.shape[0])
    if chunk >= len(sums):
        return False
    try:
        block = np.asarray(features[start:stop])
        labels = np.asarray(open_array(group, store, split, "labels")[start:stop])
    except Exception:  # noqa: BLE001 - an unreadable chunk is not a fill chunk
        return False
    return bytes(sums[chunk]) == chunk_checksum(block, labels)


def mark_failed(group: zarr.Group, error: BaseException) -> None:
    """Record on a split that is not complete that its extraction raised `error` (its type
    only: a message may name a record), so that a corrected rerun may replace it
    (`failed_split`).

    Args:
      group: the split's Zarr group (open for writing).
      error: what the extraction raised.
    """
    if not group.attrs.get("complete", False):
        group.attrs.update({"failed": {"error": type(error).__name__, "at": timestamp()}})


def failed_split(attrs: dict) -> bool:
    """Whether a split's own extraction failed and it never completed: such a split holds
    nothing a reader uses, so any job may replace it without `overwrite` (a split that was
    killed, not failed, is resumed by its own job or replaced with `overwrite`; a complete
    split is never replaced without it).

    Args:
      attrs: the split's attributes.

    Returns:
      True for a failed, never-completed split.
    """
    return bool(attrs.get("failed")) and not attrs.get("complete", False)


def split_attrs(store: StorePath, split: str) -> dict:
    """A split's attributes (provenance, `complete`), complete or not."""
    return dict(open_split(store, split, require_complete=False).attrs)


def local_split_attrs(store: StorePath, split: str) -> dict | None:
    """A complete split's attributes, read from the Zarr v3 metadata (`zarr.json`) of a store on
    local disk without importing Zarr; None when that is not possible (a URL, a missing or
    incomplete split, not a dpprobe store): `open_split` then gives the answer or the error."""
    if not is_local(store):
        return None
    root = read_json(os.path.join(store, "zarr.json"))
    group = read_json(os.path.join(store, split, "zarr.json"))
    if root is None or group is None:
        return None
    attrs = group.get("attributes")
    if (not _ours(root) or group.get("node_type") != "group" or not isinstance(attrs, dict)
            or attrs.get("complete") is not True):
        return None
    return attrs


def store_summary(store: StorePath) -> dict:
    """Root and per-split attributes (provenance) of a store, with completion counts."""
    root = open_root(store, "r")
    if dict(root.attrs).get("format") != FORMAT:
        raise ValueError(f"{store} is not a dpprobe feature store")
    summary = {"root": dict(root.attrs), "splits": {}}
    for name in split_names(root, store):
        group = open_group(root, store, name)
        done = np.asarray(open_array(group, store, name, "chunks_done")[:])
        summary["splits"][name] = dict(group.attrs) | {
            "chunks_done": int(done.sum()),
            "num_chunks": int(done.size),
        }
    return summary


def timestamp() -> str:
    """The format's timestamps (a split's `created` and `completed`): UTC, ISO 8601, to the
    second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def jsonable(value):
    """Normalize tuples/lists so attrs read back from JSON compare equal to fresh ones."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value

