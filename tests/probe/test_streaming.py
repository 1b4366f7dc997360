"""The streamed trainer equals the in-memory one (chunks from memory or a Zarr store)."""

import math

import numpy as np
import pytest

from dpprobe import dp, probe
from tests.conftest import calibrated_runs, fixed_keys, random_problem


@pytest.mark.parametrize("views", [None, 3])
def test_streamed_chunks_equal_in_memory(rng, views):
    features, labels, _ = random_problem(rng, n=203, d=10, c=4, views=views)
    spec = probe.ProbeSpec(4, optimizer="adam", normalization="l2")
    runs = (calibrated_runs([0.5, 4.0, math.inf], steps=4, lr=0.05)
            + calibrated_runs([1.0], steps=2, lr=0.1))
    keys = fixed_keys(len(runs), 5)
    memory = probe.train_probe(features, labels, runs, keys, spec)

    def chunks():
        for start in range(0, len(labels), 64):  # 4 chunks, the last one short (11 rows)
            yield features[start:start + 64], labels[start:start + 64]

    streamed = probe.train_probe_streaming(chunks, runs, keys, spec, num_examples=len(labels),
                                           dim=10)
    for key in ("w", "b"):
        np.testing.assert_allclose(streamed.params[key], memory.params[key], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(streamed.clipped_fraction, memory.clipped_fraction, rtol=1e-6)


def test_streaming_from_a_zarr_store_equals_in_memory(tmp_path, rng):
    from dpprobe import extract

    features, labels, _ = random_problem(rng, n=150, d=6, c=3)
    writer = extract.SplitWriter(
        str(tmp_path / "s.zarr"), "train", num_rows=150, feature_shape=(6,), dtype="float32",
        provenance={"backbone": {"name": "x"}, "dataset": {"name": "y", "num_classes": 3}},
        rows_per_chunk=64,
    )
    for chunk in writer.pending_chunks():
        a, b = writer.chunk_rows(chunk)
        writer.write_chunk(chunk, features[a:b], labels[a:b])
    writer.finalize()
    spec = probe.ProbeSpec(3, optimizer="momentum")
    runs = calibrated_runs([2.0], steps=3, lr=0.5)
    keys = fixed_keys(1, 2)
    streamed = probe.train_probe_streaming(
        lambda: extract.iter_split_chunks(str(tmp_path / "s.zarr"), "train"), runs, keys, spec,
        num_examples=150, dim=6,
    )
    memory = probe.train_probe(features, labels, runs, keys, spec)
    np.testing.assert_allclose(streamed.params["w"], memory.params["w"], rtol=1e-4, atol=1e-6)


def test_streaming_checks_the_row_count(rng):
    features, labels, _ = random_problem(rng, n=40, d=4, c=3)
    with pytest.raises(ValueError, match="held 40 rows, expected 41"):
        probe.train_probe_streaming(lambda: [(features, labels)], calibrated_runs([1.0], 1, 0.1),
                                    dp.make_keys(1), probe.ProbeSpec(3), num_examples=41,
                                    dim=4)
