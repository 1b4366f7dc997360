"""The audit: lower bounds that hold, a canary whose gradient is the claim's worst case, scores
whose distribution is the claim's, and broken mechanisms caught.

Tests that run the production trainer assert at 99.99% confidence, so that a sound mechanism
fails them with negligible probability while the broken ones (half the noise, an unclipped
canary) still exceed the claim; how often the product's 95% bounds exceed the claim over
repetitions is measured in `benchmarks/audit.py`.
"""

import json
import math

import jax
import numpy as np
import pytest
from scipy import stats

from dpprobe import accounting, dp, probe
from dpprobe.pipelines import cli

DELTA = 1e-5
STRICT = 1e-4  # significance of the assertions that run the trainer


def _gaussian_pair(rng, mu, n):
    """Scores of a mu-GDP pair: N(mu, 1) with the canary, N(0, 1) without."""
    return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


# --------------------------------------------------------------------------------------------
# The statistics, on scores of known distribution
# --------------------------------------------------------------------------------------------


def test_gdp_bound_is_the_clopper_pearson_closed_form_and_covers_mu():
    rng = np.random.default_rng(0)
    mu, n, reps = 0.5, 2000, 400
    lower = np.array([dp.gdp_mu_bounds(*_gaussian_pair(rng, mu, n), mu / 2)[0]
                      for _ in range(reps)])
    # Coverage: a 95% lower bound exceeds the true mu in at most 5% of repetitions (here
    # ~0.3%: both error rates must be off together); a point estimate would in half of them.
    assert np.sum(lower > mu) <= 0.05 * reps
    # At the expected error counts the bound is Phi^-1 of the one-sided Clopper-Pearson upper
    # bounds (scipy's beta quantile), and the mean bound sits there.
    rate = stats.norm.cdf(-mu / 2)
    upper = stats.beta.ppf(1 - 0.025, rate * n + 1, n - rate * n)
    expected = 2 * stats.norm.isf(upper)
    assert abs(lower.mean() - expected) < 0.01
    assert 0.75 * mu < expected < mu


def test_jax_privacy_gdp_bound_is_not_a_lower_bound_and_ours_is():
    """Why `dp.auditing` computes the Gaussian-DP bound itself: on two samples of one
    distribution (epsilon 0), jax-privacy 2.0.0's `epsilon_from_gdp` takes |mu| of the reversed
    test with the wrong-sided confidence bounds. If this starts failing, jax-privacy fixed it."""
    from jax_privacy.auditing import CanaryScoreAuditor

    rng = np.random.default_rng(1)
    same_in, same_out = rng.normal(size=10_000), rng.normal(size=10_000)
    assert CanaryScoreAuditor(same_in, same_out).epsilon_from_gdp(0.05, DELTA) > 2.0
    gdp_threshold, cp_threshold = dp.choose_thresholds(rng.normal(size=10**5),
                                                          rng.normal(size=10**5), DELTA)
    bounds = dp.audit_bounds(same_in, same_out, delta=DELTA, gdp_threshold=gdp_threshold,
                                cp_threshold=cp_threshold)
    assert bounds.gdp_epsilon_lower < 0.5 and bounds.cp_epsilon_lower < 0.5


def test_tightness_of_10k_scores_per_side_matches_what_the_claim_allows():
    """With 10^4 exact mu-GDP scores per side and thresholds chosen on the claim, the
    Gaussian-DP bound reaches 80-96% of epsilon (1 to 8) at 95%: the benchmark's target."""
    rng = np.random.default_rng(2)
    for epsilon, low in ((1.0, 0.65), (4.0, 0.88), (8.0, 0.92)):
        mu = accounting.gdp_mu(epsilon, DELTA)
        thresholds = dp.choose_thresholds(*_gaussian_pair(rng, mu, 10**5), DELTA,
                                             sizes=(10**4, 10**4))
        # The middle, where the Gaussian-DP test is tightest (its bound is flat there).
        assert abs(thresholds[0] - mu / 2) < 0.5
        assert thresholds[1] > mu  # the tail: where log(TPR / FPR) is largest
        bounds = dp.audit_bounds(*_gaussian_pair(rng, mu, 10**4), delta=DELTA,
                                    gdp_threshold=thresholds[0], cp_threshold=thresholds[1])
        assert low * epsilon < bounds.gdp_epsilon_lower <= epsilon
        assert abs(bounds.gdp_mu_estimate - mu) < 0.1
        assert 0 < bounds.cp_epsilon_lower < bounds.gdp_epsilon_lower
        auroc = stats.norm.cdf(mu / math.sqrt(2))  # the closed form for a Gaussian pair
        assert abs(bounds.auroc - auroc) < 0.02
        tpr = stats.norm.sf(stats.norm.isf(0.1) - mu)
        assert abs(bounds.tpr_at_fpr[0.1] - tpr) < 0.03


