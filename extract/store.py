"""The feature cache: a chunked Zarr v3 store with labels and full provenance.

Layout:

    STORE/                      attrs: format, format_version, backbone (shared by every split)
    STORE/{train,test}/         attrs: provenance (backbone, weights, preprocessing, dataset
                                       fingerprint, dims, dtype, created) and `complete`
    STORE/SPLIT/features        (N, d) or (N, views, d), float16/float32, chunked by rows
    STORE/SPLIT/labels          (N,) int32, same row chunks
    STORE/SPLIT/chunks_done     (num_chunks,) uint8, one Zarr chunk per entry
    STORE/SPLIT/chunk_sha256    (num_chunks, 32) uint8: sha256 of each chunk's stored rows

A row chunk is written (features, labels, checksum), then its `chunks_done` entry is set;
`complete` is set only once every entry is set. Zarr's local store writes every file
atomically (temp file + rename), so a writer killed at any point (SIGKILL included) leaves a
split that is not complete and whose done chunks are intact; rerunning the same job rewrites
exactly the chunks that were not done. Chunks are independent files, so separate processes
(`--shard k/n`, Ray tasks) can fill disjoint chunks of one split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import importlib
import json
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import zarr

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "IncompleteSplitError",
    "SplitWriter",
    "VerifyReport",
    "choose_rows_per_chunk",
    "chunk_checksum",
    "finalize_split",
    "iter_split_chunks",
    "load_split",
    "open_split",
    "shard_chunks",
    "split_attrs",
    "store_summary",
    "verify_store",
]

FORMAT = "dpprobe.features"
FORMAT_VERSION = 1
FEATURE_DTYPES = ("float16", "float32")
# Keys of a split's attributes that identify the job that writes it: a partial split may only
# be resumed by the same job.
_JOB_KEYS = ("backbone", "preprocessing", "dataset", "feature_shape", "dtype", "rows_per_chunk")


class IncompleteSplitError(RuntimeError):
    """The split exists but its extraction did not finish."""


def _zarr():
    """Zarr, imported on first use (~0.25 s): a probe job reads its store in a child process
    (`SplitPrefetch`) and never imports it."""
    return importlib.import_module("zarr")


def _compressor():
    return _zarr().codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")


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
        digest.update(array.tobytes())
    return digest.digest()


def shard_chunks(num_chunks: int, shard: tuple[int, int] | None) -> list[int]:
    """The contiguous run of chunk indices that shard k of n owns (all chunks if None)."""
    if shard is None:
        return list(range(num_chunks))
    index, count = shard
    if not (count >= 1 and 0 <= index < count):
        raise ValueError(f"shard must be k/n with 0 <= k < n, got {index}/{count}")
    return [int(c) for c in np.array_split(np.arange(num_chunks), count)[index]]


def _is_local(store) -> bool:
    return isinstance(store, str | os.PathLike) and "://" not in str(store)


@contextlib.contextmanager
def _creation_lock(store):
    """Serialize split creation between processes sharing a local store (shards)."""
    if not _is_local(store):
        yield  # object stores: create the split before launching shards (as --ray does)
        return
    os.makedirs(store, exist_ok=True)
    with open(os.path.join(store, ".dpprobe-create.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_root(store, mode: str) -> zarr.Group:
    try:
        return _zarr().open_group(store, mode=mode, zarr_format=3)
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
        with _creation_lock(store):
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
        self.checksums = self.group["chunk_sha256"]

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
        group.create_array(
            "chunk_sha256", shape=(self.num_chunks, 32), chunks=(1, 32), dtype="uint8",
            fill_value=0,
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
        stored = features.astype(self.features.dtype)
        if not np.isfinite(stored).all():
            raise ValueError(f"chunk {chunk} (rows {start}:{stop}) overflows {stored.dtype}; "
                             "extract with --dtype float32")
        labels = np.asarray(labels, np.int32)
        self.features[start:stop] = stored
        self.labels[start:stop] = labels
        self.checksums[chunk] = np.frombuffer(chunk_checksum(stored, labels), np.uint8)
        self.chunks_done[chunk] = 1  # last: a chunk is done only once all of it is on disk

    def finalize(self) -> bool:
        """Mark the split complete if every chunk is done; returns whether it is complete."""
        return _mark_complete(self.group)


def _mark_complete(group: zarr.Group) -> bool:
    if not np.asarray(group["chunks_done"][:]).all():
        return False
    if not group.attrs.get("complete", False):
        group.attrs.update({"complete": True, "completed": _now()})
    return True


def finalize_split(store, split: str) -> bool:
    """Mark a split complete if all its chunks are done (e.g. after shards ran elsewhere)."""
    return _mark_complete(_open_root(store, "a")[split])


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
    """(features as `dtype`, labels int32, attrs) of a complete split, read into memory.

    `dtype=None` keeps the stored dtype (a float16 cache stays half the size).
    """
    group = open_split(store, split)
    stored = group["features"]
    features = _aligned_empty(stored.shape, stored.dtype)
    labels = np.empty(stored.shape[:1], np.int32)
    _read_into(group, features, labels)
    if dtype is not None and np.dtype(dtype) != features.dtype:
        converted = _aligned_empty(features.shape, dtype)
        converted[...] = features
        features = converted
    return features, labels, dict(group.attrs)


def _read_into(group, features: np.ndarray, labels: np.ndarray) -> None:
    """Decode a split's features and labels straight into the given arrays."""
    from zarr.core.buffer.cpu import NDBuffer

    stored = group["features"]
    if stored.shape != features.shape or stored.dtype != features.dtype:
        raise ValueError(f"{group.path}: stored features are {stored.dtype} {stored.shape}, "
                         f"their attributes say {features.dtype} {features.shape}")
    stored.get_basic_selection(Ellipsis, out=NDBuffer.from_numpy_array(features))
    labels[...] = group["labels"][:]


