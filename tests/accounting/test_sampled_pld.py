"""The vectorized Poisson-subsampled Gaussian PLD against dp_accounting's own, bit for bit."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld
from dp_accounting.pld import privacy_loss_mechanism as plm

from dpprobe import accounting
from dpprobe.accounting import sampled_pld

RELATIONS = dp_accounting.NeighboringRelation


def _assert_same_pmf(ours, theirs):
    """Every field of dp_accounting's dense or sparse PMF equal: discretization, infinity
    mass, lower loss and probabilities, or the sparse one's {loss: probability}."""
    assert type(ours) is type(theirs)
    mine, reference = vars(ours), vars(theirs)
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == mine[name].dtype and np.array_equal(value, mine[name]), name
        else:
            assert value == mine[name], name


# (sigma, q, discretization): dp_accounting's default grid and the calibration's coarse one,
# q from 1e-6 to 0.999, sigma from the calibration's floor (0.3) to 20; dense PMFs of up to
# 10^5 points and sparse ones (sigma 5, q 1e-4).
# The last case puts grid points on the edge log(1 - q) (dp_accounting's `isclose` branch).
CASES = [(1.1, 0.05, 1e-4), (0.53, 1e-3, 1e-4), (0.3, 0.9, 1e-3), (5.0, 1e-4, 1e-4),
         (0.8, 0.999, 1e-4), (20.0, 0.5, 3e-4), (1.0, 1e-6, 1e-4), (0.7, 0.2, 1e-3),
         (0.3, 1 - math.exp(-0.02), 1e-2)]


@pytest.mark.parametrize("sigma,q,discretization", CASES)
def test_the_distribution_is_dp_accountings_bit_for_bit(sigma, q, discretization):
    ours = sampled_pld.sampled_gaussian_pld(sigma, q, discretization)
    theirs = pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, sampling_prob=q,
        value_discretization_interval=discretization,
        neighboring_relation=RELATIONS.REPLACE_SPECIAL)
    _assert_same_pmf(ours._pmf_remove, theirs._pmf_remove)
    _assert_same_pmf(ours._pmf_add, theirs._pmf_add)
    assert ours._pmf_remove.size > 5  # a real grid (9 points at sigma 5, q 1e-4: sparse)
    for delta in (1e-3, 1e-5, 1e-9):
        assert ours.get_epsilon_for_delta(delta) == theirs.get_epsilon_for_delta(delta)


@pytest.mark.parametrize("adjacency", [plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE])
@pytest.mark.parametrize("q", [1e-12, 1e-5, 0.03, 0.5, 0.97])
def test_the_grid_inversion_is_dp_accountings_point_by_point(adjacency, q):
    """Every inverse privacy loss equals dp_accounting's scalar one, at random losses, at
    the edge log(1 - q) where the scalar code takes its `isclose` branch, and one float
    either side of it; a loss past the edge raises as the scalar code does."""
    ours = sampled_pld._GaussianPrivacyLoss(0.9, sampling_prob=q, adjacency_type=adjacency)
    theirs = plm.GaussianPrivacyLoss(0.9, sampling_prob=q, adjacency_type=adjacency)
    edge = -math.log(1 - q) if adjacency == plm.AdjacencyType.ADD else math.log(1 - q)
    inside = -np.inf if adjacency == plm.AdjacencyType.ADD else np.inf
    rng = np.random.default_rng(0)
    losses = np.concatenate([
        edge + np.sign(inside) * np.exp(rng.uniform(-30, 3, 2000)),
        [edge, np.nextafter(edge, inside), edge * (1 + 5e-10), 0.0, -0.0],
    ])
    valid = np.array([_scalar_ok(theirs, x) for x in losses])
    expected = np.array([theirs.inverse_privacy_loss(x) for x in losses[valid]])
    got = ours._inverse_privacy_losses(losses[valid])
    assert np.array_equal(got, expected)
    assert valid.sum() > 2000 and np.isinf(expected).any()  # the edge branch was taken
    beyond = np.nextafter(edge, -inside) * (1 + 1e-8)  # past the edge, not close to it
    with pytest.raises(ValueError):
        theirs.inverse_privacy_loss(beyond)
    with pytest.raises(ValueError):
        ours._inverse_privacy_losses(np.array([0.0, beyond]))


def _scalar_ok(loss, x) -> bool:
    try:
        loss.inverse_privacy_loss(x)
    except ValueError:
        return False
    return True