def test_one_run_bound_on_a_known_gaussian_dp_pair():
    """Steinke et al.'s one-run audit through CanaryScoreAuditor: 1,000 canaries, each in with
    probability 1/2, mu-GDP scores; the bound stays below the claim and shows something, and
    even perfect guesses cannot show much (what the docstring states)."""
    rng = np.random.default_rng(3)
    included = rng.random(1000) < 0.5
    mu = 2.0
    claim = accounting.gdp_epsilon(mu, DELTA)  # ~10
    scores = np.where(included, rng.normal(mu, 1.0, 1000), rng.normal(0.0, 1.0, 1000))
    bound = dp.one_run_epsilon_bound(scores, included, DELTA)
    assert 1.5 < bound < claim
    assert dp.one_run_epsilon_bound(scores, included, DELTA, threshold=mu / 2) < claim
    perfect = np.where(included, 100.0, 0.0) + rng.normal(size=1000)
    cap = dp.one_run_epsilon_bound(perfect, included, DELTA)
    assert 3.5 < cap < 5.8
    with pytest.raises(ValueError, match="booleans"):
        dp.one_run_epsilon_bound(scores, included.astype(int), DELTA)


# --------------------------------------------------------------------------------------------
# The canary
# --------------------------------------------------------------------------------------------


def test_canary_rows_and_their_null_neighbour():
    rng = np.random.default_rng(4)
    features, labels = rng.normal(size=(5, 3)), np.array([0, 1, 2, 1, 0])
    with_canary, canary_labels = probe.add_canary(features, labels, include=True)
    without, null_labels = probe.add_canary(features, labels, include=False)
    assert with_canary.shape == (6, 4) and np.array_equal(with_canary, without)
    np.testing.assert_array_equal(with_canary[:5, :3], features.astype(np.float32))
    assert not with_canary[:5, 3].any()
    np.testing.assert_array_equal(with_canary[5], [0, 0, 0, probe.CANARY_NORM])
    assert canary_labels[5] == probe.CANARY_LABEL and null_labels[5] == -1
    views, _ = probe.add_canary(rng.normal(size=(5, 2, 3)), labels, include=True)
    assert views.shape == (6, 2, 4) and (views[5, :, 3] == probe.CANARY_NORM).all()


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_the_canary_gradient_is_c_along_u_where_no_row_reaches(loss):
    """The production clipper at the initial parameters: the canary contributes C A / sqrt(A^2+1)
    along u to w[d, :] (closed form: u = (1/K - e_c) normalized for softmax), and the data rows
    contribute exactly nothing there."""
    rng = np.random.default_rng(5)
    spec = probe.ProbeSpec(num_classes=4, loss=loss)
    features, labels = probe.add_canary(rng.normal(size=(30, 6)) * 5, rng.integers(0, 4, 30),
                                        include=True)
    onehot = np.eye(4, dtype=np.float32)[labels]
    params = probe.init_params(1, 7, spec)
    clip = np.array([0.7], np.float32)
    u = probe.canary_direction(spec)
    if loss == "softmax":
        closed = np.full(4, 0.25) - np.eye(4)[probe.CANARY_LABEL]
        np.testing.assert_allclose(u, closed / np.linalg.norm(closed), rtol=1e-6)
    sums, _ = probe.clipped_grad_sum(params, features, onehot, clip, loss=loss)
    a = probe.CANARY_NORM
    np.testing.assert_allclose(np.asarray(sums["w"])[0, 6], 0.7 * a / math.hypot(a, 1) * u,
                               rtol=1e-5)
    mask = np.r_[np.ones(30), 0.0].astype(np.float32)
    data_only, _ = probe.clipped_grad_sum(params, features, onehot, clip, loss=loss, mask=mask)
    assert not np.asarray(data_only["w"])[0, 6].any()


def test_claimed_scores_are_the_gaussian_pair_of_the_plan():
    """DP-SGD under the claim: (T C + N(0, T sigma^2 C^2)) / N with the canary, the noise
    alone without (KS tests; they reject a noise scale off by x0.67 or x1.5)."""
    rng = np.random.default_rng(6)
    spec = probe.ProbeSpec(num_classes=3, optimizer="sgd")
    plan = accounting.DpPlan(2.0, 4, clip_norm=0.5)
    run, n = probe.RunSpec(plan, 1e-9), 101
    scale = math.sqrt(4) * 2.0 * 0.5 / n
    for include, mean in ((True, 4 * 0.5 / n), (False, 0.0)):
        scores = probe.claimed_canary_scores(run, spec, num_examples=n, count=4000,
                                             include=include, rng=rng)
        assert stats.kstest(scores, "norm", args=(mean, scale)).pvalue > 1e-4
        for wrong in (0.67, 1.5):
            assert stats.kstest(scores, "norm", args=(mean, wrong * scale)).pvalue < 1e-6


