"""`dpprobe probe STORE` with no flag on stores of growing N: the step count the recipe chooses
(`probe.recipe.default_steps`, from `probe.cost`), the time it printed beforehand, and the
time and CPU the sweep took; and the per-step cost the CPU rate of `probe.cost` is read from.

Three parts:
  * defaults: a synthetic store (random features with a class signal, written with the store
    writer, float16) of each --shapes N x d x 10 classes; the default sweep (5 epsilons x 3
    seeds = 15 runs) as a child process, warm compilation cache (a first run fills it);
  * per step: `probe.train_probe` on 200,000 x 512 x 10, 15 runs, T = 1 and T = 6 in one
    program, float64 sums (as shipped) and float32 sums (the module constant patched, for the
    comparison only): CPU seconds per step = (T6 - T1) / 5;
  * --fmnist STORE: what the recipe chooses on Fashion-MNIST's ScatterNet store (T = 300: N is
    within the measured size), and with --fmnist-steps T, the test accuracy of one run per
    epsilon at that T, beside docs/performance.md's T = 300 table.

Run: .venv/bin/python benchmarks/probe_recipe_speed.py [--workdir /tmp/dpprobe-bench]
     [--shapes 200000x512] [--skip-steps] [--fmnist STORE [--fmnist-steps 13]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import _path  # first: keeps this folder off the import path

STEPS_CHILD = r"""
import os, sys, time
import numpy as np
import jax.numpy as jnp
from dpprobe import accounting, dp, probe
import dpprobe.probe.clipping as clipping, dpprobe.probe.train as train
if sys.argv[1] == "float32":  # the comparison only: sums without the float64 reduction
    clipping.FLOAT64_SUMS = train.FLOAT64_SUMS = jnp.float32
n, d, c, runs = 200_000, 512, 10, 15
rng = np.random.default_rng(0)
x, y = rng.normal(size=(n, d)).astype(np.float16), rng.integers(0, c, n)
spec = probe.ProbeSpec(c, optimizer="momentum")
cpu = {}
for steps in (1, 6):
    specs = [probe.RunSpec(accounting.DpPlan(1.0, steps, clip_norm=1.0), 1.0)] * runs
    for repeat in range(2):  # the second: compiled
        t = os.times()
        probe.train_probe(x, y, specs, dp.make_keys(runs), spec)
        u = os.times()
        cpu[steps] = u.user + u.system - t.user - t.system
print((cpu[6] - cpu[1]) / 5)
"""


def make_store(path: Path, num_train: int, dim: int) -> None:
    _path.load_benchmark("probe_sweep").make_store(path, num_train, 10_000, dim, 10)


def default_sweep(store: Path, cache: Path) -> dict:
    """`dpprobe probe STORE --out R` (no recipe flag) in a child: wall, CPU, the recipe line."""
    out = store.with_suffix(".results.json")
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), HF_HUB_OFFLINE="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.run([str(Path(sys.executable).parent / "dpprobe"), "probe", str(store),
                            "--out", str(out)], check=True, env=env, capture_output=True,
                           text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    results = json.loads(out.read_text())
    line = next(x for x in child.stderr.splitlines() if x.startswith("recipe:"))
    accuracy = {}
    for run in results["runs"]:
        accuracy.setdefault(run["epsilon"], []).append(100 * run["test_accuracy"])
    return {"wall": wall, "cpu": after.ru_utime - before.ru_utime + after.ru_stime
            - before.ru_stime, "steps": results["recipe"]["steps"][0],
            "expected": line.split("expected time about ")[-1], "accuracy": accuracy}


def per_step_cpu(kind: str) -> float:
    child = subprocess.run([sys.executable, "-c", STEPS_CHILD, kind], check=True,
                           capture_output=True, text=True, env=dict(os.environ,
                                                                    HF_HUB_OFFLINE="1"))
    return float(child.stdout.strip().splitlines()[-1])


def fmnist(store: str, steps: int | None) -> None:
    from dpprobe import extract
    from dpprobe.pipelines import ProbeConfig, recipe, run_probe
    from dpprobe.probe import cost

    attrs = dict(extract.open_split(store, "train").attrs)
    n, d = int(attrs["num_examples"]), math.prod(attrs["feature_shape"])
    platform, cores = cost.local_device()
    estimate = cost.step_cost(n, d, 10, 15, platform=platform, cores=cores)
    chosen = recipe.probe_recipe(ProbeConfig(store=store), attrs, n, estimate)
    print(f"\nFashion-MNIST store ({n} x {d}): {chosen.describe([0.5, 1, 2, 4, 8])}")
    print(f"  with the time budget alone T would be {recipe.default_steps(10**9, estimate)[0]}"
          f" (N above {recipe.MEASURED_ROWS:,})")
    if steps:
        start = time.perf_counter()
        results = run_probe(store, epsilons=(0.5, 1.0, 2.0, 3.0, 4.0, 8.0, math.inf), seeds=1,
                            steps=(steps,), quiet=True)
        print(f"  one run per epsilon at T = {steps} ({time.perf_counter() - start:.0f} s): "
              + ", ".join(f"epsilon {r['epsilon']:g}: {100 * r['test_accuracy']:.2f}"
                          for r in results["runs"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/dpprobe-bench")
    parser.add_argument("--shapes", default="200000x512",
                        help="comma-separated N x d train shapes (10 classes)")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--fmnist", help="Fashion-MNIST ScatterNet store")
    parser.add_argument("--fmnist-steps", type=int)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        n, d = (int(v) for v in shape.split("x"))
        store = workdir / f"synthetic-{n}-{d}.zarr"
        make_store(store, n, d)
        cache = workdir / "jax-cache-recipe"
        default_sweep(store, cache)  # fills the compilation cache
        rows.append((n, d, default_sweep(store, cache)))
    print(f"\n`dpprobe probe STORE` with no flag (15 runs, 10 classes); load average "
          f"{os.getloadavg()[1]:.1f} (5 min), {os.cpu_count()} cores")
    print(f"  {'N x d':>14s} {'T':>4s} {'expected':>40s} {'wall s':>8s} {'CPU s':>8s}  accuracy "
          "% at epsilon 8 (mean of 3)")
    for n, d, r in rows:
        at_8 = r["accuracy"].get(8.0, [math.nan])
        print(f"  {f'{n} x {d}':>14s} {r['steps']:4d} {r['expected']:>40s} {r['wall']:8.1f} "
              f"{r['cpu']:8.1f}  {sum(at_8) / len(at_8):.2f}")
    if not args.skip_steps:
        f64, f32 = per_step_cpu("float64"), per_step_cpu("float32")
        ops = 200_000 * 512 * 10 * 15
        print(f"\nper step, 200,000 x 512 x 10, 15 runs (CPU seconds): float64 sums {f64:.2f} "
              f"({ops / f64:.2g} N d C P per CPU second), float32 sums {f32:.2f} "
              f"(float64 / float32 = {f64 / f32:.2f})")
    if args.fmnist:
        fmnist(args.fmnist, args.fmnist_steps)


if __name__ == "__main__":
    main()
