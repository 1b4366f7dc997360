"""The privacy ledger and the linear-scaling search (Panda et al. 2023)."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp

from dpprobe import accounting
from dpprobe.probe import search


def _mixed_ledger():
    ledger = accounting.PrivacyLedger()
    ledger.record("a", accounting.DpPlan(8.0, 20), role="tuning")
    ledger.record("b", accounting.DpPlan(3.0, 1), role="tuning")
    ledger.record("c", accounting.DpPlan(1.2, 50, 0.05), role="final")
    return ledger


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_composition_equals_dp_accounting(accountant):
    ledger = _mixed_ledger()
    acc = (pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant())
    acc.compose(dp_accounting.GaussianDpEvent(8.0), 20)
    acc.compose(dp_accounting.GaussianDpEvent(3.0))
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.2)), 50)
    assert ledger.epsilon(1e-5, accountant) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert ledger.gdp_mu() is None  # a Poisson entry: no exact Gaussian DP


def test_a_one_entry_ledger_reuses_its_plans_epsilon(monkeypatch):
    """A ledger of one Poisson entry has that entry's epsilon, bit for bit, and does not build
    a second PLD of it (the job's calibration computed it; dp_accounting on the same event)."""
    plan = accounting.DpPlan(1.1, 40, 0.05)
    spent = plan.epsilon(1e-5)
    ledger = accounting.PrivacyLedger()
    ledger.record("run", plan)
    built = []
    monkeypatch.setattr(accounting.plan, "make_accountant", lambda *a: built.append(a))
    assert ledger.epsilon(1e-5) == spent and not built
    acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    acc.compose(dp_accounting.ComposedDpEvent([plan.dp_event()]))
    assert acc.get_epsilon(1e-5) == spent


def test_full_batch_ledger_gdp_closed_form_equals_pld():
    """Panda et al. Cor. 2.2: composition of full-batch runs is sqrt(sum T_i / sigma_i^2)-GDP."""
    ledger = accounting.PrivacyLedger()
    plans = [(20.0, 25), (11.0, 50), (6.0, 100), (4.0, 10)]
    for sigma, steps in plans:
        ledger.record(f"{sigma}", accounting.DpPlan(sigma, steps))
    mu = math.sqrt(sum(t / s**2 for s, t in plans))
    assert ledger.gdp_mu() == pytest.approx(mu, rel=1e-12)
    acc = pld.PLDAccountant()
    for sigma, steps in plans:
        acc.compose(dp_accounting.GaussianDpEvent(sigma), steps)
    assert ledger.gdp_epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5), abs=1e-3)
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5), abs=1e-3)
    # Basic composition is looser than the tight one.
    basic, total_delta = ledger.basic_composition(1e-5)
    assert total_delta == 1e-5 and basic > ledger.epsilon(1e-5)
    record = ledger.to_dict(1e-5)
    assert record["num_mechanisms"] == 4 and len(record["entries"]) == 4
    assert record["entries"][0]["dp_event"]["type"] == "SelfComposedDpEvent"


def test_budget_split_is_exact_and_rejects_impossible_splits():
    split = search.budget_split(1.0, 1e-5, 0.05, 0.1)
    mu = math.sqrt(split["mu0"] ** 2 + split["mu1"] ** 2 + split["mu_final"] ** 2)
    assert accounting.gdp_epsilon(mu, 1e-5) == pytest.approx(1.0, abs=1e-7)
    assert accounting.gdp_epsilon(mu, 1e-5) <= 1.0
    with pytest.raises(ValueError, match="lower them"):
        search.budget_split(1.0, 1e-5, 0.7, 0.8)
    with pytest.raises(ValueError, match="eps0 must be < eps1"):
        search.budget_split(1.0, 1e-5, 0.2, 0.1)


def test_fit_linear_scaling_is_the_line_through_two_points():
    alpha, b = search.fit_linear_scaling(0.1, 3.0, 0.3, 7.0)
    assert alpha == pytest.approx(20.0) and b == pytest.approx(1.0)


def test_extrapolations_of_two_points():
    """linear: the line; clipped: the line within the searched range; log: the power law
    through the two points in log-log space, its exponent clipped to [0, 1]."""
    args = (0.1, 3.0, 0.3, 7.0, 8.0)  # the line r = 20 epsilon + 1
    linear = search.extrapolate("linear", *args, (1.0, 100.0))
    assert linear["r_star"] == pytest.approx(161.0) and not linear["clipped"]
    clipped = search.extrapolate("clipped", *args, (1.0, 100.0))
    assert clipped["r_star"] == 100.0 and clipped["clipped"]
    assert search.extrapolate("clipped", *args, (1.0, 1e4))["r_star"] == pytest.approx(161.0)
    log = search.extrapolate("log", *args, (1.0, 100.0))
    k = math.log(7 / 3) / math.log(3)
    assert log["exponent"] == pytest.approx(k)
    assert log["r_star"] == pytest.approx(7.0 * (8.0 / 0.3) ** k)
    # Through the origin the power law is the line (k = 1); steeper than linear is clipped.
    assert search.extrapolate("log", 0.1, 2.0, 0.3, 6.0, 8.0, (1, 10))["r_star"] == (
        pytest.approx(160.0))
    assert search.extrapolate("log", 0.1, 1.0, 0.3, 6.0, 8.0, (1, 10))["exponent"] == 1.0
    assert search.extrapolate("log", 0.1, 6.0, 0.3, 2.0, 8.0, (1, 10))["r_star"] == 2.0
    # A falling line keeps stage 1's best r (then clipped to the range).
    falling = search.extrapolate("clipped", 0.1, 9.0, 0.3, 2.0, 8.0, (3.0, 10.0))
    assert falling["fallback"] == 2.0 and falling["r_star"] == 3.0
    with pytest.raises(ValueError, match="extrapolation must be one of"):
        search.extrapolate("cubic", *args, (1.0, 100.0))


def test_noiseless_oracle_recovers_a_planted_line():
    alpha, b = 400.0, 0.5  # with 801 trials a stage, per-trial epsilons are ~0.0023 and ~0.0048

    def oracle(stage, trials, plans):
        # The best r at a trial's epsilon is the planted line; read epsilon off the plan.
        scores = []
        for trial, plan in zip(trials, plans, strict=True):
            eps = accounting.gdp_epsilon(math.sqrt(plan.steps) / plan.noise_multiplier, 1e-5)
            scores.append(-abs(math.log(trial.r) - math.log(alpha * eps + b)))
        return np.array(scores)

    ledger = accounting.PrivacyLedger()
    line = search.search_line(
        oracle, epsilon=2.0, delta=1e-5, eps0=0.1, eps1=0.2, trials=801, r_range=(0.1, 100),
        steps_choices=(10, 20, 40), search="grid", clip_norm=1.0,
        rng=np.random.default_rng(0), ledger=ledger,
    )
    assert line["alpha"] == pytest.approx(alpha, rel=0.03)
    assert line["b"] == pytest.approx(b, abs=0.05)
    eps_final = line["budget"]["epsilon_final"]
    assert line["r_star"] == pytest.approx(alpha * eps_final + b, rel=0.03)
    assert len(ledger) == 2 * 801
    assert ledger.epsilon(1e-5) < 2.0
