"""PLACEHOLDER"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading

import numpy as np

from extract.read import read_into
from extract.store import StorePath, _first_line, open_split

__all__ = ["SplitPrefetch", "can_prefetch_in_child"]


def can_prefetch_in_child() -> bool:
    """Whether `SplitPrefetch` may fork: a POSIX system, and a process with one thread that has
    not loaded JAX or torch (whose native thread pools make a fork unsafe)."""
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

    def __init__(self, store: StorePath, splits: dict[str, dict]):
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
                    read_into(store, open_split(store, split), features, labels)
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
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))
    return np.frombuffer(buffer, dtype, count=count).reshape(shape)
