"""Leave the `dpprobe` process without tearing the interpreter down, once its work is written.

Tearing down an interpreter that has loaded JAX (its CPU client, thousands of modules) takes
time after every output is written. Measured gain (`benchmarks/startup.py`: a 40-run
full-batch `dpprobe probe` on 50k x 768, 7 alternating runs, medians, 2-core CPU): 0.20 s wall
and CPU of 1.43 s wall in all (an earlier 9-run measurement on Fashion-MNIST features: 0.26 s).
At the threshold: remove it when a measurement shows it saves less than 0.2 s.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

__all__ = ["leave"]


def leave(code: int) -> None:
    """Flush stdout and stderr, run the atexit handlers (JAX's, Ray's shutdown,
    multiprocessing's), then `os._exit(code)`. If a non-daemon thread is still alive, the
    normal exit, which joins it."""
    _flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # (private, but what the normal exit runs first)
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BrokenPipeError, ValueError):  # a closed pipe: said already
            stream.flush()
