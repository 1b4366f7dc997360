"""Noise calibration: the smallest noise multiplier whose `DpEvent` meets (epsilon, delta)."""

from __future__ import annotations

import functools
import math

from accounting.gaussian import gaussian_noise_multiplier
from accounting.plan import ACCOUNTANTS, Accountant, DpPlan

__all__ = ["calibrate_noise_multiplier"]

# Relative precision of the searched noise multiplier (the analytic path is exact).
_SEARCH_RTOL = 1e-6


def calibrate_noise_multiplier(
    epsilon: float,
    delta: float,
    *,
    steps: int = 1,
    sampling_probability: float = 1.0,
    accountant: Accountant = "pld",
) -> float:
    """Smallest noise multiplier such that T Gaussian steps are (epsilon, delta)-DP.

    Full batch with the PLD accountant is solved exactly: T composed Gaussians with noise
    multiplier sigma are (sqrt(T)/sigma)-GDP, so sigma = sqrt(T) * sigma_1(epsilon, delta)
    (Panda et al. 2023, Cor. 2.2; dp_accounting's PLD composes Gaussians the same way).
    Otherwise (Poisson sampling, or RDP) the accountant itself is inverted by a root search in
    log(sigma), started from a tight guess; the returned sigma always satisfies
    `DpPlan(sigma, steps, q).epsilon(delta, accountant) <= epsilon`.

    Args:
      epsilon: target epsilon (> 0); `math.inf` returns 0 (non-private).
      delta: target delta in (0, 1).
      steps: number of noisy steps T.
      sampling_probability: Poisson rate q in (0, 1]; 1 is full batch.
      accountant: "pld" (default) or "rdp".

    Returns:
      The noise multiplier sigma (noise std / clip norm).
    """
    if math.isnan(epsilon) or not epsilon > 0:
        raise ValueError(f"epsilon must be > 0 (or inf for non-private), got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    DpPlan(1.0, steps, sampling_probability)  # validates steps and q
    if math.isinf(epsilon):
        return 0.0
    full_batch_sigma = gaussian_noise_multiplier(epsilon, delta, steps)
    if sampling_probability == 1.0 and accountant == "pld":
        return full_batch_sigma
    return _search(epsilon, delta, steps, sampling_probability, accountant, full_batch_sigma)


def _search(epsilon, delta, steps, q, accountant, full_batch_sigma) -> float:
    """Invert the accountant's epsilon(sigma) (decreasing in sigma) by Brent's method."""
    from scipy import optimize

    @functools.cache
    def excess(log_sigma: float) -> float:
        sigma = math.exp(log_sigma)
        return DpPlan(sigma, steps, q).epsilon(delta, accountant) - epsilon

    # For small q the central limit theorem gives sigma ~ q * sqrt(T) / mu; start there.
    guess = full_batch_sigma if q == 1.0 else max(q * full_batch_sigma, 0.3)
    lo = hi = math.log(guess)
    step = math.log(1.5)
    while excess(hi) > 0:
        lo, hi = hi, hi + step
        if hi > math.log(1e6):
            raise ValueError(f"no noise multiplier <= 1e6 reaches epsilon={epsilon}")
    while excess(lo) <= 0:
        hi, lo = lo, lo - step
        if lo < math.log(1e-4):
            return math.exp(hi)
    root = optimize.brentq(excess, lo, hi, xtol=_SEARCH_RTOL, rtol=_SEARCH_RTOL)
    # Return a point on the private side of the root.
    for candidate in (root, root + _SEARCH_RTOL, root + 10 * _SEARCH_RTOL, hi):
        if excess(candidate) <= 0:
            return math.exp(candidate)
    return math.exp(hi)
