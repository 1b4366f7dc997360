"""The Zarr feature store: round trips, completeness, resumption, clear errors."""

import numpy as np
import pytest
import zarr

import extract

PROVENANCE = {
    "backbone": {"name": "test-backbone", "weights_source": "none"},
    "preprocessing": {"kind": "none"},
    "dataset": {"name": "synthetic", "fingerprint": "abc", "num_classes": 4},
}


def _writer(store, **kwargs):
    args = dict(num_rows=300, feature_shape=(7,), dtype="float32", provenance=PROVENANCE,
                rows_per_chunk=64)
    return extract.SplitWriter(store, "train", **(args | kwargs))


def _fill(writer, features, labels, chunks=None):
    for chunk in writer.pending_chunks() if chunks is None else chunks:
        start, stop = writer.chunk_rows(chunk)
        writer.write_chunk(chunk, features[start:stop], labels[start:stop])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_preserves_values_and_attributes(tmp_path, rng, dtype):
    store = str(tmp_path / "s.zarr")
    features = rng.normal(size=(300, 7)).astype(np.float32)
    labels = rng.integers(0, 4, size=300)
    writer = _writer(store, dtype=dtype)
    assert writer.num_chunks == 5
    _fill(writer, features, labels)
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


def test_interrupted_split_is_never_complete_and_resumes(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features = rng.normal(size=(300, 7)).astype(np.float32)
    labels = rng.integers(0, 4, size=300)
    writer = _writer(store)
    _fill(writer, features, labels, chunks=[0, 2])  # then the process dies
    assert not writer.finalize()
    assert extract.split_attrs(store, "train")["complete"] is False
    with pytest.raises(extract.IncompleteSplitError, match="2/5 chunks done"):
        extract.load_split(store, "train")
    # The same job resumes and writes only the missing chunks.
    again = _writer(store)
    assert again.resumed
    assert again.pending_chunks() == [1, 3, 4]
    _fill(again, features, labels)
    assert again.finalize()
    loaded, loaded_labels, _ = extract.load_split(store, "train")
    np.testing.assert_array_equal(loaded, features)
    np.testing.assert_array_equal(loaded_labels, labels)


def test_a_different_job_cannot_resume_a_partial_split(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    writer = _writer(store)
    _fill(writer, rng.normal(size=(300, 7)), np.zeros(300, int), chunks=[0])
    other = PROVENANCE | {"dataset": PROVENANCE["dataset"] | {"fingerprint": "zzz"}}
    with pytest.raises(ValueError, match="different job"):
        _writer(store, provenance=other)
    # --overwrite starts over.
    fresh = _writer(store, provenance=other, overwrite=True)
    assert fresh.pending_chunks() == [0, 1, 2, 3, 4]


def test_splits_must_share_a_backbone(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    writer = _writer(store)
    _fill(writer, rng.normal(size=(300, 7)), np.zeros(300, int))
    other = PROVENANCE | {"backbone": {"name": "another"}}
    with pytest.raises(ValueError, match="share one backbone"):
        extract.SplitWriter(store, "test", num_rows=10, feature_shape=(7,), dtype="float32",
                            provenance=other)


def test_bad_chunks_are_refused(tmp_path, rng):
    writer = _writer(str(tmp_path / "s.zarr"))
    with pytest.raises(ValueError, match="shape"):
        writer.write_chunk(0, np.zeros((10, 7)), np.zeros(10))
    bad = np.zeros((64, 7))
    bad[5, 2] = np.inf
    with pytest.raises(ValueError, match="NaN/Inf"):
        writer.write_chunk(0, bad, np.zeros(64))
    assert writer.pending_chunks() == [0, 1, 2, 3, 4]


def test_missing_store_and_split_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no feature store"):
        extract.load_split(str(tmp_path / "nope.zarr"), "train")
    store = str(tmp_path / "s.zarr")
    _writer(store)
    with pytest.raises(KeyError, match="no 'test' split"):
        extract.load_split(store, "test")


def test_rows_per_chunk_follows_row_size():
    assert extract.choose_rows_per_chunk(10**6, (768,), 2) == 5440
    assert extract.choose_rows_per_chunk(10**6, (8192,), 4) == 256
    assert extract.choose_rows_per_chunk(100, (768,), 2) == 100
    assert extract.choose_rows_per_chunk(10**6, (10**7,), 4) == 64


# A fresh interpreter without JAX or torch (as `dpprobe probe` is when it forks its reader).
_PREFETCH = """
import sys, numpy as np, extract
store = sys.argv[1]
assert extract.can_prefetch_in_child()
attrs = extract.local_split_attrs(store, "train")
assert "zarr" not in sys.modules  # the parent read the attributes without Zarr
reader = extract.SplitPrefetch(store, {"train": attrs})
features, labels = reader.result("train")
assert "zarr" not in sys.modules
ref, ref_labels, _ = extract.load_split(store, "train", dtype=None)
assert features.dtype == ref.dtype and np.array_equal(features, ref), "features differ"
assert labels.dtype == np.int32 and np.array_equal(labels, ref_labels), "labels differ"
assert features.ctypes.data % 64 == 0
print("ok")
"""


def _prefetch_in_fresh_process(store):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _PREFETCH, store], capture_output=True,
                          text=True, timeout=120)


def test_child_process_prefetch_equals_load_split(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features = rng.normal(size=(300, 7)).astype(np.float32)
    _fill(writer := _writer(store, dtype="float16"), features, rng.integers(0, 4, size=300))
    writer.finalize()
    done = _prefetch_in_fresh_process(store)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_child_process_prefetch_reports_a_bad_chunk(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    _fill(writer := _writer(store), rng.normal(size=(300, 7)), rng.integers(0, 4, size=300))
    writer.finalize()
    (tmp_path / "s.zarr" / "train" / "features" / "c" / "2" / "0").write_bytes(b"garbage")
    done = _prefetch_in_fresh_process(store)
    assert done.returncode != 0
    assert "reading" in done.stderr and "failed" in done.stderr, done.stderr


def test_local_split_attrs_only_for_complete_local_splits(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features, labels = rng.normal(size=(300, 7)), rng.integers(0, 4, size=300)
    writer = _writer(store)
    _fill(writer, features, labels, chunks=[0])
    assert extract.local_split_attrs(store, "train") is None  # incomplete
    _fill(writer, features, labels)
    writer.finalize()
    attrs = extract.local_split_attrs(store, "train")
    assert attrs == extract.split_attrs(store, "train")
    assert extract.local_split_attrs(store, "test") is None  # missing
    assert extract.local_split_attrs(str(tmp_path / "nowhere"), "train") is None
    assert extract.local_split_attrs("s3://bucket/s.zarr", "train") is None
