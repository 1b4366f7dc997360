"""The one way dpprobe writes a file: atomically, so a reader never sees half of it (the
commands, the model files, `DPLinearProbe.save`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer"]


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write `path` through, atomically: a temp file in the same directory,
    renamed onto `path` when the block ends, removed if it raises (nothing is written then),
    with the permissions of a file the user creates (0666 minus the umask; mkstemp's are
    0600). For outputs written piece by piece (`dpprobe predict`'s CSV). An OSError that
    names no file (a full disk) is raised naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a full disk (ENOSPC, EFBIG): named by the file it was writing
        Path(tmp).unlink(missing_ok=True)
        if err.filename is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (`atomic_writer`)."""
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode())


def _umask() -> int:
    """The process's umask, read without changing it (Linux), else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
