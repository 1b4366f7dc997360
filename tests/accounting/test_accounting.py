"""Accounting against dp_accounting and closed forms."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import stats

from dpprobe import accounting


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("steps", [1, 10, 1000])
def test_full_batch_calibration_round_trips_through_pld(epsilon, steps):
    delta = 1e-5
    sigma = accounting.calibrate_noise_multiplier(epsilon, delta, steps=steps)
    # dp_accounting called directly on the same mechanism.
    acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.GaussianDpEvent(sigma), steps)
    assert acc.get_epsilon(delta) == pytest.approx(epsilon, abs=1e-3)
    assert accounting.DpPlan(sigma, steps).epsilon(delta) == pytest.approx(epsilon, abs=1e-3)
    # sqrt(T) times the single-Gaussian sigma of dp_accounting's analytic Gaussian.
    single = dp_accounting.get_sigma_gaussian(epsilon, delta)
    assert sigma == pytest.approx(math.sqrt(steps) * single, rel=1e-6)


def test_gdp_delta_matches_the_analytic_gaussian_formula():
    # Balle & Wang: delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).
    for mu in (0.1, 0.5, 1.0, 2.0):
        for eps in (0.1, 1.0, 3.0):
            expected = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
                -eps / mu - mu / 2
            )
            assert accounting.gdp_delta(eps, mu) == pytest.approx(expected, rel=1e-9)
            assert accounting.gdp_epsilon(mu, accounting.gdp_delta(eps, mu)) == pytest.approx(
                eps, rel=1e-7
            )


@pytest.mark.parametrize("q,steps", [(0.01, 200), (0.1, 50), (0.5, 4)])
def test_poisson_calibration_meets_the_target_tightly(q, steps):
    delta, epsilon = 1e-5, 1.0
    sigma = accounting.calibrate_noise_multiplier(
        epsilon, delta, steps=steps, sampling_probability=q
    )
    spent = accounting.DpPlan(sigma, steps, q).epsilon(delta)
    assert spent <= epsilon
    assert spent == pytest.approx(epsilon, abs=1e-3)
    # Direct dp_accounting composition of the same event agrees.
    acc = pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert acc.get_epsilon(delta) == pytest.approx(spent, rel=1e-9)
    # Subsampling amplifies: less noise than full batch.
    assert sigma < accounting.calibrate_noise_multiplier(epsilon, delta, steps=steps)


def test_the_coarse_pld_only_locates_sigma(monkeypatch):
    """The search on the coarse PLD and the steps from it give what a search on the
    accountant's own curve gives (within its tolerance); with the coarse curve made wrong (its
    epsilon shifted by 5% either way), the answer still meets the target and stays tight."""
    from dpprobe.accounting import calibration

    epsilon, delta, steps, q = 1.0, 1e-5, 10, 0.1
    full = accounting.gaussian_noise_multiplier(epsilon, delta, steps)
    alone = calibration._search(epsilon, delta, steps, q, "pld", full)
    coarse = calibration._coarse_pld_epsilon.__wrapped__
    for shift in (0.0, 0.05, -0.05):
        monkeypatch.setattr(calibration, "_coarse_pld_epsilon",
                            lambda event, d, a, shift=shift: coarse(event, d, a) * (1 + shift))
        sigma = accounting.calibrate_noise_multiplier(epsilon, delta, steps=steps,
                                                      sampling_probability=q)
        assert accounting.DpPlan(sigma, steps, q).epsilon(delta) <= epsilon
        assert accounting.DpPlan(sigma * (1 - 3e-6), steps, q).epsilon(delta) > epsilon
        assert sigma == pytest.approx(alone, rel=3e-6), shift


def test_rdp_calibration_round_trips_and_is_looser_than_pld():
    sigma = accounting.calibrate_noise_multiplier(2.0, 1e-5, steps=20, accountant="rdp")
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(sigma), 20)
    assert acc.get_epsilon(1e-5) == pytest.approx(2.0, abs=1e-3)
    assert acc.get_epsilon(1e-5) <= 2.0
    assert sigma > accounting.calibrate_noise_multiplier(2.0, 1e-5, steps=20)


def test_dp_event_describes_what_runs():
    full = accounting.DpPlan(3.0, 5).dp_event()
    assert full == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 5)
    poisson = accounting.DpPlan(1.0, 7, 0.1).dp_event()
    assert poisson == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 7
    )
    single = accounting.DpPlan(2.0, 1).dp_event()
    assert single == dp_accounting.GaussianDpEvent(2.0)
    assert accounting.DpPlan(0.0, 3, clip_norm=math.inf).epsilon(1e-5) == math.inf


def test_non_private_calibration_is_zero_noise():
    assert accounting.calibrate_noise_multiplier(math.inf, 1e-5, steps=10) == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"epsilon": -1.0, "delta": 1e-5}, "epsilon must be > 0"),
        ({"epsilon": 0.0, "delta": 1e-5}, "epsilon must be > 0"),
        ({"epsilon": float("nan"), "delta": 1e-5}, "epsilon must be > 0"),
        ({"epsilon": 1.0, "delta": 0.0}, "delta must be in"),
        ({"epsilon": 1.0, "delta": 1.5}, "delta must be in"),
        ({"epsilon": 1.0, "delta": 1e-5, "steps": 0}, "steps must be"),
        ({"epsilon": 1.0, "delta": 1e-5, "sampling_probability": 0.0}, "sampling_probability"),
        ({"epsilon": 1.0, "delta": 1e-5, "accountant": "moments"}, "accountant must be"),
    ],
)
def test_impossible_requests_get_clear_errors(kwargs, match):
    epsilon, delta = kwargs.pop("epsilon"), kwargs.pop("delta")
    with pytest.raises(ValueError, match=match):
        accounting.calibrate_noise_multiplier(epsilon, delta, **kwargs)


def test_plan_validation():
    with pytest.raises(ValueError, match="finite clip_norm"):
        accounting.DpPlan(1.0, 1, clip_norm=math.inf)
    with pytest.raises(ValueError, match="noise_multiplier"):
        accounting.DpPlan(-1.0, 1)
    with pytest.raises(ValueError, match="steps"):
        accounting.DpPlan(1.0, 2.5)


def test_gdp_epsilon_of_composition_matches_pld():
    """Panda et al. Cor. 2.2: T full-batch steps at sigma are sqrt(T)/sigma-GDP."""
    for sigma, steps in ((5.0, 10), (20.0, 100), (1.0, 1)):
        mu = math.sqrt(steps) / sigma
        exact = accounting.gdp_epsilon(mu, 1e-5)
        assert accounting.DpPlan(sigma, steps).epsilon(1e-5) == pytest.approx(exact, abs=1e-3)
    assert np.isfinite(accounting.gdp_mu(1.0, 1e-5))


@pytest.mark.parametrize("sigma,steps", [(0.6, 1), (3.7, 1), (13.3, 1), (5.0, 40), (70.0, 100)])
def test_closed_form_pld_equals_dp_accounting_pld(sigma, steps):
    """Full-batch Gaussian events: our exact PLD epsilon equals dp_accounting's PLD accountant."""
    event = accounting.DpPlan(sigma, steps).dp_event()
    acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(event)
    reference = acc.get_epsilon(1e-5)
    ours = accounting.compute_epsilon(event, 1e-5)
    assert ours == pytest.approx(reference, abs=1e-6)
    assert ours <= reference + 1e-12  # no discretization: never looser


