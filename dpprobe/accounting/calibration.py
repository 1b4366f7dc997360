"""Noise calibration: the smallest noise multiplier whose `DpEvent` meets (epsilon, delta).

Full batch with the PLD accountant has a closed form: T composed Gaussians with noise multiplier
sigma are exactly (sqrt(T)/sigma)-GDP, so sigma = sqrt(T) * sigma_1(epsilon, delta) (Panda et
al. 2023, Cor. 2.2; dp_accounting's PLD composes Gaussians the same way). Every other case
(Poisson sampling, or the RDP accountant) inverts the accountant with dp_accounting's
`calibrate_dp_mechanism` (Brent's method, here in log(sigma)) on a bracket made from closed forms
and widened (by factors of 2) in the rare case it misses:
  * above: the full-batch sigma, which meets the target for any q <= 1 with PLD (Poisson
    sampling only amplifies privacy); RDP is looser, so its bracket ends at twice that;
  * below: the central-limit sigma of the subsampled Gaussian, solving
    q sqrt(T (e^{1/sigma^2} - 1)) = mu (Bu et al. 2020; Dong, Roth & Su 2019, Sec. 5), which in
    practice lies just below what the accountants need (close for large T); for RDP at q = 1,
    the exact full-batch sigma (RDP is an upper bound on the exact epsilon).
Evaluations cost most at small sigma (PLD), so the bracket never goes below the floor.

With PLD and Poisson sampling, each evaluation builds a discretized privacy loss distribution:
1-3 s near the answer at the accountant's value discretization (1e-4, dp_accounting's default,
which every epsilon dpprobe reports uses), and a search took 7-12 of them. So the search runs
on a coarser discretization first (1e-3: 7-15x faster; its epsilon within about 1e-5
relative of the default's where sigma is small and evaluations are dear, further off at small
epsilon and many steps: 9e-3 at epsilon 0.1, T = 1,000), then steps from that sigma onto the
accountant's own curve: Newton's with the coarse curve's slope, then secant steps on the
accountant's curve. Two or three evaluations at the default discretization instead of 7-12,
the same sigma within the search's tolerance (five jobs' calibrations: 9.2-21.5 -> 3.6-6.3 s,
2.3-3.6x; at epsilon 0.1, T = 1,000, where evaluations are cheap, 0.24 -> 0.56 s;
`benchmarks/calibration.py`). The answer is checked on the accountant's own curve
either way, and a search on that curve takes over if the steps do not settle.

References:
  Panda et al. 2023: https://arxiv.org/abs/2212.04486
  Dong, Roth & Su 2019, Gaussian Differential Privacy: https://arxiv.org/abs/1905.02383
  Bu, Dong, Long & Su 2020, Deep Learning with Gaussian Differential Privacy:
    https://arxiv.org/abs/1911.11607
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

from dpprobe.accounting.gaussian import gaussian_noise_multiplier
from dpprobe.accounting.plan import (
    ACCOUNTANTS,
    Accountant,
    DpPlan,
    event_epsilon,
    make_accountant,
)
from dpprobe.accounting.validation import check_delta, check_epsilon

__all__ = ["calibrate_noise_multiplier", "calibrate_plan", "check_tractable"]

# Tolerance of the searched log(sigma), i.e. relative precision of sigma (the closed form is exact).
_SEARCH_RTOL = 1e-6
# Range of noise multipliers a calibration may return. Above the top, the noise swamps any
# signal (and the target epsilon is below what the accountants resolve). Below the floor with
# Poisson sampling, dp_accounting's PLD grows without bound (seconds to minutes per evaluation
# and gigabytes of memory as sigma -> 0) for guarantees that mean little (epsilon in the tens
# or more): such targets are refused at once instead of hanging.
MAX_NOISE_MULTIPLIER = 1e6
MIN_SAMPLED_PLD_NOISE_MULTIPLIER = 0.3
# The smallest sigma an RDP search tries: a target met there is met by any sigma above it.
_MIN_RDP_NOISE_MULTIPLIER = 1e-4


def calibrate_noise_multiplier(
    epsilon: float,
    delta: float,
    *,
    steps: int = 1,
    sampling_probability: float = 1.0,
    accountant: Accountant = "pld",
) -> float:
    """Smallest noise multiplier such that T Gaussian steps are (epsilon, delta)-DP.

    Full batch with PLD is solved exactly; otherwise dp_accounting's `calibrate_dp_mechanism`
    inverts the accountant (see the module docstring). The returned sigma always satisfies
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
    if not full_batch_sigma <= MAX_NOISE_MULTIPLIER:
        raise ValueError(f"epsilon={epsilon:g} at delta={delta:g} needs a noise multiplier above "
                         f"{MAX_NOISE_MULTIPLIER:g} (noise swamps any signal); use a larger "
                         "epsilon")
    _check_met(epsilon, delta, steps, full_batch_sigma)
    if sampling_probability == 1.0 and accountant == "pld":
        return full_batch_sigma
    with _quiet_rdp_orders():
        if accountant == "pld":
            _refuse_below_floor(epsilon, delta, steps, sampling_probability)
            sigma = _search_pld(epsilon, delta, steps, sampling_probability, full_batch_sigma)
        else:
            sigma = _search(epsilon, delta, steps, sampling_probability, accountant,
                            full_batch_sigma)
        return _on_the_private_side(epsilon, delta, steps, sampling_probability, accountant,
                                    sigma)


