"""The feature cache: a chunked Zarr v3 store with labels and full provenance.

Layout:

    STORE/                      attrs: format, format_version, backbone (shared by every split)
    STORE/{train,test}/         attrs: provenance (backbone, weights, preprocessing, dataset
                                       fingerprint, dims, dtype, created) and `complete`
    STORE/SPLIT/features        (N, d) or (N, views, d), float16/float32, chunked by rows
    STORE/SPLIT/labels          (N,) int32, same row chunks
    STORE/SPLIT/chunks_done     (num_chunks,) uint8, one Zarr chunk per entry

A row chunk is written, then its `chunks_done` entry is set; `complete` is set only once every
entry is set. A killed writer therefore leaves a split that is not complete, and rerunning the
same job rewrites exactly the chunks that were not done (chunks are independent files, so
separate processes can fill disjoint chunks of one split).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "IncompleteSplitError",
    "SplitWriter",
    "choose_rows_per_chunk",
    "iter_split_chunks",
    "load_split",
    "open_split",
    "split_attrs",
    "store_summary",
]

FORMAT = "dpprobe.features"
FORMAT_VERSION = 1
FEATURE_DTYPES = ("float16", "float32")
# Keys of a split's attributes that identify the job that writes it: a partial split may only
# be resumed by the same job.
_JOB_KEYS = ("backbone", "preprocessing", "dataset", "feature_shape", "dtype", "rows_per_chunk")


class IncompleteSplitError(RuntimeError):
    """The split exists but its extraction did not finish."""


def _compressor():
    return zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")


def choose_rows_per_chunk(
    num_rows: int, row_shape: tuple[int, ...], itemsize: int, target_bytes: int = 8 << 20
) -> int:
    """Rows per chunk for ~`target_bytes` per chunk, a multiple of 64, within [64, num_rows]."""
    row_bytes = max(1, int(np.prod(row_shape)) * itemsize)
    rows = max(64, (target_bytes // row_bytes) // 64 * 64)
    return int(max(1, min(rows, num_rows)))


def _open_root(store, mode: str) -> zarr.Group:
    try:
        return zarr.open_group(store, mode=mode, zarr_format=3)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no feature store at {store}") from err


class SplitWriter:
    """Writes one split of a feature store chunk by chunk, resumably.

    Args:
      store: store path (or URL).
      split: "train" or "test".
      num_rows: N.
      feature_shape: (d,) or (views, d).
      dtype: "float16" or "float32".
      provenance: {"backbone": ..., "preprocessing": ..., "dataset": ...}.
      rows_per_chunk: chunk height; None chooses from rows x d.
      overwrite: discard an existing split of a different job (or a complete one).
    """

    def __init__(
        self,
        store,
        split: str,
        *,
        num_rows: int,
        feature_shape: tuple[int, ...],
        dtype: str,
        provenance: dict[str, Any],
        rows_per_chunk: int | None = None,
        overwrite: bool = False,
    ):
        if dtype not in FEATURE_DTYPES:
            raise ValueError(f"dtype must be one of {FEATURE_DTYPES}, got {dtype!r}")
        if num_rows < 1:
            raise ValueError(f"a split needs at least one row, got {num_rows}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        itemsize = np.dtype(dtype).itemsize
        rows_per_chunk = rows_per_chunk or choose_rows_per_chunk(num_rows, feature_shape, itemsize)
        self.split = split
        self.num_rows = int(num_rows)
        self.rows_per_chunk = int(rows_per_chunk)
        self.num_chunks = math.ceil(num_rows / rows_per_chunk)
        job = {
            "backbone": provenance["backbone"],
            "preprocessing": provenance.get("preprocessing", {}),
            "dataset": provenance["dataset"],
            "feature_shape": list(feature_shape),
            "dtype": dtype,
            "rows_per_chunk": self.rows_per_chunk,
        }
        root = _open_root(store, "a")
        self._check_root(root, job["backbone"])
        existing = root.get(split)
        if existing is not None and not overwrite:
            old = dict(existing.attrs)
            same_job = all(_jsonable(old.get(k)) == _jsonable(job[k]) for k in _JOB_KEYS)
            if not same_job:
                raise ValueError(
                    f"{store}/{split} was written by a different job (backbone, data, "
                    "preprocessing or layout differ); pass --overwrite to replace it"
                )
            self.group = existing
            self.resumed = True
        else:
            self.group = self._create(root, split, job, feature_shape, dtype)
            self.resumed = False
        self.features = self.group["features"]
        self.labels = self.group["labels"]
        self.chunks_done = self.group["chunks_done"]

    def _check_root(self, root: zarr.Group, backbone: dict) -> None:
        attrs = dict(root.attrs)
        if not attrs:
            root.attrs.update(
                {"format": FORMAT, "format_version": FORMAT_VERSION, "backbone": backbone}
            )
            return
        if attrs.get("format") != FORMAT:
            raise ValueError(
                f"{root.store} is not a dpprobe feature store (format={attrs.get('format')!r})"
            )
        if _jsonable(attrs.get("backbone")) != _jsonable(backbone):
            others = [name for name in ("train", "test") if name in root and name != self.split]
            if others:
                raise ValueError(
                    f"the store's splits {others} were extracted with backbone "
                    f"{attrs.get('backbone', {}).get('name')!r} ({attrs.get('backbone')}); "
                    "all splits of a store share one backbone. Use another --out, or delete "
                    "the store first"
                )
            root.attrs["backbone"] = backbone

    def _create(self, root, split, job, feature_shape, dtype) -> zarr.Group:
        group = root.create_group(split, overwrite=True)
        rows = self.rows_per_chunk
        group.create_array(
            "features",
            shape=(self.num_rows, *feature_shape),
            chunks=(rows, *feature_shape),
            dtype=dtype,
            compressors=_compressor(),
        )
        group.create_array("labels", shape=(self.num_rows,), chunks=(rows,), dtype="int32")
        group.create_array(
            "chunks_done", shape=(self.num_chunks,), chunks=(1,), dtype="uint8", fill_value=0
        )
        group.attrs.update(
            job
            | {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "split": split,
                "num_examples": self.num_rows,
                "feature_dim": int(feature_shape[-1]),
                "views": int(feature_shape[0]) if len(feature_shape) == 2 else 1,
                "num_classes": job["dataset"].get("num_classes"),
                "created": _now(),
                "complete": False,
            }
        )
        return group

    def chunk_rows(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.rows_per_chunk
        return start, min(start + self.rows_per_chunk, self.num_rows)

    def pending_chunks(self) -> list[int]:
        done = np.asarray(self.chunks_done[:])
        return [int(c) for c in np.flatnonzero(done == 0)]

    def write_chunk(self, chunk: int, features: np.ndarray, labels: np.ndarray) -> None:
        """Write one whole row chunk, then mark it done."""
        start, stop = self.chunk_rows(chunk)
        features = np.asarray(features)
        expected = (stop - start, *self.features.shape[1:])
        if features.shape != expected:
            raise ValueError(
                f"chunk {chunk} needs features of shape {expected}, got {features.shape}"
            )
        if not np.isfinite(features).all():
            raise ValueError(f"chunk {chunk} (rows {start}:{stop}) has NaN/Inf features")
        self.features[start:stop] = features.astype(self.features.dtype)
        self.labels[start:stop] = np.asarray(labels, np.int32)
        self.chunks_done[chunk] = 1

    def finalize(self) -> bool:
        """Mark the split complete if every chunk is done; returns whether it is complete."""
        if self.pending_chunks():
            return False
        self.group.attrs.update({"complete": True, "completed": _now()})
        return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _jsonable(value):
    """Normalize tuples/lists so attrs read back from JSON compare equal to fresh ones."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def open_split(store, split: str, *, require_complete: bool = True) -> zarr.Group:
    """The Zarr group of a split; raises a clear error if missing or incomplete."""
    root = _open_root(store, "r")
    if dict(root.attrs).get("format") != FORMAT:
        raise ValueError(f"{store} is not a dpprobe feature store")
    if split not in root:
        present = [name for name in ("train", "test") if name in root]
        raise KeyError(f"{store} has no {split!r} split (it has {present}); extract it first")
    group = root[split]
    if require_complete and not group.attrs.get("complete", False):
        done = np.asarray(group["chunks_done"][:])
        raise IncompleteSplitError(
            f"{store}/{split} is incomplete ({int(done.sum())}/{done.size} chunks done): its "
            "extraction was interrupted. Rerun the same `dpprobe extract` command to resume."
        )
    return group