def test_composed_gaussians_use_mu_composition():
    events = dp_accounting.ComposedDpEvent([
        accounting.DpPlan(4.0, 10).dp_event(), accounting.DpPlan(9.0, 3).dp_event(),
    ])
    assert accounting.gaussian_mu(events) == pytest.approx(math.sqrt(10 / 16 + 3 / 81))
    acc = pld.PLDAccountant()
    acc.compose(events)
    assert accounting.compute_epsilon(events, 1e-5) == pytest.approx(acc.get_epsilon(1e-5),
                                                                     abs=1e-3)
    assert accounting.gaussian_mu(accounting.DpPlan(1.0, 2, 0.5).dp_event()) is None


def test_a_non_private_part_makes_the_composition_infinite_at_once():
    events = dp_accounting.ComposedDpEvent([
        accounting.DpPlan(13.0, 1).dp_event(),
        accounting.DpPlan(0.0, 1, clip_norm=math.inf).dp_event(),
        accounting.DpPlan(1.0, 30, 0.01).dp_event(),
    ])
    assert accounting.compute_epsilon(events, 1e-5) == math.inf
    assert accounting.compute_epsilon(events, 1e-5, "rdp") == math.inf
    assert accounting.gaussian_mu(accounting.DpPlan(0.0, 2, clip_norm=math.inf).dp_event()) \
        == math.inf


