"""The one way dpprobe writes a progress or warning line for people: on stderr, flushed, so
that it interleaves with the results on stdout in the order it happened. The library's long
steps (the private search, `probe.search_steps`) and the commands (`pipelines.reporting`)
share it."""

from __future__ import annotations

import sys

__all__ = ["log"]


def log(message: str, quiet: bool = False) -> None:
    """A progress or warning line on stderr, unless `quiet`.

    Args:
        message: the line, without its newline.
        quiet: write nothing (the jobs' `quiet` field).
    """
    if not quiet:
        print(message, file=sys.stderr, flush=True)
