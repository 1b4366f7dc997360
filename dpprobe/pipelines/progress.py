"""Progress lines for long work whose units finish in a few large calls (the audit's compiled
batches of runs): done / total, the rate, and the time left, on stderr."""

from __future__ import annotations

import time

from dpprobe.pipelines.reporting import log

__all__ = ["RateProgress", "format_duration"]


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
