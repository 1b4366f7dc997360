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
import errno
import fcntl
import hashlib
import importlib
import json
import math
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import zarr

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DamagedStoreError",
    "IncompleteSplitError",
    "SplitWriter",
    "VerifyReport",
    "choose_rows_per_chunk",
    "check_out_path",
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
# Preprocessing keys that may differ between the splits of one store: the train split's
# augmented views (the test split is never augmented) and the autocast speed knob.
_PER_SPLIT_PREPROCESSING = ("views", "augment", "augment_seed", "amp")
# Optional packages that fsspec needs for a store URL's scheme, and how to install them.
_URL_BACKENDS = {
    "s3": ("s3fs", "pip install s3fs"),
    "s3a": ("s3fs", "pip install s3fs"),
    "gs": ("gcsfs", "pip install gcsfs"),
    "gcs": ("gcsfs", "pip install gcsfs"),
    "http": ("aiohttp", "pip install aiohttp"),
    "https": ("aiohttp", "pip install aiohttp"),
    "az": ("adlfs", "pip install adlfs"),
    "abfs": ("adlfs", "pip install adlfs"),
}


class DamagedStoreError(ValueError):
    """A store whose files do not hold what its metadata promises (missing or corrupt chunks,
    unreadable or inconsistent metadata)."""


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


def _check_url_backend(store) -> None:
    """Refuse a store URL whose fsspec backend is not installed, with the install command."""
    if _is_local(store):
        return
    scheme = str(store).split("://", 1)[0].lower()
    backend = _URL_BACKENDS.get(scheme)
    if backend and importlib.util.find_spec(backend[0]) is None:
        raise ValueError(f"store {store}: {scheme}:// URLs need the {backend[0]} package; "
                         f"install it with `{backend[1]}`")


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def check_out_path(store) -> bool:
    """Refuse an output path that is neither new nor a dpprobe feature store.

    dpprobe never writes into (or deletes from) a folder it did not create: `--out` must be a
    new path, an empty folder, or a store recognized by its root attributes. Returns whether
    the store already exists. URLs are checked when opened.
    """
    if not _is_local(store):
        _check_url_backend(store)
        return False
    path = os.fspath(store)
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path):
        raise ValueError(f"--out {path} is an existing file, not a dpprobe feature store; "
                         "give a new path")
    entries = [name for name in os.listdir(path) if not name.startswith(".dpprobe-")]
    if not entries:
        return False
    root = _read_json(os.path.join(path, "zarr.json"))
    if root is None or (root.get("attributes") or {}).get("format") != FORMAT:
        what = "a Zarr store not written by dpprobe" if root is not None else "a folder"
        raise ValueError(f"--out {path} is {what} (not a dpprobe feature store); dpprobe only "
                         "writes into a new path or its own store: give another --out")
    return True


# Locks this process holds: {lock file: [open handle, count]}, so that one process may open a
# split twice (e.g. resume after an error) while any other process is refused.
_HELD_LOCKS: dict[str, list] = {}
_HELD_LOCKS_GUARD = threading.Lock()


class _SplitLock:
    """One writer per split: an flock on STORE/.dpprobe-SPLIT.lock, holding the writer's pid.

    Shards (`shared=True`) write disjoint chunks of one split and share the lock; any other
    writer needs it alone. The kernel releases an flock when its process dies (SIGKILL
    included), so a lock file left by a crashed writer is stale and simply taken over.
    """

    def __init__(self, store, split: str, *, shared: bool):
        self.path = os.path.realpath(os.path.join(store, f".dpprobe-{split}.lock"))
        with _HELD_LOCKS_GUARD:
            held = _HELD_LOCKS.get(self.path)
            if held is not None:
                held[1] += 1
                self.handle = held[0]
                return
            handle = open(self.path, "a+")  # noqa: SIM115 - held for the writer's lifetime
            try:
                fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise ValueError(
                    f"{store}/{split} is being written by {holder} (lock {self.path}); wait "
                    "for it to finish: one writer per split (shards of one job may share it)"
                ) from None
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    handle.close()
                    raise
                # A filesystem without flock (some network mounts): write unlocked, as before.
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {_now()}\n")
            handle.flush()
            _HELD_LOCKS[self.path] = [handle, 1]
            self.handle = handle

    def alone(self) -> bool:
        """Whether no other process holds the lock (tries to take it exclusively)."""
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another process, or a filesystem without flock: not alone
            return False
        return True

    def release(self) -> None:
        with _HELD_LOCKS_GUARD:
            held = _HELD_LOCKS.get(self.path)
            if held is None or held[0] is not self.handle:
                return
            held[1] -= 1
            if held[1] == 0:
                del _HELD_LOCKS[self.path]
                self.handle.close()  # releases the flock


