"""`dpprobe probe STORE` with its defaults (no recipe flag), against the targets of issue 23.

Two parts:
  * targets: `run_probe(store, epsilons=..., seeds=3)` with no other option (what `dpprobe probe
    STORE --epsilons 0.5,1,2,3,4,8,inf --seeds 3` runs) on the Fashion-MNIST ScatterNet store:
    the median of the 3 runs' test accuracy per epsilon (each run has its own noise: 3
    independent runs), against epsilon 1 >= 86%, 3 >= 88.5%, 8 >= 89.5%, non-private >= 90%,
    and no fall of more than 0.5 point as epsilon grows;
  * grid (`--grid`): on scikit-learn digits (1,438 examples), the test accuracy of a grid of
    r = lr x T (T = 100, momentum) at each epsilon, and the best r in units of mu N: what the
    rule's constant r = 0.011 mu N (`probe.recipe`) is read from, beside Fashion-MNIST's
    r* from `dpprobe tune` (README).

Run: .venv/bin/python benchmarks/probe_defaults.py [--store /work/fmnist.zarr] [--grid]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

DELTA = 1e-5
EPSILONS = (0.5, 1.0, 2.0, 3.0, 4.0, 8.0, math.inf)
TARGETS = {1.0: 86.0, 3.0: 88.5, 8.0: 89.5, math.inf: 90.0}
MAX_FALL = 0.5


def targets(store: str, seeds: int) -> None:
    from dpprobe.pipelines import run_probe

    start = time.perf_counter()
    results = run_probe(store, epsilons=EPSILONS, delta=DELTA, seeds=seeds, quiet=True)
    seconds = time.perf_counter() - start
    print(results["recipe"]["learning_rate"], f"T = {results['recipe']['steps']}")
    print(f"{len(results['runs'])} runs in one program, {seconds:.0f} s (N = "
          f"{results['num_train']}, d = {results['provenance']['train']['feature_dim']})")
    print("| epsilon | median of 3 [min, max] | lr | target | met |")
    print("| --- | --- | --- | --- | --- |")
    medians = []
    for epsilon in EPSILONS:
        runs = [r for r in results["runs"] if r["epsilon"] == epsilon]
        accuracy = 100 * np.array([r["test_accuracy"] for r in runs])
        median = float(np.median(accuracy))
        medians.append(median)
        target = TARGETS.get(epsilon)
        met = "-" if target is None else ("yes" if median >= target else "NO")
        print(f"| {'inf (non-private)' if math.isinf(epsilon) else f'{epsilon:g}'} | "
              f"{median:.2f} [{accuracy.min():.2f}, {accuracy.max():.2f}] | "
              f"{runs[0]['learning_rate']:.4g} | {'-' if target is None else f'>= {target:g}'} "
              f"| {met} |")
    falls = [a - b for a, b in zip(medians, medians[1:], strict=False)]
    print(f"largest fall as epsilon grows: {max(0.0, *falls):.2f} points (target <= "
          f"{MAX_FALL})")


def grid(workdir: Path) -> None:
    from dpprobe import accounting
    from dpprobe.pipelines import run_extract, run_probe

    store = str(workdir / "digits-scatternet.zarr")
    run_extract(backbone="scatternet", data="digits", out=store, progress=False)
    rs = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0)
    results = run_probe(store, epsilons=EPSILONS[:3] + EPSILONS[4:], delta=DELTA, seeds=3,
                        optimizer="momentum", steps=(100,), learning_rates=[r / 100 for r in rs],
                        quiet=True)
    print("| epsilon | " + " | ".join(f"r {r:g}" for r in rs) + " | best r / (mu N) |")
    print("| --- " * (len(rs) + 2) + "|")
    for epsilon in EPSILONS[:3] + EPSILONS[4:]:
        rows = [row for row in results["summary"] if row["epsilon"] == epsilon]
        accuracy = [100 * row["test_accuracy_mean"] for row in rows]
        best = rs[int(np.argmax(accuracy))]
        mu = accounting.gdp_mu(min(epsilon, 8.0), DELTA)
        print(f"| {epsilon:g} | " + " | ".join(f"{a:.1f}" for a in accuracy)
              + f" | {best / (mu * results['num_train']):.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="/work/fmnist.zarr",
                        help="Fashion-MNIST ScatterNet store (dpprobe extract --backbone "
                        "scatternet --data fashion-mnist)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--grid", action="store_true", help="the digits r grid instead")
    parser.add_argument("--workdir", default="runs/bench-probe-defaults")
    args = parser.parse_args()
    if args.grid:
        grid(Path(args.workdir))
    else:
        targets(args.store, args.seeds)


if __name__ == "__main__":
    main()
