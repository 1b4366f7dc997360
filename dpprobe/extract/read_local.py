"""Reading a complete local split without importing Zarr: the layout `SplitWriter` writes, read
straight from its files, each chunk decoded in place and hashed as soon as it is decoded.

Importing Zarr (with fsspec, asyncio, donfig and its codec registry) costs ~0.3 s of Python on
this project's 2-core VM, and it holds the GIL while the probe job imports JAX in the main
thread: the two imports ran one after the other. A split in the writer's layout needs none of
it: its metadata is JSON, its chunks Blosc (features) or Zstandard (the small arrays) frames.

`load_local_split` accepts exactly that layout and the invariants `open_split` checks on a
complete split (format, completeness, every array's shape, chunking and dtype as the split's
attributes say, every chunk file present and marked done); anything else (a URL, another
layout, a missing or unreadable file, a frame of the wrong size) returns None, and the caller
reads through Zarr, which names what is wrong. Every chunk's sha256 is checked either way: a
chunk that decodes but differs from the sha256 recorded raises `DamagedStoreError` here.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import sys

import numpy as np

from dpprobe.extract.store import chunk_checksum, local_split_attrs
from dpprobe.extract.verify import check_chunk_sums
from dpprobe.extract.zarr_io import StorePath, read_json

__all__ = ["load_local_split"]


def load_local_split(store: StorePath, split: str, aligned_empty
                     ) -> tuple[np.ndarray, np.ndarray, dict] | None:
    """A complete local split read without Zarr, or None when that is not possible.

    Args:
      store: the feature store.
      split: the split's name.
      aligned_empty: `(shape, dtype) -> array`, the destination's allocator (`extract.read`'s
        64-byte-aligned one).

    Returns:
      (features as stored, labels int32, the split's attributes), every chunk's sha256
      checked; None when the split is not a complete local split in `SplitWriter`'s layout
      with every chunk file present and readable (then read it through Zarr).

    Raises:
      DamagedStoreError: a chunk decodes but differs from the sha256 recorded for it.
    """
    attrs = local_split_attrs(store, split)  # None for a URL too
    if attrs is None:
        return None
    base = os.path.join(os.fspath(store), split)
    try:
        num_rows = int(attrs["num_examples"])
        row_shape = tuple(int(v) for v in attrs["feature_shape"])
        rows = int(attrs["rows_per_chunk"])
        dtype = np.dtype(attrs["dtype"])
    except (KeyError, TypeError, ValueError):
        return None
    if num_rows < 1 or rows < 1:
        return None
    num_chunks = math.ceil(num_rows / rows)
    expected = {  # as `store._check_complete_split` demands: (shape, chunks, dtype, codec)
        "features": ((num_rows, *row_shape), (rows, *row_shape), dtype, "blosc"),
        "labels": ((num_rows,), (rows,), np.dtype(np.int32), "zstd"),
        "chunks_done": ((num_chunks,), (1,), np.dtype(np.uint8), "zstd"),
        "chunk_sha256": ((num_chunks, 32), (1, 32), np.dtype(np.uint8), "zstd"),
    }
    if not all(_layout(read_json(os.path.join(base, name, "zarr.json")), *layout)
               for name, layout in expected.items()):
        return None
    from numcodecs import blosc, zstd

    def small(name: str, shape: tuple[int, ...], chunk_rows: int, kind) -> np.ndarray | None:
        """A zstd-coded array read whole (its last chunk stored padded), or None."""
        out = np.empty((num_chunks * chunk_rows, *shape[1:]), kind)
        step = out[:chunk_rows].nbytes
        flat = out.reshape(-1).view(np.uint8)
        for chunk in range(num_chunks):
            data = _chunk_file(base, name, chunk, len(shape))
            if data is None:
                return None
            try:
                decoded = zstd.decompress(data)
            except Exception:  # noqa: BLE001 - Zarr reads it instead and names it
                return None
            if len(decoded) != step:
                return None
            flat[chunk * step:(chunk + 1) * step] = np.frombuffer(decoded, np.uint8)
        return out[:shape[0]]

    done = small("chunks_done", (num_chunks,), 1, np.uint8)
    sums = small("chunk_sha256", (num_chunks, 32), 1, np.uint8)
    labels = small("labels", (num_rows,), rows, np.int32)
    if done is None or sums is None or labels is None or not done.all():
        return None
    labels = np.ascontiguousarray(labels)
    features = aligned_empty((num_rows, *row_shape), dtype)
    chunk_bytes = features[:1].nbytes * rows

    def decode_and_check(chunk: int) -> bool | None:
        """Decode chunk `chunk` into place and hash it while it is in cache: None when it
        cannot be decoded here, else whether it matches its recorded sha256."""
        data = _chunk_file(base, "features", chunk, features.ndim)
        # Blosc's header: the decoded size at bytes 4-8, the frame's own size at 12-16.
        if (data is None or len(data) < 16
                or int.from_bytes(data[4:8], "little") != chunk_bytes
                or int.from_bytes(data[12:16], "little") != len(data)):
            return None
        start = chunk * rows
        try:
            if start + rows <= num_rows:
                blosc.decompress(data, features[start:start + rows])
            else:  # the last chunk is stored whole, padded past the split's end
                whole = np.empty((rows, *row_shape), dtype)
                blosc.decompress(data, whole)
                features[start:] = whole[:num_rows - start]
        except Exception:  # noqa: BLE001 - Zarr reads it instead and names it
            return None
        stop = min(start + rows, num_rows)
        return bytes(sums[chunk]) == chunk_checksum(features[start:stop], labels[start:stop])

    # Blosc and hashlib release the GIL: the chunks decode and hash on every core.
    with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        found = list(pool.map(decode_and_check, range(num_chunks)))
    if None in found:
        return None
    if not all(found):  # the first chunk that differs, named as every read names it
        check_chunk_sums(f"{store}/{split}", sums, features, labels, rows)
    return features, labels, attrs


def _layout(meta: dict | None, shape: tuple[int, ...], chunks: tuple[int, ...],
            dtype: np.dtype, codec: str) -> bool:
    """Whether an array's `zarr.json` is the writer's layout with this shape, chunking, dtype
    and compressor (bytes in this machine's byte order, then `codec`)."""
    if (not isinstance(meta, dict) or meta.get("zarr_format") != 3
            or meta.get("node_type") != "array" or meta.get("storage_transformers")
            or meta.get("data_type") != dtype.name
            or meta.get("shape") != list(shape)
            or meta.get("chunk_grid") != {"name": "regular",
                                          "configuration": {"chunk_shape": list(chunks)}}
            or meta.get("chunk_key_encoding") != {"name": "default",
                                                  "configuration": {"separator": "/"}}):
        return False
    codecs = meta.get("codecs")
    if not (isinstance(codecs, list) and len(codecs) == 2
            and all(isinstance(c, dict) for c in codecs)
            and codecs[0].get("name") == "bytes" and codecs[1].get("name") == codec):
        return False
    endian = (codecs[0].get("configuration") or {}).get("endian")
    return dtype.itemsize == 1 or endian == sys.byteorder


def _chunk_file(base: str, name: str, chunk: int, ndim: int) -> bytes | None:
    """The bytes of row chunk `chunk`'s file (Zarr's default key: c/chunk/0/...), or None."""
    path = os.path.join(base, name, "c", str(chunk), *("0",) * (ndim - 1))
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None