def _events(q, sigma):
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    sampled = dp_accounting.PoissonSampledDpEvent(q, gaussian)
    return [
        sampled,
        dp_accounting.SelfComposedDpEvent(sampled, 30),
        dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(sampled, 7),
                                       dp_accounting.GaussianDpEvent(2 * sigma),
                                       dp_accounting.PoissonSampledDpEvent(1.0, gaussian),
                                       dp_accounting.NoOpDpEvent(),
                                       dp_accounting.PoissonSampledDpEvent(0.0, gaussian)]),
    ]


@pytest.mark.parametrize("relation", [RELATIONS.REPLACE_SPECIAL, RELATIONS.ADD_OR_REMOVE_ONE,
                                      RELATIONS.REPLACE_ONE])
def test_the_accountant_composes_every_event_as_dp_accountings(relation):
    """Sampled, self-composed, composed with full-batch Gaussians, no-ops and q = 0; the
    replace-one relation (dp_accounting's path throughout): the same epsilons and deltas."""
    for event in _events(0.04, 0.8):
        ours = sampled_pld.SampledGaussianPLDAccountant(relation,
                                                        value_discretization_interval=1e-3)
        theirs = pld.PLDAccountant(relation, value_discretization_interval=1e-3)
        ours.compose(event)
        theirs.compose(event, 1)
        for delta in (1e-5, 1e-8):
            assert ours.get_epsilon(delta) == theirs.get_epsilon(delta)
        assert ours.get_delta(1.0) == theirs.get_delta(1.0)


def test_a_non_private_sampled_event_stays_infinite():
    event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(0.0))
    acc = sampled_pld.SampledGaussianPLDAccountant(RELATIONS.REPLACE_SPECIAL)
    acc.compose(event)
    assert acc.get_epsilon(1e-5) == math.inf


def _count_scalar_grids(monkeypatch) -> list:
    """Counts dp_accounting's own (scalar) grid inversions from now on."""
    calls = []
    scalar = plm.AdditiveNoisePrivacyLoss.get_delta_for_epsilon

    def counted(self, epsilon):
        calls.append(np.size(epsilon))
        return scalar(self, epsilon)

    monkeypatch.setattr(plm.AdditiveNoisePrivacyLoss, "get_delta_for_epsilon", counted)
    return calls


def test_every_reported_epsilon_takes_the_vectorized_path(monkeypatch):
    calls = _count_scalar_grids(monkeypatch)
    assert isinstance(accounting.make_accountant("pld"), sampled_pld.SampledGaussianPLDAccountant)
    plan = accounting.DpPlan(0.9, 20, 0.05)
    ours = accounting.compute_epsilon(plan.dp_event(), 1e-5)
    assert calls == []  # no grid went through dp_accounting's scalar inversion
    acc = pld.PLDAccountant(RELATIONS.REPLACE_SPECIAL)
    acc.compose(plan.dp_event())
    assert ours == acc.get_epsilon(1e-5)
    assert max(calls) > 1000  # the reference did: the counter sees grids


def test_where_arrays_and_scalars_could_differ_dp_accountings_path_runs(monkeypatch):
    """A NumPy whose array exp/log1p differ from its scalar ones, or a grid whose spot
    check differs from dp_accounting's scalar inversion: dp_accounting's path, the same PLD."""
    reference = pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=0.9, sampling_prob=0.05, value_discretization_interval=1e-3,
        neighboring_relation=RELATIONS.REPLACE_SPECIAL)
    calls = _count_scalar_grids(monkeypatch)
    monkeypatch.setattr(sampled_pld, "_array_ufuncs_match_scalar_ones", lambda: False)
    _assert_same_pmf(sampled_pld.sampled_gaussian_pld(0.9, 0.05, 1e-3)._pmf_add,
                     reference._pmf_add)
    assert calls and max(calls) > 100
    monkeypatch.undo()
    calls = _count_scalar_grids(monkeypatch)
    vectorized = sampled_pld._GaussianPrivacyLoss._inverse_privacy_losses
    monkeypatch.setattr(sampled_pld._GaussianPrivacyLoss, "_inverse_privacy_losses",
                        lambda self, losses: np.nextafter(vectorized(self, losses), np.inf))
    _assert_same_pmf(sampled_pld.sampled_gaussian_pld(0.9, 0.05, 1e-3)._pmf_remove,
                     reference._pmf_remove)
    assert calls and max(calls) > 100


def test_on_this_machine_numpys_arrays_and_scalars_agree():
    """Where this project runs (its CI, its machines) the vectorized path is the one taken:
    else the speed measured in `docs/performance.md` would be dp_accounting's."""
    assert sampled_pld._array_ufuncs_match_scalar_ones()
