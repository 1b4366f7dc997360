"""Where the test suite's time goes: per test, and per compiled program, from JAX's own events.

A pytest plugin (this file, loaded in every pytest-xdist worker) listens to JAX's monitoring
events and writes, per test, its wall and CPU seconds and the seconds of each compile-path
event per program (the name JAX gives it: the jitted function's, `jit(clip)`):

  * tracing (`jaxpr_trace_duration`) and lowering to MLIR (`jaxpr_to_mlir_module_duration`):
    Python work JAX keeps only in memory, so each process pays them again;
  * XLA's backend (`backend_compile_duration`), which includes reading a program back from the
    persistent compilation cache (`cache_retrieval_time_sec`, also listed on its own).

The report sums them over the run: the compile path per program (which programs to share
between tests, or to trace less often), the slowest tests with their compile path apart from
the rest (the arithmetic, torch, subprocesses), and the slowest files.

Run (the suite as `make test` runs it on a 2-core machine, the plugin in every worker; pytest
arguments after `--` replace the default ones):
  .venv/bin/python benchmarks/suite_profile.py run [--out DIR] [-- PYTEST_ARGS...]
  .venv/bin/python benchmarks/suite_profile.py report DIR [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import time

import pytest

OUT_ENV = "DPPROBE_SUITE_PROFILE"
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "backend",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache read"}
COMPILE_PATH = ("trace", "lower", "backend")
PLUGIN = "dpprobe_suite_profile"
SHIM = """import importlib.util
_spec = importlib.util.spec_from_file_location("_dpprobe_suite_profile", {path!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
pytest_runtest_protocol = _module.pytest_runtest_protocol
"""

# --- the plugin (runs inside each pytest process) ---------------------------------------------

_current: dict = collections.defaultdict(lambda: [0.0, 0])
_listening = False


def _listener(event: str, duration: float, **kwargs) -> None:
    kind = EVENTS.get(event)
    if kind is not None:
        name = str(kwargs.get("fun_name", "")).removeprefix("jit(").removesuffix(")")
        entry = _current[f"{kind}|{name}"]
        entry[0] += duration
        entry[1] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _listening
    if not _listening:  # JAX is imported by now (the tests' conftest)
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_listener)
        _listening = True
    _current.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    record = {"test": item.nodeid, "wall": time.perf_counter() - wall,
              "cpu": time.process_time() - cpu, "events": dict(_current)}
    path = os.path.join(os.environ[OUT_ENV], f"tests.{os.getpid()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# --- the report ------------------------------------------------------------------------------


def read_records(folder: str) -> list[dict]:
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "tests.*.jsonl"))):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    if not records:
        raise SystemExit(f"no test records in {folder} (tests.*.jsonl)")
    return records


def _split(record: dict) -> dict[str, float]:
    kinds = collections.Counter()
    for key, (seconds, _) in record["events"].items():
        kinds[key.split("|", 1)[0]] += seconds
    return kinds


def programs(records: list[dict]) -> list[tuple[str, dict]]:
    """Per program name: seconds and counts of each event, the files that compiled it."""
    table: dict = collections.defaultdict(lambda: collections.Counter())
    files: dict = collections.defaultdict(set)
    for record in records:
        for key, (seconds, count) in record["events"].items():
            kind, name = key.split("|", 1)
            table[name][kind] += seconds
            table[name][f"{kind} n"] += count
            files[name].add(record["test"].split("::")[0])
    for name, row in table.items():
        row["files"] = len(files[name])
        row["compile path"] = sum(row[k] for k in COMPILE_PATH)
    return sorted(table.items(), key=lambda item: -item[1]["compile path"])


def report(folder: str, top: int) -> None:
    records = read_records(folder)
    totals = collections.Counter()
    for record in records:
        totals.update(_split(record))
    wall = sum(r["wall"] for r in records)
    print(f"{len(records)} tests in {folder}: {wall:,.0f} test-seconds wall, "
          f"{sum(r['cpu'] for r in records):,.0f} CPU s of the pytest processes "
          "(subprocesses not counted)")
    print("compile path (test-seconds): " + ", ".join(
        f"{kind} {totals[kind]:,.0f}" for kind in (*COMPILE_PATH, "cache read"))
        + " (cache reads are part of the backend's time)")

    print("\n| program | compile path s | trace s (n) | lower s (n) | backend s (n) | files |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in programs(records)[:top]:
        cells = " | ".join(f"{row[k]:.1f} ({row[k + ' n']:,})" for k in COMPILE_PATH)
        print(f"| `{name or '?'}` | {row['compile path']:.1f} | {cells} | {row['files']} |")

    print("\n| test | wall s | compile path s | the rest s |")
    print("| --- | --- | --- | --- |")
    for record in sorted(records, key=lambda r: -r["wall"])[:top]:
        compiled = sum(_split(record)[k] for k in COMPILE_PATH)
        print(f"| {record['test']} | {record['wall']:.1f} | {compiled:.1f} | "
              f"{record['wall'] - compiled:.1f} |")

    by_file = collections.Counter()
    for record in records:
        by_file[record["test"].split("::")[0]] += record["wall"]
    print("\n| file | wall s |")
    print("| --- | --- |")
    for name, seconds in by_file.most_common(top):
        print(f"| {name} | {seconds:.1f} |")


def run(out: str, pytest_args: list[str]) -> int:
    """The suite in a child pytest with this plugin in every worker; its records in `out`."""
    os.makedirs(out, exist_ok=True)
    stale = glob.glob(os.path.join(out, "tests.*.jsonl"))
    if stale:
        raise SystemExit(f"{out} holds records of an earlier run ({len(stale)} files): "
                         "choose a new --out")
    # The workers import the plugin by name from a folder of its own: this folder on their path
    # would let a benchmark's name (`extract.py`, `export.py`) shadow a library's module.
    shim = os.path.join(os.path.abspath(out), "plugin")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, f"{PLUGIN}.py"), "w") as f:
        f.write(SHIM.format(path=os.path.abspath(__file__)))
    env = dict(os.environ, **{OUT_ENV: os.path.abspath(out)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, env.get("PYTHONPATH")]))
    args = pytest_args or ["-q", "-n", "2", "--dist", "worksteal", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", PLUGIN, *args], env=env)
    print(f"\npytest exited {code} after {time.perf_counter() - start:,.0f} s wall "
          f"(load average now {os.getloadavg()[0]:.1f})\n")
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run the suite with the plugin, then report")
    run_parser.add_argument("--out", default="/tmp/dpprobe-suite-profile")
    run_parser.add_argument("--top", type=int, default=25)
    run_parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    report_parser = sub.add_parser("report", help="report a run's records")
    report_parser.add_argument("folder")
    report_parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.command == "run":
        code = run(args.out, args.pytest_args)
        report(args.out, args.top)
        sys.exit(code)
    report(args.folder, args.top)


if __name__ == "__main__":
    main()
