"""Where a `dpprobe probe` sweep's time goes: one CLI process, its phases timed from inside.

The sweep of `probe_sweep.py` (8 epsilons x 5 seeds, single-step DP-Adam, 50k x 768 float16,
10 classes) runs in a child process as the CLI (`cli.main`, warm compilation cache), with
timers wrapped around the job's phases:

  * imports: the interpreter's start to the job's start (the CLI, argparse's `choices`, which
    import `dpprobe.dp`), plus the `probe` import the store read overlaps;
  * store read: `probe.store_runs.read_splits` (train and test splits, JAX imported meanwhile);
  * calibration: `accounting.calibrate_plan` (8 epsilons);
  * train: `probe.train_probe`, split by JAX's own monitoring events into tracing/lowering,
    XLA compilation, compilation-cache reads, and the rest (the clipped sums, noise, the
    optimizer: the arithmetic);
  * evaluation: `probe.evaluate_chunks` (40 runs on the 10,000 test rows);
  * records: each run's epsilon from its `DpEvent` and the seeds' composition (PLD);
  * writing: results.json and the timings file; the table printed;
  * the rest (argument checks, the exit).

The child turns the stored programs on as the `dpprobe` console script does
(`probe.programs`): after the warm-up, tracing and lowering show only what is not stored.

Wall and CPU seconds (user + sys, the child's own) per phase; medians over --repeats children.
The wrapping imports `dpprobe.probe` before the job starts, so the store read no longer
overlaps the JAX import here: phases add up to a little more than the plain CLI's wall time.

Run: .venv/bin/python benchmarks/sweep_profile.py [--workdir /tmp/dpprobe-bench] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import _path  # first: keeps this folder off the import path

CHILD = r"""
import json, os, sys, time
def cpu():
    t = os.times()
    return t.user + t.system
marks = {"wall0": time.perf_counter(), "cpu0": cpu()}
phases = {}
current = ["other"]
def wrap(owner, name, label):
    inner = getattr(owner, name)
    def timed(*args, **kwargs):
        wall, c = time.perf_counter(), cpu()
        outer, current[0] = current[0], label
        try:
            return inner(*args, **kwargs)
        finally:
            current[0] = outer
            w, cc = phases.get(label, (0.0, 0.0))
            phases[label] = (w + time.perf_counter() - wall, cc + cpu() - c)
    setattr(owner, name, timed)
from dpprobe import files, timings
from dpprobe.probe import results as probe_results
from dpprobe.probe import store_runs
from dpprobe.pipelines import cli, probe_job
from dpprobe import accounting
wrap(store_runs, "read_splits", "store read")
wrap(accounting, "calibrate_plan", "calibration")
wrap(probe_results, "run_record", "records (epsilon per run, PLD)")
wrap(probe_results, "composed_epsilon", "records (epsilon per run, PLD)")
wrap(files, "write_json", "writing (results.json)")
wrap(timings, "write_timings", "writing (timings)")
wrap(probe_job, "probe_table", "table")
from dpprobe import jobs
def start_job(inner=jobs.probe_job):
    def job(*args, **kwargs):
        marks["job_wall"], marks["job_cpu"] = time.perf_counter(), cpu()
        from dpprobe import probe
        import jax.monitoring
        events = {}
        def listen(event, seconds, **_):
            key = current[0] + "|" + event
            events[key] = events.get(key, 0.0) + seconds
        jax.monitoring.register_event_duration_secs_listener(listen)
        marks["events"] = events
        probe.train_probe  # resolve the lazy names (their imports: optax, the trainer)
        probe.evaluate_chunks
        marks["probe_import"] = time.perf_counter() - marks["job_wall"]
        marks["probe_import_cpu"] = cpu() - marks["job_cpu"]
        wrap(probe, "train_probe", "train")
        wrap(probe, "evaluate_chunks", "evaluation")
        return inner(*args, **kwargs)
    return job
jobs.probe_job = start_job()
os.environ.setdefault("DPPROBE_STORED_PROGRAMS", "1")  # as the console script (cli.entry)
import gc
gc.set_threshold(100_000, *gc.get_threshold()[1:])  # as the console script (cli.entry)
code = cli.main(sys.argv[1:])
sys.stdout.flush()
end_wall, end_cpu = time.perf_counter(), cpu()
events = marks.get("events", {})
print(json.dumps({"code": code, "phases": phases, "events": events,
                  "before_job": (marks["job_wall"] - marks["wall0"],
                                 marks["job_cpu"] - marks["cpu0"]),
                  "probe_import": (marks["probe_import"], marks["probe_import_cpu"]),
                  "total": (end_wall - marks["wall0"], end_cpu - marks["cpu0"])}),
      file=sys.stderr)
