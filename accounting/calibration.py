"""Noise calibration: the smallest noise multiplier whose `DpEvent` meets (epsilon, delta)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math

from accounting.gaussian import gaussian_noise_multiplier
from accounting.plan import ACCOUNTANTS, Accountant, DpPlan
from accounting.validation import check_delta, check_epsilon

__all__ = ["calibrate_noise_multiplier", "check_tractable"]

# Relative precision of the searched noise multiplier (the analytic path is exact).
_SEARCH_RTOL = 1e-6
# Range of noise multipliers a calibration may return. Above the top, the noise swamps any
# signal (and the target epsilon is below what the accountants resolve). Below the floor with
# Poisson sampling, dp_accounting's PLD grows without bound (seconds to minutes per evaluation
# and gigabytes of memory as sigma -> 0) for guarantees that mean little (epsilon in the tens
# or more): such targets are refused at once instead of hanging.
MAX_NOISE_MULTIPLIER = 1e6
MIN_SAMPLED_PLD_NOISE_MULTIPLIER = 0.3


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
    (Panda et al. 2023, Cor. 2.2, https://arxiv.org/abs/2212.04486; dp_accounting's PLD
    composes Gaussians the same way).
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
    epsilon, delta = check_epsilon(epsilon), check_delta(delta)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    DpPlan(1.0, steps, sampling_probability)  # validates steps and q
    if math.isinf(epsilon):
        return 0.0
    full_batch_sigma = gaussian_noise_multiplier(epsilon, delta, steps)
    # Full batch, T Gaussians are exactly (sqrt(T)/sigma)-GDP: this sigma is the answer for
    # PLD, and an upper bound on what any Poisson sampling (q < 1) needs.
    if not full_batch_sigma <= MAX_NOISE_MULTIPLIER:
        raise ValueError(f"epsilon={epsilon:g} at delta={delta:g} needs a noise multiplier above "
                         f"{MAX_NOISE_MULTIPLIER:g} (noise swamps any signal); use a larger "
                         "epsilon")
    _check_met(epsilon, delta, steps, 1.0, "pld", full_batch_sigma)
    if sampling_probability == 1.0 and accountant == "pld":
        return full_batch_sigma
    with _quiet_rdp_orders():
        if accountant == "pld" and sampling_probability < 1.0:
            _refuse_below_floor(epsilon, delta, steps, sampling_probability)
        return _search(epsilon, delta, steps, sampling_probability, accountant,
                       full_batch_sigma)


@contextlib.contextmanager
def _quiet_rdp_orders():
    """Silence dp_accounting's per-order RDP warnings ("failed to converge ... Excluding this
    order"): the order is excluded, the bound stays valid, and a search would print dozens."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_tractable(noise_multiplier: float, sampling_probability: float,
                    accountant: Accountant) -> None:
    """Refuse an epsilon computation the PLD accountant cannot finish in seconds: Poisson
    sampling with a noise multiplier below `MIN_SAMPLED_PLD_NOISE_MULTIPLIER`."""
    if (accountant == "pld" and sampling_probability < 1.0
            and 0 < noise_multiplier < MIN_SAMPLED_PLD_NOISE_MULTIPLIER):
        raise ValueError(
            f"noise multiplier {noise_multiplier:g} with q={sampling_probability:g} is below "
            f"{MIN_SAMPLED_PLD_NOISE_MULTIPLIER:g}, where the PLD accountant takes minutes and "
            "gigabytes (and the guarantee means little); use --accountant rdp")


def _check_met(epsilon, delta, steps, q, accountant, sigma) -> None:
    """Refuse a target the returned sigma does not meet (epsilon beyond floating point)."""
    reached = DpPlan(sigma, steps, q).epsilon(delta, accountant) if sigma > 0 else math.inf
    if not reached <= epsilon * (1 + 1e-9):
        raise ValueError(f"epsilon={epsilon:g} at delta={delta:g} is beyond what the accountants "
                         f"resolve (the closest noise multiplier, {sigma:.3g}, gives "
                         f"epsilon {reached:.3g}); use an epsilon between 1e-3 and 1e3, or inf "
                         "for the non-private reference")


def _refuse_below_floor(epsilon, delta, steps, q) -> None:
    """Refuse at once a Poisson-sampled PLD target that needs sigma below the floor: RDP's
    epsilon at the floor bounds PLD's from above, so a target above it is out of reach."""
    if epsilon > DpPlan(MIN_SAMPLED_PLD_NOISE_MULTIPLIER, steps, q).epsilon(delta, "rdp"):
        raise _below_floor(epsilon, q, steps)


def _below_floor(epsilon, q, steps) -> ValueError:
    return ValueError(
        f"epsilon={epsilon:g} with q={q:g} and {steps} step(s) needs a noise multiplier below "
        f"{MIN_SAMPLED_PLD_NOISE_MULTIPLIER:g}, where the PLD accountant takes minutes and "
        "gigabytes (and the guarantee means little); use a smaller epsilon, or --accountant rdp")


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
    floor = MIN_SAMPLED_PLD_NOISE_MULTIPLIER if accountant == "pld" and q < 1.0 else 1e-4
    lo = hi = max(lo, math.log(floor))
    while excess(hi) > 0:
        lo, hi = hi, hi + step
        if hi > math.log(MAX_NOISE_MULTIPLIER):
            raise ValueError(f"no noise multiplier <= {MAX_NOISE_MULTIPLIER:g} reaches "
                             f"epsilon={epsilon:g}")
    while excess(lo) <= 0:
        hi, lo = lo, lo - step
        if lo < math.log(floor):
            if floor == 1e-4:
                return math.exp(hi)
            raise _below_floor(epsilon, q, steps)
    root = optimize.brentq(excess, lo, hi, xtol=_SEARCH_RTOL, rtol=_SEARCH_RTOL)
    # Return a point on the private side of the root.
    for candidate in (root, root + _SEARCH_RTOL, root + 10 * _SEARCH_RTOL, hi):
        if excess(candidate) <= 0:
            return math.exp(candidate)
    return math.exp(hi)