def calibrate_plan(epsilon: float, delta: float, *, steps: int,
                   sampling_probability: float = 1.0, clip_norm: float = 1.0,
                   accountant: Accountant = "pld") -> DpPlan:
    """The `DpPlan` of a run calibrated to (epsilon, delta): the one way every job turns its
    budget into a plan (`calibrate_noise_multiplier`, then the plan that records it).

    Args:
      epsilon: target epsilon (> 0); `math.inf` gives a plan without noise (clipping kept).
      delta: target delta in (0, 1).
      steps: number of noisy steps T.
      sampling_probability: Poisson rate q in (0, 1]; 1 is full batch.
      clip_norm: per-example clip norm C (sets the noise's scale, not epsilon).
      accountant: "pld" (default) or "rdp".

    Returns:
      `DpPlan(sigma, steps, sampling_probability, clip_norm)` with the smallest sigma such that
      `plan.epsilon(delta, accountant) <= epsilon`.
    """
    sigma = calibrate_noise_multiplier(epsilon, delta, steps=steps,
                                       sampling_probability=sampling_probability,
                                       accountant=accountant)
    return DpPlan(sigma, steps, sampling_probability, clip_norm)


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
            "gigabytes (and the guarantee means little); use `accountant=rdp`")


def _check_met(epsilon, delta, steps, sigma) -> None:
    """Refuse a target the full-batch sigma does not meet (epsilon beyond floating point)."""
    reached = DpPlan(sigma, steps).epsilon(delta) if sigma > 0 else math.inf
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
        "gigabytes (and the guarantee means little); use a smaller epsilon, or `accountant=rdp`")


def _bracket(epsilon, delta, steps, q, accountant, full_batch_sigma) -> tuple[float, float]:
    """(low, high) estimates of the sigma the accountant needs, from closed forms (no accountant
    call): epsilon(low) > target >= epsilon(high) as a rule, which `_search` checks."""
    if accountant == "pld":
        high, floor = full_batch_sigma, MIN_SAMPLED_PLD_NOISE_MULTIPLIER
    else:
        high, floor = 2.0 * full_batch_sigma, _MIN_RDP_NOISE_MULTIPLIER
    if q == 1.0:
        return full_batch_sigma, high
    # Central-limit sigma: q sqrt(T (e^{1/sigma^2} - 1)) = mu, with mu = sqrt(T) / full sigma.
    mu = math.sqrt(steps) / full_batch_sigma
    clt = 1.0 / math.sqrt(math.log1p(mu * mu / (q * q * steps)))
    low = clt if clt < full_batch_sigma else q * full_batch_sigma
    return max(low, floor), high


