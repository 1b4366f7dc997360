"""The gradient-canary audit's EM fit (`dp.canaries.fit_subsampled_gaussian`): its E-step as
one logistic pass (now) against the E-step written from the two Gaussian densities' logs
(before, the code this replaced), side by side in one process, alternating, medians.

Projections are drawn as a one-run audit of fine-tuning sees them: T steps x 5,000 canaries,
half of them in, each sampled with probability q and noised with std sigma (units of C); the
fit runs on the 2,500 in canaries' T x 2,500 projections. The two must agree to 1e-9.

    python benchmarks/em_fit.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

from dpprobe.dp.canaries import _em_start, fit_subsampled_gaussian

CASES = [(169, 0.01, 1.0), (300, 0.02, 1.0), (300, 0.02, 0.5), (1000, 0.05, 2.0)]


def _before(projections, included, *, iterations=200):
    """`fit_subsampled_gaussian` before: the posterior from the two densities' logs."""
    noise, inside, start = _em_start(projections, included)
    if start is None:
        return noise, 0.0, 0.0
    rate, signal = start
    for _ in range(iterations):
        log_in = math.log(max(rate, 1e-300)) - np.square(inside - signal) / (2 * noise**2)
        log_out = math.log1p(-min(rate, 1 - 1e-12)) - np.square(inside) / (2 * noise**2)
        weight = 1.0 / (1.0 + np.exp(np.clip(log_out - log_in, -700, 700)))
        previous = (rate, signal)
        rate = float(np.clip(weight.mean(), 1e-12, 1.0))
        signal = float((weight * inside).sum() / max(weight.sum(), 1e-300))
        if abs(rate - previous[0]) <= 1e-7 * rate and abs(signal - previous[1]) <= 1e-7:
            break
    return noise, rate, signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"EM fit of the canary audit; medians of {args.repeats}, alternating; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'T':>5s} {'q':>5s} {'sigma':>5s} {'before s':>9s} {'now s':>7s} {'speed-up':>8s} "
          f"{'max rel diff (q, a)':>20s}")
    for steps, q, sigma in CASES:
        included = rng.random(5000) < 0.5
        z = ((rng.random((steps, 5000)) < q) * included
             + sigma * rng.standard_normal((steps, 5000)))
        times = {"before": [], "now": []}
        fits = {}
        for _ in range(args.repeats):
            for name, fit in (("before", _before), ("now", fit_subsampled_gaussian)):
                start = time.perf_counter()
                fits[name] = fit(z, included)
                times[name].append(time.perf_counter() - start)
        diff = max(abs(a - b) / abs(a) for a, b in zip(fits["before"][1:], fits["now"][1:],
                                                       strict=True))
        assert diff <= 1e-9, fits
        before, now = (statistics.median(times[k]) for k in ("before", "now"))
        print(f"{steps:5d} {q:5g} {sigma:5g} {before:9.2f} {now:7.2f} {before / now:7.1f}x "
              f"{diff:20.1e}", flush=True)


if __name__ == "__main__":
    main()
