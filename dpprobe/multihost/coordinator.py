"""The coordination service of a multi-process job, in a small process of its own that process 0
starts (`multihost.processes.start`), so that it outlives process 0.

JAX runs the service inside process 0, and when process 0 dies every other process learns it
from the service's closed socket and aborts with a page of C++ log. Here the service stays up
for `linger` seconds after process 0 is gone, long enough for the others' watchdogs to see that
process 0 stopped answering and end them with one line; then it exits. It also exits that long
after a job that ended normally (its processes have left).

    python pipelines/coordinator.py BIND_ADDRESS NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S LINGER_S
"""

from __future__ import annotations

import os
import sys
import time


def main(bind: str, count: int, heartbeat: int, shutdown: int, linger: float) -> None:
    from jax._src.lib import _jax  # jaxlib only: no backend, no devices

    parent = os.getppid()
    service = _jax.get_distributed_runtime_service(  # noqa: F841 - serves while referenced
        bind, count, heartbeat_timeout=heartbeat, shutdown_timeout=shutdown)
    print("ready", flush=True)
    while os.getppid() == parent:  # process 0 is alive
        time.sleep(0.5)
    time.sleep(linger)
    os._exit(0)  # (the service's own shutdown would wait for processes that are gone)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
