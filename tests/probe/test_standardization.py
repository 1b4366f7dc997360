"""Private feature standardization: the sensitivity of its two releases, its noise scale, its
post-processing (folding into the model) and its place in the tune job's ledger."""

import math

import numpy as np
import pytest
from scipy import stats

from dpprobe import accounting, dp, probe
from dpprobe.probe.standardization import clipped_row_sum
from tests.conftest import fixed_keys


def _hostile_rows(rng, n=60, d=7):
    rows = rng.normal(size=(n, d)) * rng.uniform(0.01, 3.0, size=(n, 1))
    rows[3] *= 1e30  # overflows float32 when squared
    rows[5] = 0.0
    rows[7, 2] = np.nan
    rows[11, 0] = np.inf
    rows[13] = 1e-30
    return rows


def test_leave_one_out_moves_a_clipped_sum_by_at_most_the_clip(rng):
    """Replacing any row by a null row (masked, or non-finite) moves the sum by at most B;
    non-finite rows contribute nothing."""
    rows = _hostile_rows(rng)
    clip = 1.5
    total = clipped_row_sum(rows, clip)
    for i in range(len(rows)):
        mask = np.ones(len(rows), bool)
        mask[i] = False
        nulled = rows.copy()
        nulled[i] = np.nan
        for without in (clipped_row_sum(rows, clip, mask), clipped_row_sum(nulled, clip)):
            assert np.linalg.norm(total - without) <= clip
            if i in (7, 11):
                np.testing.assert_array_equal(total, without)
    # C = large: the plain sum of the finite rows.
    finite = np.isfinite(rows).all(axis=1)
    np.testing.assert_allclose(clipped_row_sum(rows[finite][:3], 1e40), rows[finite][:3].sum(0))


def test_huge_rows_move_the_sum_by_at_most_the_clip_exactly():
    """Rows at float32's largest values (the review's case: a sum moved by 8.000000000000002
    with B = 8) stay within B, and a row whose norm overflows float64 is a null row."""
    rows = np.full((5, 16), 3e38, np.float64)
    rows[1] = 1e300  # norm overflows: null
    clip = 8.0
    for i in range(len(rows)):
        mask = np.ones(len(rows), bool)
        mask[i] = False
        assert np.linalg.norm(clipped_row_sum(rows, clip) - clipped_row_sum(rows, clip, mask)) <= (
            clip)
    np.testing.assert_array_equal(clipped_row_sum(rows[1:2], clip), 0.0)


def test_no_floating_point_warning_depends_on_a_row(rng):
    """Whether numpy warns must not tell whether some row is null, zero or huge (a warning on
    stderr is an output): the clipped sums and the whole standardizer run silently."""
    import warnings

    rows = rng.normal(size=(20, 64)).astype(np.float32)
    rows[0] = 0.0
    rows[1] = np.nan
    rows[2] = 3e38
    mask = np.ones(20, bool)
    mask[3] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clipped_row_sum(rows, 8.0, mask)
        probe.private_standardizer(rows, noise_multiplier=2.0, clip_norm=8.0,
                                   key=fixed_keys(1, 0)[0], mask=mask)


def test_released_mean_moves_by_at_most_b_over_n_and_scale_by_its_own_bound(rng):
    """With the same noise (a fixed key, for the test), D and D with one row nulled give means
    that differ by at most B / N; the second release, for the released mean, is a clipped sum
    of |x - mean| with bound B + ||mean||, within which a row moves it."""
    features = rng.normal(size=(80, 9)).astype(np.float32)
    features[4] *= 1e4
    clip, n = 2.0, len(features)
    mask = np.ones(n, bool)
    mask[4] = False
    full = probe.private_standardizer(features, noise_multiplier=3.0, clip_norm=clip,
                                      key=fixed_keys(1, 0)[0])
    minus = probe.private_standardizer(features, noise_multiplier=3.0, clip_norm=clip,
                                       key=fixed_keys(1, 0)[0], mask=mask)
    assert np.linalg.norm(full.mean.astype(np.float64) - minus.mean) * n <= clip * (1 + 1e-5)
    bound = full.clip_norms[1]
    assert bound == pytest.approx(clip + np.linalg.norm(full.mean), rel=1e-6)
    deviations = np.abs(features.astype(np.float64) - full.mean)
    moved = clipped_row_sum(deviations, bound) - clipped_row_sum(deviations, bound, mask)
    assert np.linalg.norm(moved) <= bound * (1 + 1e-12)
    assert 0 < np.linalg.norm(moved)


