"""Reading a split into memory or chunk by chunk: the values written, every chunk checked."""

import numpy as np
import pytest
import zarr

from dpprobe import extract
from tests.store_helpers import PROVENANCE, complete_store, fill, make_writer


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_preserves_values_and_attributes(tmp_path, rng, dtype):
    store = str(tmp_path / "s.zarr")
    features = rng.normal(size=(300, 7)).astype(np.float32)
    labels = rng.integers(0, 4, size=300)
    writer = make_writer(store, dtype=dtype)
    assert writer.num_chunks == 5
    fill(writer, features, labels)
    assert writer.finalize()
    loaded, loaded_labels, attrs = extract.load_split(store, "train")
    np.testing.assert_array_equal(loaded, features.astype(dtype).astype(np.float32))
    np.testing.assert_array_equal(loaded_labels, labels)
    assert attrs["complete"] is True
    assert attrs["backbone"] == PROVENANCE["backbone"]
    assert attrs["dataset"]["fingerprint"] == "abc"
    assert attrs["feature_dim"] == 7 and attrs["dtype"] == dtype and attrs["num_examples"] == 300
    assert attrs["rows_per_chunk"] == 64
    root = zarr.open_group(store, mode="r")
    assert root["train/features"].chunks == (64, 7)
    assert root.attrs["format"] == extract.FORMAT
    # Streaming the chunks gives the same arrays.
    streamed = list(extract.iter_split_chunks(store, "train"))
    assert len(streamed) == 5
    np.testing.assert_array_equal(np.concatenate([f for f, _ in streamed]), loaded)


