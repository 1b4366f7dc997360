"""`dpprobe demo` from a fresh folder, timed as a user runs it: one `python -m dpprobe.pipelines.cli
demo` process, its wall time, its CPU time (user + system of the process and its children),
and the time of each of its four stages (from the moment each stage's progress line appears on
stderr): features, the epsilon sweep, private tuning, prediction (with the plot).

The target is 4 minutes on 2 free cores for the first run (extraction included). The load
average is printed before and after: on a shared machine, wall time overstates the demo's
cost, CPU time does not.
Run: .venv/bin/python benchmarks/demo.py [--runs 1] [--second-run] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import _path  # noqa: F401 - first: keeps this folder off the import path

STAGES = ("features", "sweep", "tune", "predict + plot")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_demo(out: str) -> dict:
    """One `dpprobe demo --out OUT` process: wall, CPU, and each stage's wall seconds."""
    command = [sys.executable, "-m", "dpprobe.pipelines.cli", "demo", "--out", out]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cpu, start = children_cpu(), time.perf_counter()
    marks = []  # (stage index, time) as each "demo [k/4]" line arrives
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env)
    for line in process.stderr:
        if line.startswith("demo [") and "/4]" in line[:10]:
            marks.append((int(line[6]) - 1, time.perf_counter()))
    stdout = process.stdout.read()
    if process.wait() != 0:
        raise RuntimeError(f"dpprobe demo failed ({process.returncode}):\n{stdout}")
    end = time.perf_counter()
    stages = {}
    for (index, at), (_, until) in zip(marks, marks[1:] + [(None, end)], strict=True):
        stages[STAGES[index]] = until - at
    startup = marks[0][1] - start if marks else float("nan")
    return {"wall": end - start, "cpu": children_cpu() - cpu, "startup": startup,
            "stages": stages}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="first runs, each in a new folder")
    parser.add_argument("--second-run", action="store_true",
                        help="also time a second run in the last folder (features reused)")
    parser.add_argument("--keep", default=None, help="keep the run folders under DIR")
    args = parser.parse_args()

    base = args.keep or tempfile.mkdtemp(prefix="dpprobe-demo-bench-")
    os.makedirs(base, exist_ok=True)
    rows = []
    load_before = os.getloadavg()
    try:
        for run in range(args.runs):
            out = os.path.join(base, f"demo-{run}")
            rows.append(("first run", run_demo(out)))
        if args.second_run:
            rows.append(("second run", run_demo(out)))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"\n`dpprobe demo` from a fresh folder, {os.cpu_count()} cores; load average before "
          f"{load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, after "
          f"{load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}")
    print(f"{'run':11s} {'wall s':>7s} {'CPU s':>7s} {'start s':>8s} "
          + " ".join(f"{stage + ' s':>16s}" for stage in STAGES))
    for name, row in rows:
        print(f"{name:11s} {row['wall']:7.1f} {row['cpu']:7.1f} {row['startup']:8.1f} "
              + " ".join(f"{row['stages'].get(stage, float('nan')):16.1f}" for stage in STAGES))


if __name__ == "__main__":
    main()