"""

SWEEP = ["--epsilons", "0.25,0.5,1,2,4,8,16,inf", "--delta", "1e-5", "--seeds", "5",
         "--optimizer", "adam", "--steps", "1", "--quiet"]
# JAX's monitoring events (jax._src.dispatch / compiler / compilation_cache).
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                "/jax/core/compile/jaxpr_to_mlir_module_duration")
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


def profile_once(store: Path, out: Path, cache: Path, extra: list[str] | None = None) -> dict:
    """One CLI sweep in a child process: its phases as {name: (wall, cpu)}."""
    env = _path.load_benchmark("probe_sweep").cli_env(cache)  # its caches, bytecode's too
    child = subprocess.run([sys.executable, "-c", CHILD, "probe", str(store), *SWEEP,
                            "--out", str(out), *(extra or [])],
                           check=True, env=env, capture_output=True, text=True)
    report = json.loads(child.stderr.strip().splitlines()[-1])
    phases = {name: tuple(v) for name, v in report["phases"].items()}
    events = report["events"]
    split = {}
    for phase, rest in (("train", "arithmetic (sums, noise, optimizer), transfers"),
                        ("evaluation", "arithmetic, transfers")):
        wall, cpu = phases.pop(phase)
        trace = sum(events.get(f"{phase}|{e}", 0.0) for e in TRACE_EVENTS)
        compiled = events.get(f"{phase}|{COMPILE_EVENT}", 0.0)
        cached = events.get(f"{phase}|{CACHE_EVENT}", 0.0)
        # JAX's events are wall seconds; their CPU is not measured apart.
        split |= {f"{phase}: tracing and lowering": (trace, None),
                  f"{phase}: XLA compilation": (compiled, None),
                  f"{phase}: compilation-cache reads": (cached, None),
                  f"{phase}: {rest}": (wall - trace - compiled - cached, None),
                  f"{phase} (all)": (wall, cpu)}
    ordered = {"imports (interpreter start to the job)": tuple(report["before_job"]),
               "imports (dpprobe.probe in the job: JAX, optax)": tuple(report["probe_import"])}
    ordered |= {"store read": phases.pop("store read")}
    ordered |= {k: phases.pop(k) for k in ("calibration",) if k in phases}
    ordered |= split
    ordered |= {k: phases.pop(k) for k in list(phases)}
    parts = ("train: ", "evaluation: ")  # their phase's split, already in "(all)"
    accounted_wall = sum(v[0] for k, v in ordered.items() if not k.startswith(parts))
    accounted_cpu = sum(v[1] for k, v in ordered.items()
                        if not k.startswith(parts) and v[1] is not None)
    total = tuple(report["total"])
    ordered["the rest (checks, recipe, ledger, exit)"] = (total[0] - accounted_wall,
                                                          total[1] - accounted_cpu)
    ordered["total (child process)"] = total
    return ordered


def profile(store: Path, workdir: Path, repeats: int) -> dict[str, tuple[float, float | None]]:
    """Medians of `repeats` profiled sweeps after one that fills the compilation cache."""
    cache = workdir / "jax-cache-profile"
    profile_once(store, workdir / "profile.json", cache)  # warm the cache
    rounds = [profile_once(store, workdir / "profile.json", cache) for _ in range(repeats)]
    return {name: (statistics.median(r[name][0] for r in rounds),
                   None if rounds[0][name][1] is None
                   else statistics.median(r[name][1] for r in rounds))
            for name in rounds[0]}


def print_profile(table: dict, repeats: int) -> None:
    print(f"\nwhere a warm CLI sweep's time goes (40 runs, 50k x 768; medians of {repeats}; "
          f"load average {os.getloadavg()[0]:.1f})")
    print(f"  {'phase':58s} {'wall s':>8s} {'CPU s':>8s}")
    for name, (wall, cpu) in table.items():
        print(f"  {name:58s} {wall:8.3f} {'' if cpu is None else f'{cpu:8.3f}':>8s}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/dpprobe-bench")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "synthetic-50k-768.zarr"
    _path.load_benchmark("probe_sweep").make_store(store, 50_000, 10_000, 768, 10)
    print_profile(profile(store, workdir, args.repeats), args.repeats)


if __name__ == "__main__":
    main()