@contextlib.contextmanager
def _creation_lock(store):
    """Serialize split creation between processes sharing a local store (shards)."""
    if not _is_local(store):
        yield  # object stores: create the split before launching shards (as --ray does)
        return
    with open(os.path.join(store, ".dpprobe-create.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_root(store, mode: str) -> zarr.Group:
    _check_url_backend(store)
    if _is_local(store) and mode == "r":
        if not os.path.isdir(store):
            raise FileNotFoundError(f"no feature store at {store}")
        if not os.path.exists(os.path.join(store, "zarr.json")):
            raise ValueError(f"{store} is not a dpprobe feature store (it has no zarr.json)")
    try:
        return _zarr().open_group(store, mode=mode, zarr_format=3)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no feature store at {store}") from err
    except (ValueError, TypeError, KeyError) as err:
        raise DamagedStoreError(f"{store}/zarr.json is unreadable or not a Zarr v3 group "
                                f"({type(err).__name__}: {_first_line(err)})") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _group(root, store, split: str) -> zarr.Group:
    """root[split], refusing unreadable metadata with a message naming it."""
    try:
        group = root[split]
    except KeyError:
        raise
    except Exception as err:  # noqa: BLE001 - any metadata failure is damage
        raise DamagedStoreError(f"{store}/{split}/zarr.json is unreadable "
                                f"({type(err).__name__}: {_first_line(err)})") from err
    if not isinstance(group, _zarr().Group):
        raise DamagedStoreError(f"{store}/{split} is not a Zarr group")
    return group


def _split_names(root, store) -> list[str]:
    names = []
    for name in ("train", "test"):
        try:
            if name in root:
                names.append(name)
        except Exception as err:  # noqa: BLE001
            raise DamagedStoreError(f"{store}/{name}/zarr.json is unreadable "
                                    f"({type(err).__name__}: {_first_line(err)})") from err
    return names


def store_identity(attrs: dict) -> dict:
    """What every split of one store must share: backbone (weights identity included),
    preprocessing (except the train split's views and the autocast), feature dim and the
    declared class list."""
    preprocessing = {k: v for k, v in (attrs.get("preprocessing") or {}).items()
                     if k not in _PER_SPLIT_PREPROCESSING}
    dataset = attrs.get("dataset") or {}
    return _jsonable({
        "backbone": attrs.get("backbone"),
        "preprocessing": preprocessing,
        "feature_dim": (attrs.get("feature_shape") or [None])[-1],
        "class_names": attrs.get("class_names", dataset.get("class_names")),
    })


def identity_differences(one: dict, other: dict) -> list[str]:
    """The names of the `store_identity` fields in which two splits' attributes differ."""
    a, b = store_identity(one), store_identity(other)
    return [key for key in a if a[key] != b[key]]


class SplitWriter:
    """Writes one split of a feature store chunk by chunk, resumably.

    One writer per split: a second process is refused while a writer holds the split
    (shards with `shard=True` share it); a crashed writer's lock is stale and taken over.
    Nothing is written unless every check passes (the output path is new or a dpprobe store,
    the split's job matches the other splits'): a refused writer changes nothing.

    Args:
      store: store path (or URL).
      split: "train" or "test".
      num_rows: N.
      feature_shape: (d,) or (views, d).
      dtype: "float16" or "float32".
      provenance: {"backbone": ..., "preprocessing": ..., "dataset": ...}; the dataset's
        `class_names` are the declared class list.
      rows_per_chunk: chunk height; None chooses from rows x d.
      overwrite: discard an existing split of a different job (or a complete one).
      shard: this writer fills some chunks while other processes fill the others.
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
        shard: bool = False,
    ):
        if dtype not in FEATURE_DTYPES:
            raise ValueError(f"dtype must be one of {FEATURE_DTYPES}, got {dtype!r}")
        if num_rows < 1:
            raise ValueError(f"a split needs at least one row, got {num_rows}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if rows_per_chunk is not None and rows_per_chunk < 1:
            raise ValueError(f"rows per chunk must be >= 1, got {rows_per_chunk}")
        if not feature_shape or min(feature_shape) < 1:
            raise ValueError(f"features need a positive shape per row, got {feature_shape}")
        itemsize = np.dtype(dtype).itemsize
        rows_per_chunk = rows_per_chunk or choose_rows_per_chunk(num_rows, feature_shape, itemsize)
        self.store = store
        self.split = split
        self.num_rows = int(num_rows)
        self.rows_per_chunk = int(rows_per_chunk)
        self.num_chunks = math.ceil(num_rows / rows_per_chunk)
        self.created_split = False
        self._lock = None
        dataset = provenance["dataset"]
        job = {
            "backbone": provenance["backbone"],
            "preprocessing": provenance.get("preprocessing", {}),
            "dataset": dataset,
            "feature_shape": list(feature_shape),
            "dtype": dtype,
            "rows_per_chunk": self.rows_per_chunk,
        }
        class_names = dataset.get("class_names")
        existed = check_out_path(store)
        local = _is_local(store)
        self.fresh_store = local and not existed  # a new path or an empty folder
        self.created_dir = local and not os.path.lexists(store)
        if local:
            try:
                os.makedirs(store, exist_ok=True)
            except OSError as err:
                raise ValueError(f"--out {store}: cannot create it ({err.strerror})") from err
        try:
            if local:
                self._lock = _SplitLock(store, split, shared=shard)
            with _creation_lock(store):
                root = _open_root(store, "a")
                self.group, self.resumed = self._open_or_create(
                    root, job, feature_shape, dtype, class_names, overwrite, existed)
            self.features = self.group["features"]
            self.labels = self.group["labels"]
            self.chunks_done = self.group["chunks_done"]
            self.checksums = self.group["chunk_sha256"]
        except BaseException:
            self.abandon()
            raise

    def _open_or_create(self, root, job, feature_shape, dtype, class_names, overwrite, existed):
        """Check everything first, then write: a refused writer changes nothing."""
        attrs = dict(root.attrs)
        if existed and attrs.get("format") != FORMAT:
            raise ValueError(f"{self.store} is not a dpprobe feature store "
                             f"(format={attrs.get('format')!r})")
        present = _split_names(root, self.store)
        new_attrs = {"feature_shape": job["feature_shape"], "class_names": class_names,
                     "backbone": job["backbone"], "preprocessing": job["preprocessing"],
                     "dataset": job["dataset"]}
        for other in present:
            if other == self.split:
                continue
            differ = identity_differences(dict(_group(root, self.store, other).attrs),
                                          new_attrs)
            if differ:
                raise ValueError(
                    f"{self.store}/{other} was extracted with a different "
                    f"{', '.join(differ)}; all splits of a store share one backbone (its weights "
                    "included), preprocessing, feature dim and class list. Use another --out"
                )
        existing = _group(root, self.store, self.split) if self.split in present else None
        if existing is not None and not overwrite:
            old = dict(existing.attrs)
            same_job = all(_jsonable(old.get(k)) == _jsonable(job[k]) for k in _JOB_KEYS)
            if same_job:
                return existing, True
            if old.get("format") == FORMAT and _chunks_done_count(existing) > 0:
                raise ValueError(
                    f"{self.store}/{self.split} was written by a different job (backbone, "
                    "data, preprocessing or layout differ); pass --overwrite to replace it"
                )
            # A split without a single finished chunk holds no data: any job may replace it.
        if existing is not None and dict(existing.attrs).get("format") != FORMAT:
            raise ValueError(f"{self.store}/{self.split} was not written by dpprobe; "
                             "--overwrite only replaces dpprobe splits")
        if not attrs:
            root.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION,
                               "backbone": job["backbone"], "class_names": class_names})
        elif _jsonable(attrs.get("backbone")) != _jsonable(job["backbone"]) or (
                attrs.get("class_names") != class_names):
            # Only reached when no other split disagrees (checked above).
            root.attrs.update({"backbone": job["backbone"], "class_names": class_names})
        self.created_split = True
        return self._create(root, self.split, job, feature_shape, dtype), False

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
                "class_names": job["dataset"].get("class_names"),
                "created": _now(),
                "complete": False,
            }
        )
        return group

    def close(self) -> None:
        """Release the split for other writers."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def abandon(self) -> None:
        """After a failure: remove what this writer created if it holds no finished chunk
        (a new split, a new store), then release the split. Never touches anything else."""
        try:
            if self._lock is not None and self._lock.alone():
                if self.created_split and _is_local(self.store):
                    group = os.path.join(self.store, self.split)
                    if not any(_chunks_done_files(group)):
                        shutil.rmtree(group, ignore_errors=True)
                if self.fresh_store and _is_local(self.store):
                    ours = ("zarr.json", ".dpprobe-create.lock", f".dpprobe-{self.split}.lock")
                    if all(name in ours for name in os.listdir(self.store)):
                        self.close()
                        if self.created_dir:
                            shutil.rmtree(self.store, ignore_errors=True)
                        else:  # the user's empty folder: empty again
                            for name in ours:
                                with contextlib.suppress(FileNotFoundError):
                                    os.remove(os.path.join(self.store, name))
        finally:
            self.close()


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
            raise ValueError(f"{self.store}/{self.split}: chunk {chunk} (rows {start}:{stop}) "
                             "has NaN/Inf features")
        stored = features.astype(self.features.dtype)
        if not np.isfinite(stored).all():
            raise ValueError(
                f"{self.store}/{self.split}: features of rows {start}:{stop} exceed the float16 "
                f"range (|x| up to {float(np.abs(features).max()):.4g} > 65504); extract with "
                "--dtype float32" + (" --overwrite" if self.pending_chunks() != list(
                    range(self.num_chunks)) else ""))
        labels = np.asarray(labels, np.int32)
        self.features[start:stop] = stored
        self.labels[start:stop] = labels
        self.checksums[chunk] = np.frombuffer(chunk_checksum(stored, labels), np.uint8)
        self.chunks_done[chunk] = 1  # last: a chunk is done only once all of it is on disk

    def finalize(self) -> bool:
        """Mark the split complete if every chunk is done; returns whether it is complete."""
        return _mark_complete(self.group)


def _chunks_done_count(group) -> int:
    try:
        return int(np.asarray(group["chunks_done"][:]).sum())
    except Exception:  # noqa: BLE001 - an unreadable split counts as holding data
        return 1


def _chunks_done_files(group_dir: str) -> list[str]:
    """Chunk files of a local split's `chunks_done` (only chunks marked done are written)."""
    found = []
    for base, _, files in os.walk(os.path.join(group_dir, "chunks_done", "c")):
        found += [os.path.join(base, f) for f in files]
    return found


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
    """The Zarr group of a split; raises a clear error if missing, incomplete or damaged.

    A complete split is checked against its own metadata before it is returned: array shapes,
    dtypes and chunking as recorded, every chunk marked done and (on local disk) every chunk
    file present. A missing chunk file would otherwise read as zeros.
    """
    root = _open_root(store, "r")
    if dict(root.attrs).get("format") != FORMAT:
        raise ValueError(f"{store} is not a dpprobe feature store")
    present = _split_names(root, store)
    if split not in present:
        raise KeyError(f"{store} has no {split!r} split (it has {present}); extract it first")
    group = _group(root, store, split)
    attrs = dict(group.attrs)
    if require_complete and not attrs.get("complete", False):
        done = np.asarray(_array(group, store, split, "chunks_done")[:])
        raise IncompleteSplitError(
            f"{store}/{split} is incomplete ({int(done.sum())}/{done.size} chunks done): its "
            "extraction was interrupted. Rerun the same `dpprobe extract` command to resume."
        )
    if require_complete:
        _check_complete_split(group, store, split, attrs)
    return group


def _array(group, store, split: str, name: str):
    try:
        array = group[name]
    except Exception as err:  # noqa: BLE001 - a missing or unreadable zarr.json
        raise DamagedStoreError(f"{store}/{split}/{name}: array metadata missing or unreadable "
                                f"({type(err).__name__}: {_first_line(err)})") from err
    if not isinstance(array, _zarr().Array):
        raise DamagedStoreError(f"{store}/{split}/{name} is not a Zarr array")
    return array


def _check_complete_split(group, store, split: str, attrs: dict) -> None:
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
        array = arrays[name] = _array(group, store, split, name)
        if tuple(array.shape) != shape or tuple(array.chunks) != chunks or array.dtype != kind:
            raise DamagedStoreError(
                f"{where}/{name}/zarr.json says {array.dtype} {tuple(array.shape)} in chunks "
                f"{tuple(array.chunks)}, the split's attributes say {kind} {shape} in chunks "
                f"{chunks}: the metadata was altered")
    if _is_local(store):
        for name in ("chunks_done", "chunk_sha256", "features", "labels"):
            _check_chunk_files(arrays[name], store, split, name, num_chunks)
    try:
        done = np.asarray(arrays["chunks_done"][:])
    except Exception as err:  # noqa: BLE001
        raise DamagedStoreError(f"{where}/chunks_done is unreadable "
                                f"({type(err).__name__}: {_first_line(err)})") from err
    if not done.all():
        raise DamagedStoreError(f"{where} is marked complete but chunks "
                                f"{np.flatnonzero(done == 0).tolist()[:10]} are not marked done")


def _check_chunk_files(array, store, split: str, name: str, num_chunks: int) -> None:
    rest = (0,) * (array.ndim - 1)
    base = os.path.join(store, split, name)
    for chunk in range(num_chunks):
        key = array.metadata.encode_chunk_key((chunk, *rest))
        if not os.path.isfile(os.path.join(base, key)):
            raise DamagedStoreError(f"{store}/{split}/{name}: chunk {chunk} (file {key}) is "
                                    "missing; the store is damaged (re-extract the split)")


def split_attrs(store, split: str) -> dict:
    return dict(open_split(store, split, require_complete=False).attrs)


def load_split(store, split: str, dtype=np.float32) -> tuple[np.ndarray, np.ndarray, dict]:
    """(features as `dtype`, labels int32, attrs) of a complete split, read into memory.

    `dtype=None` keeps the stored dtype (a float16 cache stays half the size). Every chunk's
    sha256 is checked against the one recorded when it was written (see `_read_into`).
    """
    group = open_split(store, split)
    stored = group["features"]
    features = _aligned_empty(stored.shape, stored.dtype)
    labels = np.empty(stored.shape[:1], np.int32)
    _read_into(group, features, labels, store=store)
    if dtype is not None and np.dtype(dtype) != features.dtype:
        converted = _aligned_empty(features.shape, dtype)
        converted[...] = features
        features = converted
    return features, labels, dict(group.attrs)


def _read_into(group, features: np.ndarray, labels: np.ndarray, *, store=None) -> None:
    """Decode a split's features and labels straight into the given arrays, then check every
    chunk's sha256 (about as long as the decoding itself: 0.07 s for 50k x 768 float16)."""
    from zarr.core.buffer.cpu import NDBuffer

    stored = group["features"]
    where = f"{store if store is not None else ''}/{group.path}".lstrip("/")
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
                    raise DamagedStoreError(
                        f"{where}/{name}: chunk {start // rows} (rows {start}:"
                        f"{min(start + rows, array.shape[0])}) is unreadable "
                        f"({type(err).__name__}: {_first_line(err)})") from err
        raise
    _check_checksums(group, where, features, labels, rows)


def _check_checksums(group, where: str, features, labels, rows: int) -> None:
    import concurrent.futures

    sums = np.asarray(group["chunk_sha256"][:])
    starts = range(0, features.shape[0], rows)

    def bad(start: int) -> bool:
        stop = start + rows
        return bytes(sums[start // rows]) != chunk_checksum(features[start:stop],
                                                            labels[start:stop])

    with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        for start, wrong in zip(starts, pool.map(bad, starts), strict=True):
            if wrong:
                raise DamagedStoreError(
                    f"{where}/features: chunk {start // rows} (rows {start}:"
                    f"{min(start + rows, features.shape[0])}) differs from the sha256 recorded "
                    "when it was written; the store is damaged (run `dpprobe verify`)")


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
                    _read_into(open_split(store, split), features, labels, store=store)
                code = 0
            except BaseException as err:
                os.write(write_fd, _first_line(err).encode()[:8192])
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

    `dtype=None` keeps the stored dtype (float16 halves the memory of each chunk). Each chunk
    is checked against its recorded sha256; a damaged one raises `DamagedStoreError`.
    """
    group = open_split(store, split)
    features, labels = group["features"], group["labels"]
    sums = np.asarray(group["chunk_sha256"][:])
    rows = features.chunks[0]
    where = f"{store}/{split}"
    for start in range(0, features.shape[0], rows):
        stop = min(start + rows, features.shape[0])
        try:
            chunk = np.asarray(features[start:stop])
            chunk_labels = np.asarray(labels[start:stop])
        except Exception as err:  # noqa: BLE001
            raise DamagedStoreError(f"{where}/features: chunk {start // rows} (rows "
                                    f"{start}:{stop}) is unreadable ({type(err).__name__}: "
                                    f"{_first_line(err)})") from err
        if bytes(sums[start // rows]) != chunk_checksum(chunk, chunk_labels):
            raise DamagedStoreError(f"{where}/features: chunk {start // rows} (rows "
                                    f"{start}:{stop}) differs from its recorded sha256; the "
                                    "store is damaged (run `dpprobe verify`)")
        yield (chunk if dtype is None else chunk.astype(dtype, copy=False), chunk_labels)


def store_summary(store) -> dict:
    """Root and per-split attributes (provenance) of a store, with completion counts."""
    root = _open_root(store, "r")
    if dict(root.attrs).get("format") != FORMAT:
        raise ValueError(f"{store} is not a dpprobe feature store")
    summary = {"root": dict(root.attrs), "splits": {}}
    for name in _split_names(root, store):
        if True:
            group = _group(root, store, name)
            done = np.asarray(_array(group, store, name, "chunks_done")[:])
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
        if dict(root.attrs).get("format") != FORMAT:
            return VerifyReport([f"{store} is not a dpprobe feature store"], {})
        present = _split_names(root, store)
    except (FileNotFoundError, DamagedStoreError) as err:
        return VerifyReport([str(err)], {})
    identities = {}
    for split in splits:
        if split not in present:
            problems.append(f"{split}: missing split")
            continue
        try:
            group = _group(root, store, split)
        except DamagedStoreError as err:
            problems.append(f"{split}: {err}")
            continue
        attrs = dict(group.attrs)
        identities[split] = attrs
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
        if _is_local(store):
            for name in ("features", "labels"):
                try:
                    _check_chunk_files(group[name], store, split, name, int(done.size))
                except DamagedStoreError as err:
                    problems.append(f"{split}: {err}")
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
        class_names = attrs.get("class_names", (attrs.get("dataset") or {}).get("class_names"))
        if class_names is not None and num_classes is not None and len(class_names) != num_classes:
            problems.append(f"{split}: {len(class_names)} class names but num_classes="
                            f"{num_classes}")
        info["bad_chunks"] = bad_chunks
        if fingerprints and split in fingerprints:
            recorded = attrs.get("dataset", {}).get("fingerprint")
            if recorded != fingerprints[split]:
                problems.append(f"{split}: dataset fingerprint {recorded} != source data "
                                f"{fingerprints[split]}")
    if len(identities) == 2:
        differ = identity_differences(identities["train"], identities["test"])
        if differ:
            problems.append(f"train and test differ in {', '.join(differ)}: one store must hold "
                            "one job (same backbone, weights, preprocessing, class list)")
    return VerifyReport(problems, summary)