# --------------------------------------------------------------------------------------------
# The production trainer and mechanism
# --------------------------------------------------------------------------------------------


def _rows(rng, n=60, d=8, classes=3):
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, classes, n)


def _audit(features, labels, spec, epsilon, steps, runs, significance=STRICT):
    """Scores of the production trainer, thresholds from the claim, bounds; and the claim."""
    sigma = accounting.calibrate_noise_multiplier(epsilon, DELTA, steps=steps)
    plan = accounting.DpPlan(sigma, steps)
    num_examples = len(features) + 1
    run = probe.RunSpec(plan, probe.audit_learning_rate(plan, num_examples))
    scores = [probe.train_canary_runs(features, labels, [run] * runs, spec, include=include)
              for include in (True, False)]
    rng = np.random.default_rng()
    simulated = [probe.claimed_canary_scores(run, spec, num_examples=num_examples,
                                             count=50_000, include=include, rng=rng)
                 for include in (True, False)]
    thresholds = dp.choose_thresholds(*simulated, DELTA, significance, sizes=(runs, runs))
    bounds = dp.audit_bounds(*scores, delta=DELTA, gdp_threshold=thresholds[0],
                                cp_threshold=thresholds[1], significance=significance)
    return bounds, scores, plan


@pytest.mark.parametrize("steps", [1, 10])
def test_dp_sgd_scores_have_the_claimed_distribution(steps):
    """Full-batch DP-SGD through `train_probe`: the standardized scores are N(mu, 1) with the
    canary and N(0, 1) without, mu = sqrt(T)/sigma (KS tests that reject a noise scale off by
    x0.67 or x1.5)."""
    rng = np.random.default_rng(7)
    features, labels = _rows(rng)
    spec = probe.ProbeSpec(num_classes=3, optimizer="sgd")
    _, (scores_in, scores_out), plan = _audit(features, labels, spec, 4.0, steps, 2000)
    num_examples = len(features) + 1
    unit = math.sqrt(steps) * plan.noise_multiplier / num_examples  # noise std of a score
    mu = math.sqrt(steps) / plan.noise_multiplier
    for scores, mean in ((scores_in, mu), (scores_out, 0.0)):
        standardized = scores / unit
        assert stats.kstest(standardized, "norm", args=(mean, 1.0)).pvalue > 1e-5
        for wrong in (0.67, 1.5):
            assert stats.kstest(standardized, "norm", args=(mean, wrong)).pvalue < 1e-6


@pytest.mark.parametrize(("optimizer", "steps"), [("sgd", 1), ("sgd", 10), ("adam", 1)])
def test_lower_bounds_stay_below_the_claim(optimizer, steps):
    """Every lower bound at or below the claim, at epsilon 1, 2, 4, 8 (99.99% confidence)."""
    rng = np.random.default_rng(8)
    features, labels = _rows(rng)
    spec = probe.ProbeSpec(num_classes=3, optimizer=optimizer)
    for epsilon in (1.0, 2.0, 4.0, 8.0):
        bounds, _, plan = _audit(features, labels, spec, epsilon, steps, 1000)
        assert bounds.gdp_mu_lower <= math.sqrt(steps) / plan.noise_multiplier
        assert bounds.gdp_epsilon_lower <= plan.epsilon(DELTA)
        assert bounds.cp_epsilon_lower <= plan.epsilon(DELTA)
    # The last (epsilon 8) still shows most of it.
    assert bounds.gdp_epsilon_lower > 0.4 * plan.epsilon(DELTA)


@pytest.fixture
def broken(monkeypatch):
    """Swap a piece of the production mechanism inside a test; compiled programs are dropped
    before and after, so that neither the broken nor the sound one is reused by mistake."""
    jax.clear_caches()
    yield monkeypatch
    monkeypatch.undo()
    jax.clear_caches()


def test_halved_noise_is_caught(broken):
    original = dp.noise.gaussian_noise
    broken.setattr(dp.noise, "gaussian_noise",
                   lambda key, size, *dtype: 0.5 * original(key, size, *dtype))
    rng = np.random.default_rng(9)
    features, labels = _rows(rng)
    spec = probe.ProbeSpec(num_classes=3, optimizer="sgd")
    bounds, _, plan = _audit(features, labels, spec, 2.0, 1, 1000)
    claimed_mu = 1.0 / plan.noise_multiplier
    assert bounds.gdp_mu_lower > claimed_mu  # at 99.99%
    assert bounds.gdp_epsilon_lower > plan.epsilon(DELTA)
    assert bounds.gdp_mu_estimate == pytest.approx(2 * claimed_mu, abs=0.25)


