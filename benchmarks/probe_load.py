"""Load: sweeps of R runs (epsilons x seeds) through `dpprobe probe --stream` on an
ImageNet-shaped store (1,281,167 x 1280 float16), each in its own child process: wall time,
time per run and peak RSS, and whether time is linear in R (least squares, the intercept being
the fixed cost).

Single-step DP-Adam (Mehta et al. 2022), `--classes` classes (default 10: with 1000 classes a
pass over the store costs ~85 s of matmul per group of runs on 2 cores, too slow to sweep
here). The store is `probe_sweep.make_store`'s, built under --workdir and deleted at the end
(unless --keep-store). Peak RSS is the child's own (`os.wait4`'s rusage: the CLI process and
nothing else). The streamed trainer trains the runs in groups within its memory budget
(`probe.budget`), so the peak is bounded whatever R is and each group is one more pass.

Run: .venv/bin/python benchmarks/probe_load.py --workdir /tmp/dpprobe-load [--runs 10,100,1000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _path  # first: keeps this folder off the import path
import numpy as np

ROWS, TEST_ROWS, DIM = 1_281_167, 1000, 1280
DELTA = 1e-8


def sweep_grid(runs: int, seeds: int) -> tuple[tuple[float, ...], int]:
    """(epsilons, seeds) with len(epsilons) x seeds = runs (distinct epsilons, 0.1 to 10)."""
    seeds = min(seeds, runs)
    if runs % seeds:
        raise ValueError(f"{runs} runs is not a multiple of {seeds} seeds")
    return tuple(float(e) for e in np.geomspace(0.1, 10.0, runs // seeds).round(6)), seeds


def run_sweep(store: Path, out: Path, cache: Path, runs: int, seeds: int) -> dict:
    """One `dpprobe probe --stream` sweep in a child process: wall seconds, peak RSS, the job's
    own wall time (from its owner's timing file beside `out`) and driver."""
    from dpprobe.timings import read_timings

    epsilons, seeds = sweep_grid(runs, seeds)
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "dpprobe.pipelines.cli", "probe", str(store), "--stream",
           "--epsilons", ",".join(f"{e:g}" for e in epsilons), "--delta", f"{DELTA:g}",
           "--seeds", str(seeds), "--optimizer", "adam", "--steps", "1", "--lr", "1e-3",
           "--out", str(out), "--quiet"]
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise RuntimeError(f"{runs} runs: dpprobe probe exited {child.returncode}")
    results = json.loads(out.read_text())
    assert len(results["runs"]) == runs
    return {"runs": runs, "epsilons": len(epsilons), "seeds": seeds, "seconds": seconds,
            "job_seconds": read_timings(out)["wall_seconds"],
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "driver": results["probe"]["driver"],
            "mean_accuracy": float(np.mean([r["test_accuracy"] for r in results["runs"]]))}