def test_events_without_importing_the_accountants():
    """`accounting._dp_event`: a fresh process builds DpEvents and full-batch epsilons without
    dp_accounting's PLD/RDP (and SciPy); the classes are dp_accounting's own once it is
    imported."""
    import subprocess
    import sys

    code = """
import sys
from dpprobe import accounting
assert "dp_accounting" not in sys.modules and "scipy" not in sys.modules
plan = accounting.DpPlan(1.5, 7)
event = plan.dp_event()
assert accounting.event_to_dict(event)["type"] == "SelfComposedDpEvent"
assert plan.epsilon(1e-5) > 0  # full batch: the exact Gaussian DP closed form
assert "dp_accounting.pld" not in sys.modules and "scipy.stats" not in sys.modules
import dp_accounting
assert event == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 7)
assert isinstance(event, dp_accounting.DpEvent)
assert accounting.DpPlan(1.5, 7, 0.1).epsilon(1e-5) > 0  # the accountants work after it
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _dp_accounting_sigma(epsilon, delta, steps, q, accountant):
    """dp_accounting's own calibration of the same mechanism (zero-out neighbours), from its
    analytic Gaussian's full-batch sigma down to q/2 of it (expanding upwards if needed)."""
    relation = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    make = {"pld": lambda: pld.PLDAccountant(relation),
            "rdp": lambda: rdp.RdpAccountant(neighboring_relation=relation)}[accountant]

    def event(sigma):
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        if q < 1:
            gaussian = dp_accounting.PoissonSampledDpEvent(q, gaussian)
        return dp_accounting.SelfComposedDpEvent(gaussian, steps)

    full = math.sqrt(steps) * dp_accounting.get_sigma_gaussian(epsilon, delta)
    bracket = dp_accounting.LowerEndpointAndGuess(q * full / 2, full)
    return dp_accounting.calibrate_dp_mechanism(make, event, epsilon, delta, bracket,
                                                tol=1e-7 * full)


@pytest.mark.parametrize("epsilon,steps,q,accountant", [
    (1.0, 1000, 0.1, "pld"),
    (0.5, 100, 0.05, "pld"),
    (0.5, 100, 0.999, "pld"),  # q near 1: the central-limit estimate is no lower bound
    (2.0, 20, 1.0, "rdp"),
    (1.0, 100, 0.01, "rdp"),
    (2.0, 10, 0.5, "rdp"),
    (1.0, 50, 0.99, "rdp"),
])
def test_calibration_equals_dp_accounting_calibration(epsilon, steps, q, accountant):
    """The same sigma as dp_accounting's `calibrate_dp_mechanism` on its own, never above the
    target, and tight."""
    delta = 1e-5
    sigma = accounting.calibrate_noise_multiplier(epsilon, delta, steps=steps,
                                                  sampling_probability=q, accountant=accountant)
    reference = _dp_accounting_sigma(epsilon, delta, steps, q, accountant)
    assert sigma == pytest.approx(reference, rel=5e-5)
    spent = accounting.DpPlan(sigma, steps, q).epsilon(delta, accountant)
    assert spent <= epsilon
    assert accounting.DpPlan(sigma * (1 - 1e-4), steps, q).epsilon(delta, accountant) > epsilon


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrated_plan_meets_the_budget_tightly_and_keeps_its_clip_norm(accountant):
    epsilon, delta, steps, q, clip = 2.0, 1e-5, 300, 0.01, 0.5
    plan = accounting.calibrate_plan(epsilon, delta, steps=steps, sampling_probability=q,
                                     clip_norm=clip, accountant=accountant)
    assert (plan.steps, plan.sampling_probability, plan.clip_norm) == (steps, q, clip)
    # Met, and tight: 1% less noise would overspend.
    spent = accounting.DpPlan(plan.noise_multiplier, steps, q).epsilon(delta, accountant)
    assert spent <= epsilon
    assert accounting.DpPlan(plan.noise_multiplier * 0.99, steps, q).epsilon(
        delta, accountant) > epsilon
    if accountant == "pld":  # dp_accounting called directly on the same mechanism
        acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), steps)
        assert acc.get_epsilon(delta) == pytest.approx(spent, rel=1e-3)
    # Without noise: epsilon inf, the clip norm kept.
    free = accounting.calibrate_plan(math.inf, delta, steps=steps, clip_norm=clip)
    assert (free.noise_multiplier, free.clip_norm) == (0.0, clip)



