"""The store's format: clear errors for a missing store or split, a complete split checked
against its metadata, chunk sizes, and the attributes read without Zarr."""

import os
from pathlib import Path

import numpy as np
import pytest

from dpprobe import extract
from tests.store_helpers import complete_store, fill, make_writer


def test_missing_store_and_split_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no feature store"):
        extract.load_split(str(tmp_path / "nope.zarr"), "train")
    store = str(tmp_path / "s.zarr")
    make_writer(store)
    with pytest.raises(KeyError, match="no 'test' split"):
        extract.load_split(store, "test")


def test_rows_per_chunk_follows_row_size():
    assert extract.choose_rows_per_chunk(10**6, (768,), 2) == 5440
    assert extract.choose_rows_per_chunk(10**6, (8192,), 4) == 256
    assert extract.choose_rows_per_chunk(100, (768,), 2) == 100
    assert extract.choose_rows_per_chunk(10**6, (10**7,), 4) == 64


def test_local_split_attrs_only_for_complete_local_splits(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features, labels = rng.normal(size=(300, 7)), rng.integers(0, 4, size=300)
    writer = make_writer(store)
    fill(writer, features, labels, chunks=[0])
    assert extract.local_split_attrs(store, "train") is None  # incomplete
    fill(writer, features, labels)
    writer.finalize()
    attrs = extract.local_split_attrs(store, "train")
    assert attrs == extract.split_attrs(store, "train")
    assert extract.local_split_attrs(store, "test") is None  # missing
    assert extract.local_split_attrs(str(tmp_path / "nowhere"), "train") is None
    assert extract.local_split_attrs("s3://bucket/s.zarr", "train") is None


def test_a_complete_split_is_checked_against_its_metadata(tmp_path, rng):
    store = tmp_path / "s.zarr"
    complete_store(str(store), rng)
    assert extract.open_split(store, "train").attrs["complete"] is True  # a Path works too
    os.remove(store / "train" / "labels" / "c" / "3")
    with pytest.raises(extract.DamagedStoreError,
                       match=r"train/labels: chunk 3 \(file c/3\) is missing"):
        extract.open_split(str(store), "train")
    # An incomplete split is not checked: it says how to resume instead.
    assert extract.open_split(str(store), "train", require_complete=False) is not None


def test_store_paths_may_be_path_objects(tmp_path, rng):
    store = Path(tmp_path / "s.zarr")
    features, _ = complete_store(store, rng)
    assert extract.check_out_path(store) is True
    assert extract.local_split_attrs(store, "train")["num_examples"] == 300
    np.testing.assert_array_equal(extract.load_split(store, "train")[0], features)
    assert extract.store_summary(store)["splits"]["train"]["chunks_done"] == 5


def test_the_chunk_checksum_is_the_sha256_of_the_recorded_bytes(rng):
    # The format of every store ever written: sha256 over dtype, shape and C-order bytes of the
    # features, then of the int32 labels. Hashing the buffer in place (no `tobytes` copy) must
    # give the same digest, also for a strided view.
    import hashlib

    features = rng.normal(size=(64, 2, 7)).astype(np.float16)[:, 1, :]  # not contiguous
    labels = rng.integers(0, 4, size=64)  # int64: hashed as int32
    expected = hashlib.sha256()
    for array in (np.ascontiguousarray(features), labels.astype(np.int32)):
        expected.update(f"{array.dtype.str}{array.shape}".encode() + array.tobytes())
    assert extract.chunk_checksum(features, labels) == expected.digest()


def test_a_shard_waits_for_a_root_another_shard_is_creating(tmp_path):
    """`SplitWriter` writes a new store's root zarr.json, then its attributes, under the
    creation lock; a shard started beside it (`check_out_path`) must not take the root without
    dpprobe's attributes for a foreign store (three shards started together failed so)."""
    import fcntl
    import json
    import threading

    from dpprobe.extract.store import CREATE_LOCK, FORMAT

    store = tmp_path / "s.zarr"
    store.mkdir()
    root = {"zarr_format": 3, "node_type": "group", "attributes": {}}
    (store / "zarr.json").write_text(json.dumps(root))
    results = []
    with open(store / CREATE_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # the creating shard, between its two writes
        checker = threading.Thread(target=lambda: results.append(extract.check_out_path(store)))
        checker.start()
        checker.join(0.5)
        assert checker.is_alive() and not results  # it waits for the creator
        root["attributes"] = {"format": FORMAT}
        (store / "zarr.json").write_text(json.dumps(root))
    checker.join(10)
    assert results == [True]
    (store / CREATE_LOCK).unlink()  # no creation under way: a foreign root is refused at once
    (store / "zarr.json").write_text(json.dumps({**root, "attributes": {}}))
    with pytest.raises(ValueError, match="not written by dpprobe"):
        extract.check_out_path(store)
