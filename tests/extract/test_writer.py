"""Writing a split: completeness, resumption, one job per store, refused chunks."""

import numpy as np
import pytest

from dpprobe import extract
from tests.store_helpers import PROVENANCE, fill, make_writer


def test_interrupted_split_is_never_complete_and_resumes(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features = rng.normal(size=(300, 7)).astype(np.float32)
    labels = rng.integers(0, 4, size=300)
    writer = make_writer(store)
    fill(writer, features, labels, chunks=[0, 2])  # then the process dies
    assert not writer.finalize()
    assert extract.split_attrs(store, "train")["complete"] is False
    with pytest.raises(extract.IncompleteSplitError, match="2/5 chunks done"):
        extract.load_split(store, "train")
    # The same job resumes and writes only the missing chunks.
    again = make_writer(store)
    assert again.resumed
    assert again.pending_chunks() == [1, 3, 4]
    fill(again, features, labels)
    assert again.finalize()
    loaded, loaded_labels, _ = extract.load_split(store, "train")
    np.testing.assert_array_equal(loaded, features)
    np.testing.assert_array_equal(loaded_labels, labels)


def test_a_different_job_cannot_resume_a_partial_split(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    writer = make_writer(store)
    fill(writer, rng.normal(size=(300, 7)), np.zeros(300, int), chunks=[0])
    other = PROVENANCE | {"dataset": PROVENANCE["dataset"] | {"fingerprint": "zzz"}}
    with pytest.raises(ValueError, match="different job"):
        make_writer(store, provenance=other)
    # --overwrite starts over.
    fresh = make_writer(store, provenance=other, overwrite=True)
    assert fresh.pending_chunks() == [0, 1, 2, 3, 4]


def test_splits_must_share_a_backbone(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    writer = make_writer(store)
    fill(writer, rng.normal(size=(300, 7)), np.zeros(300, int))
    other = PROVENANCE | {"backbone": {"name": "another"}}
    with pytest.raises(ValueError, match="share one backbone"):
        extract.SplitWriter(store, "test", num_rows=10, feature_shape=(7,), dtype="float32",
                            provenance=other)


def test_bad_chunks_are_refused(tmp_path, rng):
    writer = make_writer(str(tmp_path / "s.zarr"))
    with pytest.raises(ValueError, match="shape"):
        writer.write_chunk(0, np.zeros((10, 7)), np.zeros(10))
    bad = np.zeros((64, 7))
    bad[5, 2] = np.inf
    with pytest.raises(ValueError, match="NaN/Inf"):
        writer.write_chunk(0, bad, np.zeros(64))
    assert writer.pending_chunks() == [0, 1, 2, 3, 4]