def test_load_split_is_aligned_and_converts_on_request(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features, labels = complete_store(store, rng, dtype="float16")
    stored, stored_labels, _ = extract.load_split(store, "train", dtype=None)
    assert stored.dtype == np.float16 and stored_labels.dtype == np.int32
    assert stored.ctypes.data % 64 == 0  # JAX's CPU client uses it without a copy
    converted = extract.load_split(store, "train", dtype=np.float32)[0]
    assert converted.ctypes.data % 64 == 0
    np.testing.assert_array_equal(converted, features.astype(np.float16).astype(np.float32))


def test_a_changed_chunk_is_refused_by_every_read(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    complete_store(store, rng)
    # Valid Zarr data whose values differ from those recorded: only the sha256 tells.
    zarr.open_group(store, mode="a")["train/features"][130:131] = 0.0
    match = r"s.zarr/train/features: chunk 2 \(rows 128:192\) differs from the sha256"
    with pytest.raises(extract.DamagedStoreError, match=match):
        extract.load_split(store, "train")
    chunks = extract.iter_split_chunks(store, "train")
    assert [len(next(chunks)[0]) for _ in range(2)] == [64, 64]  # chunks 0 and 1 are sound
    with pytest.raises(extract.DamagedStoreError, match=match):
        next(chunks)


def test_an_unreadable_chunk_is_named(tmp_path, rng):
    store = tmp_path / "s.zarr"
    complete_store(str(store), rng)
    (store / "train" / "features" / "c" / "4" / "0").write_bytes(b"garbage")
    match = r"train/features: chunk 4 \(rows 256:300\) is unreadable"
    with pytest.raises(extract.DamagedStoreError, match=match):
        extract.load_split(str(store), "train")
    with pytest.raises(extract.DamagedStoreError, match=match):
        list(extract.iter_split_chunks(str(store), "train"))


def test_an_incomplete_split_is_not_read(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    fill(make_writer(store, provenance=PROVENANCE), rng.normal(size=(300, 7)),
         np.zeros(300, int), chunks=[0])
    with pytest.raises(extract.IncompleteSplitError, match="1/5 chunks done"):
        list(extract.iter_split_chunks(store, "train"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_local_split_is_decoded_in_place_bit_for_bit(tmp_path, rng, monkeypatch, dtype):
    # 300 rows in chunks of 64: the last chunk is stored padded to 64 rows.
    store = str(tmp_path / "s.zarr")
    complete_store(store, rng, dtype=dtype)
    expected = zarr.open_group(store, mode="r")["train/features"][:]

    def no_zarr_read(*args, **kwargs):
        raise AssertionError("the local split was read through Zarr's chunk copies")

    monkeypatch.setattr(zarr.Array, "get_basic_selection", no_zarr_read)
    loaded, _, _ = extract.load_split(store, "train", dtype=None)
    assert loaded.dtype == np.dtype(dtype) and loaded.ctypes.data % 64 == 0
    unsigned = f"u{loaded.dtype.itemsize}"
    np.testing.assert_array_equal(loaded.view(unsigned), expected.view(unsigned))


def test_a_chunk_of_the_wrong_size_is_read_by_zarr_and_named(tmp_path, rng):
    from numcodecs import blosc

    store = tmp_path / "s.zarr"
    complete_store(str(store), rng)
    # A sound Blosc frame that decodes to half a chunk: the in-place decode must not accept it.
    half = np.zeros((32, 7), np.float32)
    (store / "train" / "features" / "c" / "1" / "0").write_bytes(blosc.compress(half, b"zstd",
                                                                                 3, 1))
    with pytest.raises(extract.DamagedStoreError, match=r"train/features: chunk 1 \(rows 64:128\)"):
        extract.load_split(str(store), "train")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_local_split_is_read_without_zarr_bit_for_bit(tmp_path, rng, monkeypatch, dtype):
    # The writer's layout on local disk: read from its files (`extract.read_local`), every
    # chunk's sha256 checked, the padded last chunk cut; Zarr is never opened.
    from dpprobe.extract import read

    store = str(tmp_path / "s.zarr")
    complete_store(store, rng, dtype=dtype)
    group = zarr.open_group(store, mode="r")["train"]
    expected, expected_labels = group["features"][:], group["labels"][:]
    attrs = dict(group.attrs)

    def no_zarr(*args, **kwargs):
        raise AssertionError("the local split was opened through Zarr")

    monkeypatch.setattr(read, "open_split", no_zarr)
    loaded, labels, loaded_attrs = extract.load_split(store, "train", dtype=None)
    assert loaded.dtype == np.dtype(dtype) and loaded.ctypes.data % 64 == 0
    unsigned = f"u{loaded.dtype.itemsize}"
    np.testing.assert_array_equal(loaded.view(unsigned), expected.view(unsigned))
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(labels, expected_labels)
    assert loaded_attrs == attrs
    # A changed label is refused too: the sha256 covers the chunk's labels.
    zarr.open_group(store, mode="a")["train/labels"][299] = (expected_labels[299] + 1) % 4
    with pytest.raises(extract.DamagedStoreError,
                       match=r"train/features: chunk 4 \(rows 256:300\) differs from the sha256"):
        extract.load_split(store, "train")


@pytest.mark.parametrize("damage", ["labels chunk", "sha256 chunk", "not done", "metadata"])
def test_a_split_the_local_read_cannot_use_is_read_by_zarr(tmp_path, rng, damage):
    # Anything outside the writer's layout or invariants: the local read declines (None), and
    # Zarr's read names what is wrong.
    from dpprobe.extract import read_local

    store = tmp_path / "s.zarr"
    complete_store(str(store), rng)
    train = store / "train"
    if damage == "labels chunk":
        (train / "labels" / "c" / "2").write_bytes(b"garbage")
        match = r"train/labels: chunk 2 \(rows 128:192\) is unreadable"
    elif damage == "sha256 chunk":
        (train / "chunk_sha256" / "c" / "3" / "0").unlink()
        match = r"chunk_sha256: chunk 3 \(file c/3/0\) is missing"
    elif damage == "not done":
        # 0 is the fill value: Zarr removes the chunk's file, and the split refuses it.
        zarr.open_group(str(store), mode="a")["train/chunks_done"][1] = 0
        match = r"chunks_done: chunk 1 \(file c/1\) is missing"
    else:
        meta = (train / "labels" / "zarr.json").read_text()
        (train / "labels" / "zarr.json").write_text(meta.replace('"int32"', '"int64"'))
        match = r"train/labels/zarr.json says int64"
    assert read_local.load_local_split(str(store), "train", np.empty) is None
    with pytest.raises(extract.DamagedStoreError, match=match):
        extract.load_split(str(store), "train")