def test_released_statistics_carry_noise_of_std_sigma_times_their_bound(rng):
    """Rows +-a per feature (half each): exact sums known, so the released mean and scale
    minus their exact values are the noise, whose std must be sigma B / N and sigma B' / N."""
    n, d, a, sigma, clip = 2000, 4000, 5.0, 5.0, 10.0
    signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    features = (a * signs[:, None] * np.ones((1, d))).astype(np.float32)
    released = probe.private_standardizer(features, noise_multiplier=sigma, clip_norm=clip,
                                          key=dp.make_keys(1)[0], floor_multiple=1e-9)
    # Every row is clipped (||x_i|| = a sqrt(d) > B), symmetrically: the exact mean is 0, and
    # the deviations' exact sum (clipped too) lies far above their noise (no scale floored).
    assert np.all(released.scale > released.floor)
    mean_noise = released.mean.astype(np.float64) * n / (sigma * clip)
    bound = released.clip_norms[1]
    exact = clipped_row_sum(np.abs(features.astype(np.float64) - released.mean), bound)
    scale_noise = (released.scale / math.sqrt(math.pi / 2) * n - exact) / (sigma * bound)
    for noise in (mean_noise, scale_noise):
        assert stats.kstest(noise, stats.norm().cdf).pvalue > 1e-3
        assert stats.kstest(noise, stats.norm(scale=0.67).cdf).pvalue < 1e-6
        assert stats.kstest(noise, stats.norm(scale=1.5).cdf).pvalue < 1e-6


def test_scale_is_floored_at_a_multiple_of_its_noise_std(rng):
    features = np.zeros((50, 6), np.float32)  # every deviation is pure noise
    released = probe.private_standardizer(features, noise_multiplier=2.0, clip_norm=1.0,
                                          key=dp.make_keys(1)[0])
    expected = 3.0 * 2.0 * released.clip_norms[1] / 50 * math.sqrt(math.pi / 2)
    assert released.floor == pytest.approx(expected)
    assert np.all(released.scale >= np.float32(expected) * (1 - 1e-6))
    with pytest.raises(ValueError, match="noise_multiplier must be finite and > 0"):
        probe.private_standardizer(features, noise_multiplier=0.0, clip_norm=1.0,
                                   key=dp.make_keys(1)[0])


def test_folding_gives_the_same_logits_on_the_unstandardized_features(rng):
    features = rng.normal(size=(30, 2, 8)).astype(np.float32) * 3 + 1
    standardizer = probe.Standardizer(rng.normal(size=8).astype(np.float32),
                                      rng.uniform(0.5, 2, size=8).astype(np.float32))
    params = {"w": rng.normal(size=(3, 8, 4)).astype(np.float32),
              "b": rng.normal(size=(3, 4)).astype(np.float32)}
    on_standardized = probe.linear_logits(params, standardizer.apply(features))
    folded = probe.linear_logits(standardizer.fold(params), features)
    np.testing.assert_allclose(folded, on_standardized, rtol=1e-4, atol=1e-4)


def test_normalized_norm_bound_holds(rng):
    features = rng.normal(size=(100, 54)) * rng.uniform(1e-4, 1e3, size=(100, 1))
    for method, groups in (("group", 27), ("group", 1), ("l2", 1)):
        out = np.asarray(probe.normalize_features(features, method, groups=groups), np.float64)
        bound = probe.normalized_norm_bound(method, 54)
        assert np.all(np.linalg.norm(out, axis=1) <= bound * (1 + 1e-6))
    assert math.isinf(probe.normalized_norm_bound("none", 54))


def test_tune_with_standardization_pays_for_it_inside_the_budget(digits_store):
    """Its two releases are one ledger entry, DpPlan(sigma, 2) at eps_standardize, and the
    whole job still composes to the requested epsilon; turning it off gives the final run
    that budget back."""
    from dpprobe.pipelines import tune_job

    options = dict(trials=2, steps_choices=(3,), r_range=(1, 30), quiet=True)
    on = tune_job.linear_scaling_search(digits_store, 1.0, 1e-5, eps_standardize=0.2,
                                        standardize=True, **options)
    off = tune_job.linear_scaling_search(digits_store, 1.0, 1e-5, standardize=False, **options)
    entry = on["ledger"]["entries"][0]
    assert entry["name"] == "standardization" and entry["steps"] == 2
    assert accounting.DpPlan(entry["noise_multiplier"], 2).epsilon(1e-5) == pytest.approx(
        0.2, rel=1e-6)
    assert on["ledger"]["epsilon"] == pytest.approx(1.0, abs=1e-6) and (
        on["ledger"]["epsilon"] <= 1.0)
    assert off["standardization"] == {"decision": "off (--no-standardize)"} and (
        "standardization" not in {
        e["role"] for e in off["ledger"]["entries"]})
    assert off["chosen"]["noise_multiplier"] < on["chosen"]["noise_multiplier"]
    assert on["final"]["test_accuracy"] > 0.5
