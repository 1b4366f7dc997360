"""The one way dpprobe writes a file: atomically, so a reader never sees half of it (the
commands, the model files, `DPLinearProbe.save`)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from dpprobe.model.format import json_default

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer", "write_csv", "write_json"]


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


def _finite(value):
    """JSON has no inf/nan: inf epsilon is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path, payload: dict) -> None:
    """Write `payload` as indented JSON, atomically (inf as the string "inf").

    Args:
      path: the file.
      payload: the JSON object.
    """
    atomic_write_text(path, json.dumps(_finite(payload), indent=2, default=json_default) + "\n")


def write_csv(path, rows: Sequence[dict], columns: Sequence[str]) -> None:
    """Write `rows` as CSV with a header of `columns` (other keys left out), atomically.

    Args:
      path: the file.
      rows: one dict per row.
      columns: the column names, in order.
    """
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k) for k in columns})
    atomic_write_text(path, buffer.getvalue())