def local_split_attrs(store, split: str) -> dict | None:
    """A complete split's attributes, read from the Zarr v3 metadata (`zarr.json`) of a store on
    local disk without importing Zarr; None when that is not possible (a URL, a missing or
    incomplete split, not a dpprobe store): `open_split` then gives the answer or the error."""
    if not isinstance(store, str | os.PathLike) or "://" in os.fspath(store):
        return None
    try:
        with open(os.path.join(store, "zarr.json")) as f:
            root = json.load(f)
        with open(os.path.join(store, split, "zarr.json")) as f:
            group = json.load(f)
    except (OSError, ValueError):
        return None
    attrs = group.get("attributes") or {}
    if ((root.get("attributes") or {}).get("format") != FORMAT
            or group.get("node_type") != "group" or attrs.get("complete") is not True):
        return None
    return attrs


def can_prefetch_in_child() -> bool:
    """Whether `SplitPrefetch` may fork: a POSIX system, and a process with one thread that has
    not loaded JAX or torch (whose native thread pools make a fork unsafe)."""
    import sys
    import threading

    return (hasattr(os, "fork") and threading.active_count() == 1
            and not any(name in sys.modules for name in ("jax", "jaxlib", "torch")))


class SplitPrefetch:
    """Complete splits of a local store, read by a forked child process into shared memory.

    The parent goes on meanwhile: a probe job imports JAX (~0.7 s) while the child imports Zarr
    and decodes the features, on the other core, so the parent never imports Zarr at all. The
    arrays are page-aligned, so JAX's CPU client uses them in place. Check
    `can_prefetch_in_child()` first.

    Args:
      store: a local store directory.
      splits: {split: its attributes (from `local_split_attrs`)}: they give the shapes.
    """

    def __init__(self, store, splits: dict[str, dict]):
        self._arrays = {}
        for split, attrs in splits.items():
            shape = (int(attrs["num_examples"]), *attrs["feature_shape"])
            self._arrays[split] = (_shared_empty(shape, attrs["dtype"]),
                                   _shared_empty(shape[:1], np.int32))
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: read, report, and leave without running any parent code
            code = 1
            try:
                os.close(read_fd)
                for split, (features, labels) in self._arrays.items():
                    _read_into(open_split(store, split), features, labels)
                code = 0
            except BaseException as err:
                os.write(write_fd, f"{type(err).__name__}: {err}".encode()[:8192])
            finally:
                os._exit(code)
        os.close(write_fd)
        self._store, self._pid, self._read_fd, self._error = store, pid, read_fd, None

    def wait(self) -> None:
        """Wait for the child; raise if it failed."""
        if self._pid is not None:
            with os.fdopen(self._read_fd, "rb") as pipe:
                message = pipe.read().decode(errors="replace")
            _, status = os.waitpid(self._pid, 0)
            self._pid = None
            if os.waitstatus_to_exitcode(status) != 0:
                self._error = message or f"the reader exited with status {status}"
        if self._error:
            raise RuntimeError(f"reading {self._store} failed: {self._error}")

    def result(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(features as stored, labels int32) of a split."""
        self.wait()
        return self._arrays[split]


def _shared_empty(shape, dtype) -> np.ndarray:
    """A zeroed array in anonymous shared memory (visible to a forked child; page-aligned)."""
    import mmap

    dtype = np.dtype(dtype)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))
    return np.frombuffer(buffer, dtype, count=count).reshape(shape)


def _aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an `alignment`-byte boundary.

    NumPy aligns to 16 bytes; JAX's CPU client uses a 64-byte-aligned host array in place
    (`jax.device_put` costs nothing) and copies any other (~60 ms for 73 MB here).
    """
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + size].view(dtype).reshape(shape)


