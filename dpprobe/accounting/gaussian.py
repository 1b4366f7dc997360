"""Exact (epsilon, delta) curves of the Gaussian mechanism, through Gaussian DP.

A Gaussian mechanism with sensitivity 1 and noise std sigma is mu-GDP with mu = 1/sigma
(Dong, Roth & Su 2019). Composing T of them (full batch, no subsampling) is exactly
mu = sqrt(sum_i T_i / sigma_i^2)-GDP (Panda et al. 2023, Prop. 2.1), and a mu-GDP
mechanism is (epsilon, delta(epsilon))-DP for every epsilon with

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - exp(epsilon) * Phi(-epsilon/mu - mu/2)

(Balle & Wang 2018, Thm. 8; Panda et al. Cor. 2.2). These are closed forms, not bounds.

References:
  Dong, Roth & Su 2019, Gaussian Differential Privacy: https://arxiv.org/abs/1905.02383
  Balle & Wang 2018, Improving the Gaussian Mechanism for Differential Privacy:
    https://arxiv.org/abs/1805.06530
  Panda et al. 2023, A New Linear Scaling Rule for Private Adaptive Hyperparameter
    Optimization: https://arxiv.org/abs/2212.04486
"""

from __future__ import annotations

import math

from dpprobe.accounting.validation import check_delta, check_epsilon, check_steps

__all__ = ["gdp_delta", "gdp_epsilon", "gdp_mu", "gaussian_noise_multiplier"]


def _log_ndtr(x: float) -> float:
    """log Phi(x), accurate in both tails (pure Python: no SciPy import at start-up)."""
    if x > 0.0:
        return math.log1p(-0.5 * math.erfc(x / math.sqrt(2.0)))
    if x > -30.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    # Asymptotic series of the Mills ratio; relative error < 1e-20 for x <= -30.
    inv2 = 1.0 / (x * x)
    series = 1.0 - inv2 + 3.0 * inv2**2 - 15.0 * inv2**3 + 105.0 * inv2**4
    return -0.5 * x * x - math.log(-x) - 0.5 * math.log(2.0 * math.pi) + math.log(series)


def _bisect(f, lo: float, hi: float, iterations: int = 200, tol: float = 1e-15) -> float:
    """Root of a monotone f on [lo, hi] (f(lo), f(hi) of opposite signs) by bisection."""
    f_lo = f(lo)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        f_mid = f(mid)
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
        if hi - lo <= tol * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def _log_delta(epsilon: float, mu: float) -> float:
    """log delta(epsilon) of mu-GDP, computed stably (no cancellation for small delta)."""
    if mu == 0.0:
        return -math.inf
    if math.isinf(mu):
        return 0.0
    log_a = _log_ndtr(-epsilon / mu + mu / 2.0)
    log_b = epsilon + _log_ndtr(-epsilon / mu - mu / 2.0)
    if log_b >= log_a:  # Mathematically delta > 0; only rounding can get here.
        return -math.inf
    return log_a + math.log1p(-math.exp(log_b - log_a))


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta such that a mu-GDP mechanism is (epsilon, delta)-DP (exact, tight)."""
    epsilon = check_epsilon(epsilon, allow_zero=True)
    if mu < 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    return math.exp(_log_delta(epsilon, mu))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon such that a mu-GDP mechanism is (epsilon, delta)-DP."""
    delta = check_delta(delta)
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    log_target = math.log(delta)
    if _log_delta(0.0, mu) <= log_target:
        return 0.0
    hi = 1.0
    while _log_delta(hi, mu) > log_target:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return _bisect(lambda e: _log_delta(e, mu) - log_target, 0.0, hi)


def gdp_mu(epsilon: float, delta: float) -> float:
    """Largest mu such that mu-GDP implies (epsilon, delta)-DP."""
    epsilon, delta = check_epsilon(epsilon), check_delta(delta)
    if math.isinf(epsilon):
        return math.inf
    log_target = math.log(delta)
    # delta(epsilon; mu) increases with mu: bracket on a log scale, then solve in log(mu).
    lo, hi = 1e-3, 1.0
    while _log_delta(epsilon, hi) < log_target:
        lo, hi = hi, hi * 2.0
    while _log_delta(epsilon, lo) > log_target:
        lo, hi = lo / 2.0, lo
    log_mu = _bisect(
        lambda lm: _log_delta(epsilon, math.exp(lm)) - log_target, math.log(lo), math.log(hi)
    )
    return math.exp(log_mu)


def gaussian_noise_multiplier(epsilon: float, delta: float, steps: int = 1) -> float:
    """Noise multiplier of T full-batch Gaussian steps that is exactly (epsilon, delta)-DP.

    The T-fold composition of Gaussians with noise multiplier sigma is (sqrt(T)/sigma)-GDP, so
    sigma_T = sqrt(T) * sigma_1 where sigma_1 = 1 / gdp_mu(epsilon, delta).
    """
    steps, delta = check_steps(steps), check_delta(delta)
    if math.isinf(check_epsilon(epsilon)):
        return 0.0
    return math.sqrt(steps) / gdp_mu(epsilon, delta)

