"""What each start-up aid of the CLI earns: whole `dpprobe probe` processes, with and without.

The aids (each in one small private module whose docstring points here):
  * `accounting._dp_event`: dp_accounting's event classes without its accountants and SciPy;
  * `pipelines._fast_exit`: leaving the process without the interpreter's teardown.
"Without" runs the same job with the aid defeated from outside (dp_accounting imported first;
the console script's `main` returned through `sys.exit`). Runs alternate, medians of wall and
CPU (user + sys) seconds; the machine is shared and noisy, so compare within one run.

Run: .venv/bin/python benchmarks/startup.py [--store S] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path

VARIANTS = {
    "as shipped": "from dpprobe.pipelines.cli import entry; entry()",
    "without accounting._dp_event": ("import dp_accounting; "
                                     "from dpprobe.pipelines.cli import entry; entry()"),
    "without pipelines._fast_exit": "import sys; from dpprobe.pipelines.cli import main; "
                                    "sys.exit(main())",
}


def run_once(code: str, args: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="/tmp/dpprobe-bench/synthetic-50k-768.zarr",
                        help="a complete store (benchmarks/probe_sweep.py makes this one)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not Path(args.store).exists():
        sys.path.insert(0, str(Path(__file__).parent))
        import probe_sweep

        probe_sweep.make_store(Path(args.store), 50_000, 10_000, 768, 10)
    out = Path(tempfile.mkdtemp()) / "results.json"
    job = ["probe", args.store, "--epsilons", "0.25,0.5,1,2,4,8,16,inf", "--seeds", "5",
           "--steps", "1", "--quiet", "--out", str(out)]
    for code in VARIANTS.values():  # warm the JAX compilation cache
        run_once(code, job)
    times = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, code in VARIANTS.items():
            times[name].append(run_once(code, job))
    base_wall = statistics.median(w for w, _ in times["as shipped"])
    base_cpu = statistics.median(c for _, c in times["as shipped"])
    print(f"`dpprobe {' '.join(job[:2])} ...` (40 runs, T=1), medians of {args.repeats}, "
          f"load average {os.getloadavg()[1]:.1f}")
    print(f"{'variant':32s} {'wall s':>8s} {'cpu s':>8s} {'aid earns (wall, cpu)':>24s}")
    for name, values in times.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        gain = "" if name == "as shipped" else f"{wall - base_wall:+.3f}, {cpu - base_cpu:+.3f}"
        print(f"{name:32s} {wall:8.3f} {cpu:8.3f} {gain:>24s}")


if __name__ == "__main__":
    main()
