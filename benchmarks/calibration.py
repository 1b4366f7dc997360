"""Noise calibration with the PLD accountant and Poisson sampling: the search on the
accountant's own curve alone (before) against the coarse search and Newton steps onto it
(`accounting.calibration`, now), side by side in one process, alternating, medians.

Each case is a (epsilon, T, q) a job calibrates (delta 1e-5): a short finetune on digits, a
finetune on Fashion-MNIST, a long one at small q, the probe's Poisson mode, and a small
epsilon over many steps (where the coarse PLD is furthest from the accountant's own). The caches
of epsilon are cleared before every calibration; the PLD evaluations at the accountant's own
discretization are counted.

`--compare construction` times the calibration of today (`calibrate_noise_multiplier`) and
one reported epsilon (`DpPlan.epsilon`) with dp_accounting's `PLDAccountant` building each
subsampled Gaussian's PLD (before) against `accounting.sampled_pld`'s accountant, the same PLD
built in one vectorized pass (now); the sigmas and epsilons must be equal.

    python benchmarks/calibration.py [--repeats 3] [--compare search|construction]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path

from dpprobe.accounting import calibration, plan
from dpprobe.accounting.gaussian import gaussian_noise_multiplier

DELTA = 1e-5
CASES = [(8.0, 2, 64 / 1438), (3.0, 100, 0.01), (1.0, 500, 256 / 60000), (8.0, 50, 0.05),
         (2.0, 300, 0.01), (0.1, 1000, 0.01)]


def _before(epsilon, steps, q):
    """The search on the accountant's own curve only (the calibration before the coarse one)."""
    full = gaussian_noise_multiplier(epsilon, DELTA, steps)
    sigma = calibration._search(epsilon, DELTA, steps, q, "pld", full)
    return calibration._on_the_private_side(epsilon, DELTA, steps, q, "pld", sigma)


def _now(epsilon, steps, q):
    return calibration.calibrate_noise_multiplier(epsilon, DELTA, steps=steps,
                                                  sampling_probability=q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", choices=("search", "construction"), default="search",
                        help="the coarse search (default) or the PLD's construction")
    args = parser.parse_args()
    if args.compare == "construction":
        _construction(args.repeats)
        return
    counted = {"n": 0}
    accountant = plan.make_accountant

    def counting(*a, **k):  # every evaluation at the accountant's own discretization
        counted["n"] += "pld_discretization" not in k
        return accountant(*a, **k)

    plan.make_accountant = counting
    print(f"PLD calibration, Poisson sampling, delta {DELTA:g}; medians of {args.repeats}, "
          f"alternating; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'epsilon':>7s} {'T':>5s} {'q':>7s} {'before s':>9s} {'evals':>5s} {'now s':>7s} "
          f"{'evals':>5s} {'speed-up':>8s} {'sigma before':>13s} {'sigma now':>12s}")
    for epsilon, steps, q in CASES:
        times = {"before": [], "now": []}
        for _ in range(args.repeats):
            for name, calibrate in (("before", _before), ("now", _now)):
                _clear_caches()
                counted["n"] = 0
                start = time.perf_counter()
                sigma = calibrate(epsilon, steps, q)
                times[name].append((time.perf_counter() - start, counted["n"], sigma))
        before = statistics.median(t for t, _, _ in times["before"])
        now = statistics.median(t for t, _, _ in times["now"])
        print(f"{epsilon:7g} {steps:5d} {q:7.4f} {before:9.2f} {times['before'][0][1]:5d} "
              f"{now:7.2f} {times['now'][0][1]:5d} {before / now:7.1f}x "
              f"{times['before'][0][2]:13.9f} {times['now'][0][2]:12.9f}", flush=True)


def _clear_caches() -> None:
    plan.event_epsilon.cache_clear()
    calibration._coarse_pld_epsilon.cache_clear()


def _construction(repeats: int) -> None:
    """dp_accounting's PLDAccountant (before) vs `sampled_pld`'s (now), alternating."""
    import dp_accounting

    ours = plan.make_accountant

    def theirs(accountant="pld", *, pld_discretization=None):
        if accountant != "pld":
            return ours(accountant)
        return dp_accounting.pld.PLDAccountant(
            dp_accounting.NeighboringRelation.REPLACE_SPECIAL,
            value_discretization_interval=pld_discretization or 1e-4)

    print(f"PLD construction, Poisson sampling, delta {DELTA:g}; medians of {repeats}, "
          f"alternating; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'epsilon':>7s} {'T':>5s} {'q':>7s} {'calibration before s':>21s} {'now s':>7s} "
          f"{'speed-up':>8s} {'one epsilon before s':>21s} {'now s':>7s} {'speed-up':>8s}")
    for epsilon, steps, q in CASES:
        times = {"before": [], "now": []}
        for _ in range(repeats):
            for name, make in (("before", theirs), ("now", ours)):
                plan.make_accountant = calibration.make_accountant = make
                _clear_caches()
                start = time.perf_counter()
                sigma = _now(epsilon, steps, q)
                middle = time.perf_counter()
                spent = plan.DpPlan(sigma * 1.001, steps, q).epsilon(DELTA)  # not cached
                times[name].append((middle - start, time.perf_counter() - middle, sigma, spent))
        plan.make_accountant = calibration.make_accountant = ours
        assert len({(s, e) for _, _, s, e in times["before"] + times["now"]}) == 1, times
        calibrate = [statistics.median(t[0] for t in times[k]) for k in ("before", "now")]
        one = [statistics.median(t[1] for t in times[k]) for k in ("before", "now")]
        print(f"{epsilon:7g} {steps:5d} {q:7.4f} {calibrate[0]:21.2f} {calibrate[1]:7.2f} "
              f"{calibrate[0] / calibrate[1]:7.1f}x {one[0]:21.2f} {one[1]:7.2f} "
              f"{one[0] / one[1]:7.1f}x", flush=True)


if __name__ == "__main__":
    main()