def split_attrs(store, split: str) -> dict:
    return dict(open_split(store, split, require_complete=False).attrs)


def load_split(store, split: str, dtype=np.float32) -> tuple[np.ndarray, np.ndarray, dict]:
    """(features as `dtype`, labels int32, attrs) of a complete split, read into memory."""
    group = open_split(store, split)
    features = np.asarray(group["features"][:], dtype=dtype)
    return features, np.asarray(group["labels"][:], np.int32), dict(group.attrs)


def iter_split_chunks(
    store, split: str, dtype=np.float32
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Stream (features, labels) row chunk by row chunk, for stores larger than memory."""
    group = open_split(store, split)
    features, labels = group["features"], group["labels"]
    rows = features.chunks[0]
    for start in range(0, features.shape[0], rows):
        stop = min(start + rows, features.shape[0])
        yield np.asarray(features[start:stop], dtype=dtype), np.asarray(labels[start:stop])


def store_summary(store) -> dict:
    """Root and per-split attributes (provenance) of a store, with completion counts."""
    root = _open_root(store, "r")
    summary = {"root": dict(root.attrs), "splits": {}}
    for name in ("train", "test"):
        if name in root:
            group = root[name]
            done = np.asarray(group["chunks_done"][:])
            summary["splits"][name] = dict(group.attrs) | {
                "chunks_done": int(done.sum()),
                "num_chunks": int(done.size),
            }
    return summary
