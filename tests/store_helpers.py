"""A small feature store written through `extract.SplitWriter`, for the store's tests."""

import numpy as np

from dpprobe import extract

PROVENANCE = {
    "backbone": {"name": "test-backbone", "weights_source": "none"},
    "preprocessing": {"kind": "none"},
    "dataset": {"name": "synthetic", "fingerprint": "abc", "num_classes": 4},
}


def make_writer(store, **kwargs) -> extract.SplitWriter:
    """A train split of 300 rows x 7 in 5 chunks of 64 rows (the last one 44)."""
    args = dict(num_rows=300, feature_shape=(7,), dtype="float32", provenance=PROVENANCE,
                rows_per_chunk=64)
    return extract.SplitWriter(store, "train", **(args | kwargs))


def fill(split_writer, features, labels, chunks=None) -> None:
    """Write the given chunks (default: every pending one)."""
    for chunk in split_writer.pending_chunks() if chunks is None else chunks:
        start, stop = split_writer.chunk_rows(chunk)
        split_writer.write_chunk(chunk, features[start:stop], labels[start:stop])


def complete_store(store, rng, dtype="float32") -> tuple[np.ndarray, np.ndarray]:
    """A complete train split of random features; returns (features, labels) as written."""
    features = rng.normal(size=(300, 7)).astype(np.float32)
    labels = rng.integers(0, 4, size=300)
    split_writer = make_writer(store, dtype=dtype)
    fill(split_writer, features, labels)
    assert split_writer.finalize()
    split_writer.close()
    return features, labels