def test_unclipped_canary_is_caught(broken):
    """A clipper that clips every row but the last (the canary): its gradient, ~800 C, enters
    in full."""
    original = probe.train.clipped_grad_sum

    def skips_the_last_row(params, features, onehot, clip_norm, *, mask=None, **kwargs):
        last = (np.arange(features.shape[0]) == features.shape[0] - 1).astype(np.float32)
        mask = np.ones(features.shape[0], np.float32) if mask is None else mask
        clipped, count = original(params, features, onehot, clip_norm, mask=mask * (1 - last),
                                  **kwargs)
        unclipped, _ = original(params, features, onehot, clip_norm * np.inf, mask=mask * last,
                                **kwargs)
        return jax.tree.map(lambda a, b: a + b, clipped, unclipped), count

    broken.setattr(probe.train, "clipped_grad_sum", skips_the_last_row)
    rng = np.random.default_rng(10)
    features, labels = _rows(rng)
    spec = probe.ProbeSpec(num_classes=3, optimizer="sgd")
    bounds, _, plan = _audit(features, labels, spec, 2.0, 1, 1000)
    assert bounds.auroc == 1.0
    assert bounds.gdp_epsilon_lower > plan.epsilon(DELTA)  # at 99.99%


def test_equal_calls_share_one_program():
    rng = np.random.default_rng(11)
    features, labels = _rows(rng, n=20)
    spec = probe.ProbeSpec(num_classes=3, optimizer="sgd")
    run = probe.RunSpec(accounting.DpPlan(3.0, 1), 1e-9)
    before = probe.train._first_step._cache_size()
    scores = probe.train_canary_runs(features, labels, [run] * 50, spec, include=True,
                                     runs_per_call=17)  # 3 calls of 17 runs
    assert scores.shape == (50,)
    assert probe.train._first_step._cache_size() == before + 1


# --------------------------------------------------------------------------------------------
# The job and the CLI
# --------------------------------------------------------------------------------------------


def test_dpprobe_audit_end_to_end(digits_store, tmp_path, capsys):
    out, plot = tmp_path / "audit.json", tmp_path / "audit.png"
    code = cli.main(["audit", digits_store, "--epsilon", "4", "--runs", "400", "--rows", "300",
                     "--confidence", "0.9999", "--out", str(out), "--plot", str(plot),
                     "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = json.loads(out.read_text())
    claim = results["claim"]
    assert claim["epsilon"] == pytest.approx(4.0, rel=1e-6)  # from the ledger (PLD)
    assert claim["neighboring_relation"] == "zero_out" and claim["accountant"] == "pld"
    assert claim["gdp_mu"] == pytest.approx(1.0 / claim["noise_multiplier"])
    bounds = results["bounds"]
    assert bounds["confidence"] == pytest.approx(0.9999)
    assert bounds["gdp_epsilon_lower"] <= claim["epsilon"] and not results["claim_refuted"]
    assert sum(results["histogram"]["in"]) == sum(results["histogram"]["out"]) == 400
    assert results["audit"]["num_train"] == 301 and "scores" not in results
    assert "not a proof" in results["note"] or "never prove" in results["note"]
    assert "Gaussian-DP fit: mu >=" in printed and "Clopper-Pearson: epsilon >=" in printed
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert cli.main(["audit", digits_store, "--epsilon", "inf"]) == 2


def test_the_auroc_is_the_unbiased_mann_whitney_estimate(rng):
    """`empirical_auroc` is U / (n_in n_out), ties half, equal to scipy's Mann-Whitney U and to
    a hand count; its mean over small samples is the true AUROC, where jax-privacy's
    `attack_auroc` (the ROC's convex hull) is biased high: why the audits report ours."""
    from jax_privacy import auditing

    assert dp.empirical_auroc([3.0, 1.0], [2.0, 1.0, 0.0]) == (3 + 1.5) / 6  # 1 = 1 ties
    assert dp.empirical_auroc([5.0], [5.0]) == 0.5
    x, y = rng.normal(0.3, 1, 400), rng.normal(0, 1, 300)
    assert dp.empirical_auroc(x, y) == pytest.approx(stats.mannwhitneyu(x, y).statistic / 1.2e5,
                                                     rel=1e-12)
    true = stats.norm.cdf(0.5 / math.sqrt(2))  # N(0.5, 1) vs N(0, 1): 0.638
    ours, hull = [], []
    for _ in range(300):
        x, y = rng.normal(0.5, 1, 20), rng.normal(0, 1, 20)
        ours.append(dp.empirical_auroc(x, y))
        hull.append(float(auditing.CanaryScoreAuditor(x, y).attack_auroc()))
    # standard error of the mean of 300: about 0.09 / sqrt(300) = 0.005
    assert abs(np.mean(ours) - true) < 0.02
    assert np.mean(hull) - true > 0.04
    with pytest.raises(ValueError, match="finite"):
        dp.empirical_auroc([1.0, np.nan], [0.0])
