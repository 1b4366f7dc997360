"""`dpprobe tune`'s decision to search or not, on scikit-learn digits (N = 1,438), against the
default probe.

For each epsilon (delta 1e-5), 3 runs each (median [min, max] of the test accuracy):
  * tune with its defaults (`--search auto`: on digits it decides not to search and spends the
    whole budget, less the private standardization, on the default recipe's r at T = 300);
  * tune forced to search (`--search random`: what its defaults did before the decision);
  * `dpprobe probe` with its defaults at the same epsilon (no tuning, no standardization).
Issue 23's target: tune ends within 0.5 point of the default probe, or above it.

Run: .venv/bin/python benchmarks/tune_decision.py [--epsilons 1,3,8] [--runs 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

DELTA = 1e-5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", default="1,3,8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", default="runs/bench-tune-decision")
    args = parser.parse_args()
    from dpprobe.pipelines import linear_scaling_search, run_extract, run_probe

    store = str(Path(args.workdir) / "digits-scatternet.zarr")
    run_extract(backbone="scatternet", data="digits", out=store, progress=False)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    print("| epsilon | tune, defaults (decision) | tune, search forced | probe defaults | "
          "tune - probe (medians) |")
    print("| --- | --- | --- | --- | --- |")
    for epsilon in epsilons:
        cells, medians, decision = [], [], ""
        for search in ("auto", "random"):
            runs = [linear_scaling_search(store, epsilon, DELTA, search=search, quiet=True)
                    for _ in range(args.runs)]
            accuracy = 100 * np.array([r["final"]["test_accuracy"] for r in runs])
            medians.append(float(np.median(accuracy)))
            cells.append(f"{medians[-1]:.2f} [{accuracy.min():.2f}, {accuracy.max():.2f}]")
            if search == "auto":
                decision = "search" if runs[0]["stages"] else "no search"
        probe = run_probe(store, epsilons=[epsilon], delta=DELTA, seeds=args.runs, quiet=True)
        accuracy = 100 * np.array([r["test_accuracy"] for r in probe["runs"]])
        probe_median = float(np.median(accuracy))
        print(f"| {epsilon:g} | {cells[0]} ({decision}) | {cells[1]} | {probe_median:.2f} "
              f"[{accuracy.min():.2f}, {accuracy.max():.2f}] | {medians[0] - probe_median:+.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