def iter_split_chunks(
    store, split: str, dtype=np.float32
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Stream (features, labels) row chunk by row chunk, for stores larger than memory.

    `dtype=None` keeps the stored dtype (float16 halves the memory of each chunk).
    """
    group = open_split(store, split)
    features, labels = group["features"], group["labels"]
    rows = features.chunks[0]
    for start in range(0, features.shape[0], rows):
        stop = min(start + rows, features.shape[0])
        chunk = np.asarray(features[start:stop])
        yield (chunk if dtype is None else chunk.astype(dtype, copy=False),
               np.asarray(labels[start:stop]))


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


@dataclasses.dataclass
class VerifyReport:
    """What `verify_store` found: `problems` is empty for a sound store."""

    problems: list[str]
    splits: dict

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(store, *, splits=("train", "test"), fingerprints: dict | None = None,
                 progress=None) -> VerifyReport:
    """Check a store: splits present and complete, shapes, NaN/Inf, label range, checksums.

    Args:
      store: store path.
      splits: the splits that must be present.
      fingerprints: optional {split: dataset fingerprint} recomputed from the source data;
        each must equal the one recorded at extraction.
      progress: optional callable(split, chunk, num_chunks) for a progress display.
    """
    problems: list[str] = []
    summary: dict = {}
    try:
        root = _open_root(store, "r")
    except FileNotFoundError as err:
        return VerifyReport([str(err)], {})
    if dict(root.attrs).get("format") != FORMAT:
        return VerifyReport([f"{store} is not a dpprobe feature store"], {})
    for split in splits:
        if split not in root:
            problems.append(f"{split}: missing split")
            continue
        group, attrs = root[split], dict(root[split].attrs)
        info = {"num_examples": attrs.get("num_examples"), "complete": attrs.get("complete")}
        summary[split] = info
        try:
            features, labels = group["features"], group["labels"]
            done = np.asarray(group["chunks_done"][:])
            sums = np.asarray(group["chunk_sha256"][:])
        except Exception as err:  # noqa: BLE001 - any read failure is a finding
            problems.append(f"{split}: arrays unreadable ({type(err).__name__}: {err})")
            continue
        num = attrs.get("num_examples")
        if features.shape != (num, *attrs.get("feature_shape", [])):
            problems.append(f"{split}: features shape {features.shape} != recorded "
                            f"({num}, {attrs.get('feature_shape')})")
        if labels.shape != (num,):
            problems.append(f"{split}: labels shape {labels.shape} != ({num},)")
        if str(features.dtype) != attrs.get("dtype"):
            problems.append(f"{split}: dtype {features.dtype} != recorded {attrs.get('dtype')}")
        if not attrs.get("complete"):
            problems.append(f"{split}: incomplete ({int(done.sum())}/{done.size} chunks done)")
        elif not done.all():
            problems.append(f"{split}: marked complete but chunks {np.flatnonzero(done == 0)} "
                            "are not done")
        rows = attrs.get("rows_per_chunk") or features.chunks[0]
        num_classes = attrs.get("num_classes")
        bad_chunks = 0
        for chunk in np.flatnonzero(done):
            start, stop = chunk * rows, min((chunk + 1) * rows, features.shape[0])
            if progress:
                progress(split, int(chunk), done.size)
            try:
                block = np.asarray(features[start:stop])
                block_labels = np.asarray(labels[start:stop])
            except Exception as err:  # noqa: BLE001
                problems.append(f"{split}: chunk {chunk} (rows {start}:{stop}) unreadable "
                                f"({type(err).__name__})")
                bad_chunks += 1
                continue
            if not np.isfinite(block).all():
                problems.append(f"{split}: chunk {chunk} (rows {start}:{stop}) has NaN/Inf")
                bad_chunks += 1
            if num_classes and block_labels.size and (
                    block_labels.min() < 0 or block_labels.max() >= num_classes):
                problems.append(f"{split}: chunk {chunk} has labels outside [0, {num_classes})")
                bad_chunks += 1
            if bytes(sums[chunk]) != chunk_checksum(block, block_labels):
                problems.append(f"{split}: chunk {chunk} (rows {start}:{stop}) is corrupted "
                                "(sha256 mismatch)")
                bad_chunks += 1
        info["chunks_checked"] = int(done.sum())
        info["bad_chunks"] = bad_chunks
        if fingerprints and split in fingerprints:
            recorded = attrs.get("dataset", {}).get("fingerprint")
            if recorded != fingerprints[split]:
                problems.append(f"{split}: dataset fingerprint {recorded} != source data "
                                f"{fingerprints[split]}")
    return VerifyReport(problems, summary)