@pytest.mark.parametrize("low,high", [(0.2, 0.4), (2.0, 4.0)])
def test_calibration_widens_a_bracket_that_misses_the_target(monkeypatch, low, high):
    kwargs = {"steps": 100, "sampling_probability": 0.05, "accountant": "rdp"}
    sigma = accounting.calibrate_noise_multiplier(1.0, 1e-5, **kwargs)
    monkeypatch.setattr(accounting.calibration, "_bracket",
                        lambda *args: (low * sigma, high * sigma))
    assert accounting.calibrate_noise_multiplier(1.0, 1e-5, **kwargs) == pytest.approx(
        sigma, rel=1e-5)


def test_sampled_pld_targets_below_the_floor_are_refused_at_once():
    floor = accounting.calibration.MIN_SAMPLED_PLD_NOISE_MULTIPLIER
    # RDP at the floor already meets epsilon = 100: refused before any PLD evaluation.
    with pytest.raises(ValueError, match=f"epsilon=100 with q=0.5 .*below {floor:g}"):
        accounting.calibrate_noise_multiplier(100.0, 1e-5, sampling_probability=0.5)
    with pytest.raises(ValueError, match="above 1e\\+06"):
        accounting.calibrate_noise_multiplier(1e-9, 1e-5, steps=1000)
    with pytest.raises(ValueError, match="beyond what the accountants resolve"):
        accounting.calibrate_noise_multiplier(1e300, 1e-5, sampling_probability=0.5)


@pytest.mark.parametrize("call", [
    lambda: accounting.gdp_mu(-1.0, 1e-5),
    lambda: accounting.gaussian_noise_multiplier(float("nan"), 1e-5),
    lambda: accounting.calibrate_noise_multiplier(0.0, 1e-5),
])
def test_every_entry_point_checks_epsilon_the_same_way(call):
    with pytest.raises(ValueError, match=r"^epsilon must be > 0 \(or inf for non-private\), got"):
        call()


@pytest.mark.parametrize("call", [
    lambda: accounting.gdp_epsilon(1.0, 0.0),
    lambda: accounting.gdp_mu(1.0, 1.0),
    lambda: accounting.gaussian_noise_multiplier(1.0, 2.0),
    lambda: accounting.calibrate_noise_multiplier(1.0, -1e-5),
    lambda: accounting.compute_epsilon(accounting.DpPlan(1.0, 1).dp_event(), 0.0),
    lambda: accounting.DpPlan(1.0, 1).epsilon(1.0),
    lambda: accounting.PrivacyLedger().epsilon(0.0),
    lambda: accounting.PrivacyLedger().basic_composition(1.5),
])
def test_every_entry_point_checks_delta_the_same_way(call):
    with pytest.raises(ValueError, match=r"^delta must be in \(0, 1\), got"):
        call()


@pytest.mark.parametrize("call", [
    lambda: accounting.DpPlan(1.0, 0),
    lambda: accounting.DpPlan(1.0, 2.5),
    lambda: accounting.DpPlan(1.0, True),
    lambda: accounting.gaussian_noise_multiplier(1.0, 1e-5, steps=0),
    lambda: accounting.calibrate_noise_multiplier(1.0, 1e-5, steps=-3),
])
def test_every_entry_point_checks_steps_the_same_way(call):
    with pytest.raises(ValueError, match=r"^steps must be an integer >= 1, got"):
        call()
