"""dp_accounting's PLD accountant, with the Poisson-subsampled Gaussian's grid computed in one
vectorized pass.

Why it is hand-written: building the privacy loss distribution of a Poisson-subsampled
Gaussian (`PLD.from_gaussian_mechanism` with `sampling_prob` < 1, the "connect the dots"
construction) evaluates the mechanism's hockey-stick divergence at every point of a grid of
privacy losses, 10^5-3 x 10^5 points at the default discretization 1e-4, and dp_accounting
0.6.0 inverts the privacy loss one point at a time in Python
(`AdditiveNoisePrivacyLoss.get_delta_for_epsilon`): 0.5-1.4 s per distribution, 90% of its
construction. A job with Poisson sampling builds several while it calibrates its noise
(`accounting.calibration`) and one more for every epsilon it reports. No library offers the
vectorized form (dp_accounting's mixture-of-Gaussians loss, which is vectorized, took
20 s per distribution).

What changes: only how the grid's inverse privacy losses are computed. Here they are the same
formulas as dp_accounting's scalar `_inverse_privacy_loss_add` / `_remove` for the Gaussian,
the same operations in the same order on float64 arrays. Everything else is dp_accounting's
own code: `_create_pld_pmf_from_monotone_privacy_loss` (the connect-the-dots discretization,
pessimistic), `_pld_for_subsampled_mechanism` (the remove and add distributions),
`self_compose`, `compose` and `get_epsilon_for_delta`. Every other event (full-batch
Gaussians, q = 1, other relations) goes to dp_accounting's `PLDAccountant` unchanged.

Bit for bit, where it runs: the basic operations are correctly rounded on arrays as on
scalars, and `exp` / `log1p`, which dp_accounting calls on NumPy scalars, are the same
NumPy ufuncs here on arrays. NumPy builds whose array loop is their own SIMD code and whose
scalar path is C's libm could differ in the last bit, so the vectorized path runs only where
(1) `exp` and `log1p` give an array of 2,048 test arguments the bits they give each argument
alone (checked once per process) and (2) each grid's vectorized inversion equals
dp_accounting's scalar one at 65 points spread over it; elsewhere dp_accounting's own path
builds the distribution.
`tests/accounting/test_sampled_pld.py` compares every probability, lower loss and infinity
mass with dp_accounting's over sigma, q and discretizations (the edge branch included), and
the epsilons of composed events under each relation. So the accountant's guarantee is
dp_accounting's: the same pessimistic PLD for the same zero-out neighbouring relation.

The private dp_accounting functions it calls are pinned by the project's
`dp-accounting==0.6.0`; a release that changed them would fail those tests or the spot check.
"""

from __future__ import annotations

import functools
import math
import numbers

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism

__all__ = ["SampledGaussianPLDAccountant", "sampled_gaussian_pld"]

_ADD = privacy_loss_mechanism.AdjacencyType.ADD
_REMOVE = privacy_loss_mechanism.AdjacencyType.REMOVE
# dp_accounting's `math.isclose` default, the tolerance of its edge test.
_ISCLOSE_RTOL = 1e-9
# Grid points whose vectorized inversion is compared with dp_accounting's scalar one.
_SPOT_CHECKS = 65


def _log_a_times_exp_b_plus_c(a: float, b: np.ndarray, c: float, skip: np.ndarray
                              ) -> np.ndarray:
    """dp_accounting's `common.log_a_times_exp_b_plus_c` (log(a e^b + c)) for a > 0 > c,
    elementwise over `b`, its operations in its order; it raises where dp_accounting's
    raises, except at the entries `skip` (which its caller never computes)."""
    d = b + np.log(a)
    log_minus_c = np.log(-c)
    if np.any(~skip & (b != 0) & (log_minus_c >= d)):
        raise ValueError(f"a exp(b) + c must be positive: a={a}, c={c}")
    with np.errstate(invalid="ignore", divide="ignore"):
        log_sub = d + np.log1p(-np.exp(log_minus_c - d))
    return np.where(b == 0, np.log(a + c), log_sub)


@functools.cache
def _array_ufuncs_match_scalar_ones() -> bool:
    """Whether NumPy's float64 `exp` and `log1p` give an array the bits they give each of its
    elements alone (dp_accounting calls them on scalars), on 2,048 arguments each spanning
    the ranges the inversion uses (10 ms, once per process). They do where both take the same
    loop (C's libm on this project's machines); a NumPy build whose array loop is its own SIMD
    code and whose scalar path is libm could differ in the last bit, and there
    dp_accounting's path runs."""
    rng = np.random.default_rng(0)  # public test points, no data
    exp_args = np.concatenate([-np.exp(rng.uniform(-40, np.log(745), 2000)),
                               np.linspace(-1e-12, 0, 48)])
    log1p_args = -np.exp(exp_args)
    with np.errstate(divide="ignore"):  # log1p(-1) = -inf, on both paths
        pairs = [(np.exp, exp_args), (np.log1p, log1p_args)]
        return all(_same_float(element, ufunc(x))
                   for ufunc, args in pairs
                   for element, x in zip(ufunc(args), args, strict=True))


def _same_float(a, b) -> bool:
    """Equal bits (NaNs equal)."""
    return np.float64(a).tobytes() == np.float64(b).tobytes()