def _search(epsilon, delta, steps, q, accountant, full_batch_sigma,
            event_epsilon=event_epsilon) -> float:
    """dp_accounting's calibration of sigma in log space, on `_bracket`; the bracket widens (by
    factors of 2, within the floor and `MAX_NOISE_MULTIPLIER`) while it misses the target.
    `event_epsilon(event, delta, accountant)` is the curve searched (`plan.event_epsilon`)."""
    import dp_accounting

    class CachedAccountant(dp_accounting.PrivacyAccountant):
        """Epsilon as `DpPlan.epsilon` computes it (dp_accounting's PLD or RDP accountant),
        cached: a point the search evaluates twice (brentq's bracket ends, its final check,
        ours) is computed once."""

        def __init__(self):
            super().__init__(dp_accounting.NeighboringRelation.REPLACE_SPECIAL)

        def _maybe_compose(self, event, count, do_compose):
            return None  # the ledger holds the event; `compute_epsilon` checks support

        def get_epsilon(self, target_delta):
            return event_epsilon(self.ledger, target_delta, accountant)

    def excess(sigma: float) -> float:
        return event_epsilon(DpPlan(sigma, steps, q).dp_event(), delta, accountant) - epsilon

    floor = MIN_SAMPLED_PLD_NOISE_MULTIPLIER if accountant == "pld" else _MIN_RDP_NOISE_MULTIPLIER
    low, high = _bracket(epsilon, delta, steps, q, accountant, full_batch_sigma)
    if low >= high:  # PLD: the full-batch sigma, an upper bound, is below the floor already
        raise _below_floor(epsilon, q, steps)
    while True:
        try:
            log_sigma = dp_accounting.calibrate_dp_mechanism(
                CachedAccountant,
                lambda log_sigma: DpPlan(math.exp(log_sigma), steps, q).dp_event(),
                epsilon, delta,
                dp_accounting.ExplicitBracketInterval(math.log(low), math.log(high)),
                tol=_SEARCH_RTOL)
            return math.exp(log_sigma)
        except ValueError:  # raised by brentq when [low, high] does not bracket the target
            if excess(high) > 0:
                low, high = high, 2.0 * high
                if high > MAX_NOISE_MULTIPLIER:
                    raise ValueError(f"no noise multiplier <= {MAX_NOISE_MULTIPLIER:g} reaches "
                                     f"epsilon={epsilon:g}") from None
            elif excess(low) <= 0:
                if low <= floor and accountant == "rdp":
                    return low  # met at the smallest sigma tried: any larger one meets it
                if low <= floor:
                    raise _below_floor(epsilon, q, steps) from None
                low, high = max(low / 2.0, floor), low
            else:
                raise


# The coarse PLD's value discretization (the accountant's own is dp_accounting's default, 1e-4).
_COARSE_PLD_DISCRETIZATION = 1e-3


@functools.lru_cache(maxsize=256)
def _coarse_pld_epsilon(event, delta: float, accountant: Accountant) -> float:
    """Epsilon of a Poisson-sampled Gaussian `event` on the coarse PLD (zero-out neighbours);
    `accountant` is "pld" (the signature of `plan.event_epsilon`)."""
    pld = make_accountant(accountant, pld_discretization=_COARSE_PLD_DISCRETIZATION)
    pld.compose(event)
    return float(pld.get_epsilon(delta))


def _search_pld(epsilon, delta, steps, q, full_batch_sigma) -> float:
    """PLD with Poisson sampling: `_search` on the coarse PLD, then steps onto the
    accountant's own curve (the module docstring): Newton's by the coarse curve's slope first,
    secant steps on the accountant's curve after; `_search` on that curve if they do not
    settle within a few steps."""
    coarse_sigma = _search(epsilon, delta, steps, q, "pld", full_batch_sigma,
                           _coarse_pld_epsilon)

    def coarse(sigma):
        return _coarse_pld_epsilon(DpPlan(sigma, steps, q).dp_event(), delta, "pld")

    def excess(sigma):
        return DpPlan(sigma, steps, q).epsilon(delta) - epsilon

    step = 1e-3 * coarse_sigma
    slope = (coarse(coarse_sigma + step) - coarse(coarse_sigma)) / step  # d epsilon / d sigma
    sigma, previous = coarse_sigma, None
    for _ in range(6):
        if not (slope < 0 and MIN_SAMPLED_PLD_NOISE_MULTIPLIER <= sigma <= full_batch_sigma):
            break  # not falling, or outside the bracket: the coarse curve misled
        here = excess(sigma)
        if previous is not None and abs(sigma - previous[0]) > 1e-5 * sigma:
            secant = (here - previous[1]) / (sigma - previous[0])
            slope = secant if secant < 0 else slope  # the accountant's own, where it falls
        newton = -here / slope  # the step to the root
        if here <= 0 and -newton <= _SEARCH_RTOL * sigma:
            return sigma  # met, and the root is within the tolerance below
        previous = sigma, here
        sigma += newton + 0.5 * _SEARCH_RTOL * sigma  # to just above the root
    return _search(epsilon, delta, steps, q, "pld", full_batch_sigma)


def _on_the_private_side(epsilon, delta, steps, q, accountant, sigma) -> float:
    """`sigma`, or the nearest above it whose epsilon is <= the target (dp_accounting's
    calibration already returns the private side of its tolerance: this checks the epsilon
    that the jobs report, `DpPlan.epsilon`)."""
    for _ in range(64):
        if DpPlan(sigma, steps, q).epsilon(delta, accountant) <= epsilon:
            return sigma
        sigma *= 1.0 + _SEARCH_RTOL
    raise RuntimeError(f"calibration of epsilon={epsilon:g} did not reach the target")
