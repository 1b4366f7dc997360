"""The one way dpprobe writes a progress or warning line for people: on stderr, flushed, so
that it interleaves with the results on stdout in the order it happened. The library's long
steps (the private search, `probe.search_steps`) and the commands (`pipelines.reporting`)
share it."""

from __future__ import annotations

import math
import sys

__all__ = ["format_epsilon", "log"]


def log(message: str, quiet: bool = False) -> None:
    """A progress or warning line on stderr, unless `quiet`.

    Args:
        message: the line, without its newline.
        quiet: write nothing (the jobs' `quiet` field).
    """
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def format_epsilon(value) -> str:
    """An epsilon for people: 'inf (no guarantee)' when infinite."""
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return "inf (no guarantee)"
    return f"{value:.4g}"
