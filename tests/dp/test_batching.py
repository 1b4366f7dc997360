"""Pad-and-mask and Poisson batch selection."""

import numpy as np
import pytest

from dpprobe import dp


def test_pad_rows_pads_with_zeros_and_masks_the_padding():
    x, y = np.ones((3, 2), np.float16), np.array([4, 5, 6])
    px, py, mask = dp.pad_rows(x, y, rows=5)
    assert px.shape == (5, 2) and px.dtype == np.float16 and py.shape == (5,)
    np.testing.assert_array_equal(mask, [1, 1, 1, 0, 0])
    assert (px[3:] == 0).all() and (py[3:] == 0).all()
    with pytest.raises(ValueError, match="exceed"):
        dp.pad_rows(x, rows=2)
    with pytest.raises(ValueError, match="different row counts"):
        dp.pad_rows(x, y[:2], rows=5)


def test_poisson_batches_include_each_row_with_probability_q():
    n, q, steps, p = 200, 0.1, 400, 8
    rng = np.random.default_rng(0)  # seeded: public batches, for the test only
    counts = np.zeros(n)
    batches = list(dp.poisson_batches(n, [q, 0.5], [steps, 3], p, rng))
    assert len(batches) == steps
    for t, batch in enumerate(batches):
        assert batch.index.shape[1:] == (2, p) and batch.mask.shape == batch.index.shape
        np.testing.assert_array_equal(batch.mask.sum(axis=(0, 2)), batch.sizes)
        for r in range(2):
            rows = batch.index[:, r][batch.mask[:, r] > 0]
            assert len(np.unique(rows)) == len(rows) and ((rows >= 0) & (rows < n)).all()
        assert t < 3 or batch.sizes[1] == 0  # a finished run gets empty batches
        counts[batch.index[:, 0][batch.mask[:, 0] > 0]] += 1
    # Each row's count is Binomial(steps, q): mean 40, std 6; all rows within 6 std.
    assert abs(counts.mean() - q * steps) < 1.0
    assert np.abs(counts - q * steps).max() < 6 * np.sqrt(steps * q * (1 - q))
