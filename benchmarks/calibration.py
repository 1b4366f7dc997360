"""Noise calibration with the PLD accountant and Poisson sampling: the search on the
accountant's own curve alone (before) against the coarse search and Newton steps onto it
(`accounting.calibration`, now), side by side in one process, alternating, medians.

Each case is a (epsilon, T, q) a job calibrates (delta 1e-5): a short finetune on digits, a
finetune on Fashion-MNIST, a long one at small q, the probe's Poisson mode, and a small
epsilon over many steps (where the coarse PLD is furthest from the accountant's own). The caches
of epsilon are cleared before every calibration; the PLD evaluations at the accountant's own
discretization are counted.

    python benchmarks/calibration.py [--repeats 3]
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
    args = parser.parse_args()
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
                plan.event_epsilon.cache_clear()
                calibration._coarse_pld_epsilon.cache_clear()
                counted["n"] = 0
                start = time.perf_counter()
                sigma = calibrate(epsilon, steps, q)
                times[name].append((time.perf_counter() - start, counted["n"], sigma))
        before = statistics.median(t for t, _, _ in times["before"])
        now = statistics.median(t for t, _, _ in times["now"])
        print(f"{epsilon:7g} {steps:5d} {q:7.4f} {before:9.2f} {times['before'][0][1]:5d} "
              f"{now:7.2f} {times['now'][0][1]:5d} {before / now:7.1f}x "
              f"{times['before'][0][2]:13.9f} {times['now'][0][2]:12.9f}", flush=True)


if __name__ == "__main__":
    main()
