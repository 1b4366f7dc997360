"""Writing one split of a feature store (`SplitWriter`), resumably, one writer per split.

The format it writes is described in `extract.store`. Each row chunk is written whole, then
marked done; the split is marked complete once every chunk is done (`finalize_split`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from dpprobe.extract.store import (
    CREATE_LOCK,
    FEATURE_DTYPES,
    FORMAT,
    FORMAT_VERSION,
    check_out_path,
    choose_rows_per_chunk,
    chunk_checksum,
    failed_split,
    identity_differences,
    jsonable,
    timestamp,
)
from dpprobe.extract.zarr_io import (
    StorePath,
    import_zarr,
    is_local,
    open_group,
    open_root,
    split_names,
)

if TYPE_CHECKING:
    import zarr

__all__ = ["SplitWriter", "finalize_split"]

# Keys of a split's attributes that identify the job that writes it: a partial split may only
# be resumed by the same job.
_JOB_KEYS = ("backbone", "preprocessing", "dataset", "feature_shape", "dtype", "rows_per_chunk")


def _compressor():
    return import_zarr().codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")


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

    def __init__(self, store: StorePath, split: str, *, shared: bool):
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
            handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {timestamp()}\n")
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
def _creation_lock(store: StorePath) -> Iterator[None]:
    """Serialize split creation between processes sharing a local store (shards)."""
    if not is_local(store):
        yield  # object stores: create the split before launching shards (as --ray does)
        return
    with open(os.path.join(store, CREATE_LOCK), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        yield


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
        store: StorePath,
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
        local = is_local(store)
        self.fresh_store = local and not existed  # a new path or an empty folder
        self.created_dir = local and not os.path.lexists(store)
        if local:
            try:
                os.makedirs(store, exist_ok=True)
            except OSError as err:
                raise ValueError(f"`out={store}`: cannot create it ({err.strerror})") from err
        try:
            if local:
                self._lock = _SplitLock(store, split, shared=shard)
            with _creation_lock(store):
                root = open_root(store, "a")
                self.group, self.resumed = self._open_or_create(
                    root, job, feature_shape, dtype, class_names, overwrite, existed)
            self.features, self.labels, self.chunks_done, self.checksums = (
                _every_chunk_written(self.group[name])
                for name in ("features", "labels", "chunks_done", "chunk_sha256"))
        except BaseException:
            self.abandon()
            raise

    def _open_or_create(self, root, job, feature_shape, dtype, class_names, overwrite, existed):
        """Check everything first, then write: a refused writer changes nothing."""
        attrs = dict(root.attrs)
        if existed and attrs.get("format") != FORMAT:
            raise ValueError(f"{self.store} is not a dpprobe feature store "
                             f"(format={attrs.get('format')!r})")
        present = split_names(root, self.store)
        new_attrs = {"feature_shape": job["feature_shape"], "class_names": class_names,
                     "backbone": job["backbone"], "preprocessing": job["preprocessing"],
                     "dataset": job["dataset"]}
        for other in (name for name in present if name != self.split):
            other_attrs = dict(open_group(root, self.store, other).attrs)
            differ = not failed_split(other_attrs) and identity_differences(other_attrs, new_attrs)
            if differ:
                raise ValueError(
                    f"{self.store}/{other} was extracted with a different "
                    f"{', '.join(differ)}; all splits of a store share one backbone (its weights "
                    "included), preprocessing, feature dim and class list. Use another `out`"
                )
        existing = open_group(root, self.store, self.split) if self.split in present else None
        if existing is not None and not overwrite:
            old = dict(existing.attrs)
            same_job = all(jsonable(old.get(k)) == jsonable(job[k]) for k in _JOB_KEYS)
            if same_job:
                return existing, True
            if (old.get("format") == FORMAT and _chunks_done_count(existing) > 0
                    and not failed_split(old)):
                raise ValueError(
                    f"{self.store}/{self.split} was written by a different job (backbone, "
                    "data, preprocessing or layout differ); pass `overwrite=True` to replace it"
                )
            # Without a finished chunk, or failed (`failed_split`): any job may replace it.
        if existing is not None and dict(existing.attrs).get("format") != FORMAT:
            raise ValueError(f"{self.store}/{self.split} was not written by dpprobe; "
                             "`overwrite` only replaces dpprobe splits")
        if not attrs:
            root.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION,
                               "backbone": job["backbone"], "class_names": class_names})
        elif jsonable(attrs.get("backbone")) != jsonable(job["backbone"]) or (
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
                "created": timestamp(),
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
                if self.created_split and is_local(self.store):
                    group = os.path.join(self.store, self.split)
                    if not any(_chunks_done_files(group)):
                        shutil.rmtree(group, ignore_errors=True)
                if self.fresh_store and is_local(self.store):
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
                "`dtype=float32`" + (" `overwrite=True`" if self.pending_chunks() != list(
                    range(self.num_chunks)) else ""))
        labels = np.asarray(labels, np.int32)
        self.features[start:stop] = stored
        self.labels[start:stop] = labels
        self.checksums[chunk] = np.frombuffer(chunk_checksum(stored, labels), np.uint8)
        self.chunks_done[chunk] = 1  # last: a chunk is done only once all of it is on disk

    def finalize(self) -> bool:
        """Mark the split complete if every chunk is done; returns whether it is complete."""
        return _mark_complete(self.group)


def _every_chunk_written(array: zarr.Array) -> zarr.Array:
    """The array, writing every chunk to disk, also one whose values all equal the fill value
    (Zarr 3's default skips those; the store's rule is one file per chunk: `extract.store`).
    The setting belongs to the opened array, not the store, so each writer sets it."""
    return array.with_config({"write_empty_chunks": True})


def _chunks_done_count(group: zarr.Group) -> int:
    try:
        return int(np.asarray(group["chunks_done"][:]).sum())
    except Exception:  # noqa: BLE001 - an unreadable split counts as holding data
        return 1


def _chunks_done_files(group_dir: str) -> list[str]:
    """Chunk files of a local split's `chunks_done`: only chunks marked done are written (the
    writer never writes a 0 into it, so no file stands for a chunk not done)."""
    found = []
    for base, _, files in os.walk(os.path.join(group_dir, "chunks_done", "c")):
        found += [os.path.join(base, f) for f in files]
    return found


def _mark_complete(group: zarr.Group) -> bool:
    if not np.asarray(group["chunks_done"][:]).all():
        return False
    if not group.attrs.get("complete", False):
        group.attrs.update({"complete": True, "completed": timestamp()})
    return True


def finalize_split(store: StorePath, split: str) -> bool:
    """Mark a split complete if all its chunks are done (e.g. after shards ran elsewhere)."""
    return _mark_complete(open_root(store, "a")[split])