def _isclose(values: np.ndarray, edge: float) -> np.ndarray:
    """`math.isclose(value, edge)` elementwise, for a finite `edge`."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(values) & (np.abs(values - edge)
                                      <= _ISCLOSE_RTOL * np.maximum(np.abs(values), abs(edge)))


class _GaussianPrivacyLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp_accounting's Gaussian privacy loss; ADD and REMOVE with q < 1 invert the privacy
    loss over a whole grid at once (the module docstring)."""

    def _inverse_privacy_losses(self, losses: np.ndarray) -> np.ndarray:
        q, sensitivity, std = self.sampling_prob, self.sensitivity, self._standard_deviation
        if self.adjacency_type == _ADD:
            edge = -math.log(1 - q)
            at_edge = _isclose(losses, edge)
            if np.any(~at_edge & (losses > edge)):
                raise ValueError(f"privacy loss above -log(1 - sampling_prob) ({edge})")
            without = -_log_a_times_exp_b_plus_c(1 / q, -losses, 1 - 1 / q, at_edge)
            inverse = sensitivity + (-0.5 * sensitivity - without * (std**2) / sensitivity)
            return np.where(at_edge, -np.inf, inverse)
        edge = math.log(1 - q)
        at_edge = _isclose(losses, edge)
        if np.any(~at_edge & (losses <= edge)):
            raise ValueError(f"privacy loss at or below log(1 - sampling_prob) ({edge})")
        without = _log_a_times_exp_b_plus_c(1 / q, losses, 1 - 1 / q, at_edge)
        inverse = -0.5 * sensitivity - without * (std**2) / sensitivity
        return np.where(at_edge, np.inf, inverse)

    def _inverse_agrees(self, losses: np.ndarray, inverse: np.ndarray) -> bool:
        """Whether the vectorized inversion equals dp_accounting's scalar one at
        `_SPOT_CHECKS` points spread over the grid."""
        picks = np.unique(np.linspace(0, len(losses) - 1, _SPOT_CHECKS).round().astype(int))
        return len(losses) == 0 or all(
            _same_float(inverse[i], self.inverse_privacy_loss(losses[i])) for i in picks)

    def get_delta_for_epsilon(self, epsilon):
        """dp_accounting's `AdditiveNoisePrivacyLoss.get_delta_for_epsilon`, with the inverse
        privacy losses of the grid computed at once; dp_accounting's own where NumPy's
        array and scalar float64 `exp` / `log1p` differ here, or where a spot check of the
        grid's inversion against dp_accounting's scalar one differs."""
        if (self.sampling_prob == 1.0 or self.adjacency_type not in (_ADD, _REMOVE)
                or not _array_ufuncs_match_scalar_ones()):
            return super().get_delta_for_epsilon(epsilon)
        is_scalar = isinstance(epsilon, numbers.Number)
        epsilons = np.array([epsilon]) if is_scalar else np.asarray(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.adjacency_type == _ADD:
            inverse_indices = epsilons < -math.log1p(-self.sampling_prob)
        else:
            inverse_indices = epsilons > math.log1p(-self.sampling_prob)
            others = np.logical_not(inverse_indices)
            deltas[others] = -np.expm1(epsilons[others])
        x_cutoffs = self._inverse_privacy_losses(epsilons[inverse_indices])
        if not self._inverse_agrees(epsilons[inverse_indices], x_cutoffs):
            return super().get_delta_for_epsilon(epsilon)
        deltas[inverse_indices] = (
            self.mu_upper_cdf(x_cutoffs)
            - np.exp(epsilons[inverse_indices] + self.mu_lower_log_cdf(x_cutoffs)))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas


def sampled_gaussian_pld(noise_multiplier: float, sampling_probability: float,
                         value_discretization_interval: float = 1e-4
                         ) -> privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD `PLD.from_gaussian_mechanism(noise_multiplier, sampling_prob=q,
    value_discretization_interval=...)` builds for add/remove and zero-out neighbours
    (sensitivity 1, pessimistic, connect the dots), bit for bit, faster where the module's
    checks hold, else by dp_accounting's own path (module docstring).

    Args:
      noise_multiplier: the Gaussian's std over the sensitivity (> 0).
      sampling_probability: the Poisson rate q in (0, 1].
      value_discretization_interval: the PLD's discretization of privacy losses.

    Returns:
      dp_accounting's `PrivacyLossDistribution` (remove and add distributions when q < 1).
    """
    def single(adjacency_type):
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            _GaussianPrivacyLoss(noise_multiplier, sensitivity=1, pessimistic_estimate=True,
                                 log_mass_truncation_bound=-50,
                                 sampling_prob=sampling_probability,
                                 adjacency_type=adjacency_type),
            pessimistic_estimate=True,
            value_discretization_interval=value_discretization_interval,
            use_connect_dots=True)

    return privacy_loss_distribution._pld_for_subsampled_mechanism(single,
                                                                   sampling_probability)


class SampledGaussianPLDAccountant(dp_accounting.pld.PLDAccountant):
    """dp_accounting's `PLDAccountant`; a Poisson-subsampled Gaussian (0 < q < 1) is composed
    from `sampled_gaussian_pld` (the same distribution, built faster), every other event by
    dp_accounting itself."""

    def _maybe_compose(self, event, count, do_compose):
        if (do_compose and isinstance(event, dp_accounting.PoissonSampledDpEvent)
                and isinstance(event.event, dp_accounting.GaussianDpEvent)
                and 0 < event.sampling_probability < 1 and event.event.noise_multiplier > 0
                and self.neighboring_relation in (
                    dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                    dp_accounting.NeighboringRelation.REPLACE_SPECIAL)):
            pld = sampled_gaussian_pld(event.event.noise_multiplier, event.sampling_probability,
                                       self._value_discretization_interval)
            self._pld = self._pld.compose(pld.self_compose(count))
            return None
        return super()._maybe_compose(event, count, do_compose)