UNBOUNDED_CHILD = """
import json, sys, time, numpy as np
from dpprobe import accounting, dp, extract, probe
store, runs, classes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
attrs = extract.split_attrs(store, "train")
sigma = accounting.calibrate_noise_multiplier(1.0, 1e-8)
specs = [probe.RunSpec(accounting.DpPlan(sigma, 1, clip_norm=1.0), 1e-3)] * runs
start = time.perf_counter()
result = probe.train_probe_streaming(
    lambda: extract.iter_split_chunks(store, "train", dtype=None), specs, dp.make_keys(runs),
    probe.ProbeSpec(classes, optimizer="adam"), num_examples=attrs["num_examples"],
    dim=attrs["feature_dim"], flags=probe.PerformanceFlags(memory_budget=2**62))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def unbounded(store: Path, runs: int, classes: int) -> dict:
    """`probe.train_probe_streaming` with no memory budget (all runs in one group), training
    only, in a child process: (seconds, peak RSS), the comparison for the budgeted job."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", UNBOUNDED_CHILD, str(store), str(runs),
                              str(classes)], env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"unbounded {runs} runs: exit {os.waitstatus_to_exitcode(status)}")
    return {"runs": runs, "seconds": time.perf_counter() - start,
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def linear_fit(runs, seconds) -> tuple[float, float, float]:
    """Least squares seconds = a + b R: (a, b, the largest |residual| / fitted value)."""
    runs, seconds = np.asarray(runs, float), np.asarray(seconds, float)
    b, a = np.polyfit(runs, seconds, 1)
    fitted = a + b * runs
    return float(a), float(b), float(np.max(np.abs(seconds - fitted) / fitted))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/dpprobe-load",
                        help="the store, results and the CLI's caches go here")
    parser.add_argument("--runs", default="10,100,1000", help="sweep sizes R (comma-separated)")
    parser.add_argument("--seeds", type=int, default=10, help="seeds per epsilon (R / seeds "
                        "epsilons)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--unbounded", type=int, default=1000, help="also train this many runs "
                        "with no memory budget (train_probe_streaming; 0: skip)")
    parser.add_argument("--keep-store", action="store_true")
    args = parser.parse_args()
    sizes = [int(r) for r in args.runs.split(",")]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / f"imagenet-shaped-{args.classes}c.zarr"
    make_store = _path.load_benchmark("probe_sweep").make_store
    start = time.perf_counter()
    make_store(store, ROWS, TEST_ROWS, DIM, args.classes, seed=1)
    build = time.perf_counter() - start
    size = sum(f.stat().st_size for f in (store / "train").rglob("*") if f.is_file())
    cache = workdir / "jax-cache"
    run_sweep(store, workdir / "warm.json", cache, sizes[0], args.seeds)  # fill the caches
    reports = []
    for _ in range(args.repeats):
        for runs in sizes:
            reports.append(run_sweep(store, workdir / f"results-{runs}.json", cache, runs,
                                     args.seeds))
            print(json.dumps(reports[-1]), flush=True)
    free = unbounded(store, args.unbounded, args.classes) if args.unbounded else None
    if not args.keep_store:
        shutil.rmtree(store)

    print(f"\nLoad: `dpprobe probe --stream`, {ROWS:,} x {DIM} float16 "
          f"({size / 2**30:.2f} GiB on disk, built or reused in {build:.0f} s), {args.classes} "
          f"classes, "
          f"single-step DP-Adam, delta {DELTA:g}; CPU, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[1]:.1f} (5 min)")
    print(f"{'runs':>6s} {'eps x seeds':>12s} {'wall s':>8s} {'s/run':>8s} {'peak RSS GiB':>13s}"
          f"  driver")
    for r in reports:
        print(f"{r['runs']:6d} {r['epsilons']:>5d} x {r['seeds']:<4d} {r['seconds']:8.1f} "
              f"{r['seconds'] / r['runs']:8.3f} {r['peak_rss_bytes'] / 2**30:13.2f}  {r['driver']}")
    a, b, worst = linear_fit([r["runs"] for r in reports], [r["seconds"] for r in reports])
    print(f"least squares: wall = {a:.1f} s + {b:.3f} s x runs (largest residual "
          f"{worst:.0%} of the fit)")
    by_size = {runs: np.median([r["seconds"] for r in reports if r["runs"] == runs])
               for runs in sizes}
    for low, high in zip(sizes, sizes[1:], strict=False):
        print(f"time({high}) / time({low}) = {by_size[high] / by_size[low]:.2f} "
              f"(runs x{high / low:g}; medians)")
    if free:
        print(f"no memory budget, {free['runs']} runs in one group (train_probe_streaming, "
              f"training only, child process): {free['seconds']:.1f} s wall, peak RSS "
              f"{free['peak_rss_bytes'] / 2**30:.2f} GiB")
    peak = max(r["peak_rss_bytes"] for r in reports) / 2**30
    print(f"largest peak RSS {peak:.2f} GiB (target <= 2 GiB: "
          f"{'met' if peak <= 2 else 'not met'})")


if __name__ == "__main__":
    main()
