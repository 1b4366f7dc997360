"""The owner's timing file: how long a publishing job took, kept beside its results, never in
them.

How long a job runs depends on its private records: one large image decodes for seconds, and a
store's extraction lasted as long as its records took. A published duration, rate or timestamp
of the run therefore tells neighbouring datasets apart, and no DP guarantee covers it. So
nothing a publishing job writes as an output (results JSON, CSV, plots, model files, the lines
it prints when done) holds one (`accounting.records`); a job that writes its results to `R.json`
writes its timings to `R.timings.json` beside it (`finetune --out DIR`:
`DIR/results.timings.json`). That file is for the data's owner: NOT covered by the privacy
guarantee, never to be published. Benchmarks read their seconds and images per second from it
(`read_timings`).

The live progress lines on stderr (a rate, the time left, how long the first step took;
`RateProgress` here) are the operator's terminal in the same way: not covered, not to be
published; `--quiet` turns them off.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dpprobe.accounting import records
from dpprobe.files import write_json
from dpprobe.messages import log

__all__ = ["TIMINGS_WARNING", "RateProgress", "Stopwatch", "format_duration", "read_timings",
           "timings_path", "write_timings"]

TIMINGS_WARNING = ("PRIVATE: wall-clock timings of a run over the private data (how long it "
                   "took depends on its records), NOT covered by the privacy guarantee. For the "
                   "data's owner only; never share or publish this file.")


class Stopwatch:
    """Started with the job: `seconds()` since then; `started`, its UTC start time."""

    def __init__(self):
        self.started = records.now()
        self._start = time.perf_counter()

    def seconds(self) -> float:
        """Wall-clock seconds since the job started."""
        return time.perf_counter() - self._start


def timings_path(results_path: str | os.PathLike) -> Path:
    """`R.timings.json` beside the results file `R.json` (or `R`, for another suffix)."""
    path = Path(results_path)
    stem = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
    return path.with_name(f"{stem}.timings.json")


def write_timings(results_path: str | os.PathLike, job: str, stopwatch: Stopwatch, *,
                  quiet: bool = False, **measured: float | None) -> Path:
    """Write the owner's timing file of the job whose results went to `results_path`.

    Args:
      results_path: the job's results file; the timings go beside it (`timings_path`).
      job: the job's name.
      stopwatch: started when the job started; its seconds so far are `wall_seconds`.
      quiet: do not say where the file went.
      measured: the job's other timings (seconds, images per second), written as given.

    Returns:
      The path written. The file holds wall-clock measurements of a run over private data: it
      is not a DP output, and the privacy guarantee does not cover it (module docstring); it is
      readable by its owner only (mode 0600).
    """
    path = timings_path(results_path)
    write_json(path, {
        "warning": TIMINGS_WARNING, "dpprobe_version": records.VERSION, "job": job,
        "results": Path(results_path).name, "started": stopwatch.started,
        "finished": records.now(), "wall_seconds": stopwatch.seconds(), **measured})
    os.chmod(path, 0o600)
    log(f"wrote {path} (timings: for you only, not covered by the privacy "
                  "guarantee; do not publish)", quiet)
    return path


def read_timings(results_path: str | os.PathLike) -> dict:
    """The timing file written beside `results_path` (for benchmarks: seconds, images per
    second)."""
    return json.loads(timings_path(results_path).read_text())


def format_duration(seconds: float) -> str:
    """'45 s', '3 min 05 s', '1 h 02 min'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class RateProgress:
    """`progress(done)`: one line "WHAT: done/total UNIT (p%), r UNIT/s, about t left", the
    rate counted from the start (compiling included, so the first estimates run long)."""

    def __init__(self, what: str, total: int, unit: str, quiet: bool = False):
        self.what, self.total, self.unit, self.quiet = what, total, unit, quiet
        self.start = time.perf_counter()

    def __call__(self, done: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = done / elapsed
        text = f"{self.what}: {done}/{self.total} {self.unit} ({100 * done / self.total:.0f}%)"
        if done >= self.total:
            text += f", done in {format_duration(elapsed)}"
        elif done > 0:
            text += (f", {rate:.3g} {self.unit}/s, about "
                     f"{format_duration((self.total - done) / rate)} left")
        log(text, self.quiet)
