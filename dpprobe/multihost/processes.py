"""A probe or finetune job run as several processes (one per host): `--coordinator HOST:PORT
--num-processes N --process-id I`, its start (`jax.distributed.initialize`, CPU collectives over
Gloo), who writes the outputs, and how a job whose process died ends.

Decisions:
  * Process i holds only its rows (`dp.distributed.process_rows`: contiguous, sizes within one
    row of each other); the in-memory probe pads them with null rows to the same count on every
    process. Every process adds the same noise, once, to the sum over processes.
  * Only process 0 writes outputs (results, CSV, plot, models, diagnostics) and prints the
    table; the others write and print nothing (`writer_config`), so outputs never race. Every
    process holds the same model (the same sums, the same noise keys from process 0).
  * A process that stops ends the job, never a hang: a collective with it fails at once
    ("connection reset"), and a watchdog thread in every process (`_watch`: heartbeats in the
    coordinator's key-value store) ends a process whose peer has not answered for
    `process_timeout` seconds while it computes, reads or writes outside a collective. Either
    way each process prints one line naming itself (`fail`) and exits with status `EXIT_LOST`,
    skipping JAX's shutdown barrier (which would wait for the dead process). The coordination
    service runs in a process of its own (`pipelines/coordinator.py`), so that process 0's
    death does not take it down with it: JAX would then abort every other process with a page
    of C++ log before any line of ours.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time

__all__ = ["EXIT_LOST", "ProcessConfig", "active", "check_rows", "count", "describe_failure",
           "fail", "is_writer", "name_command", "start", "writer_config"]

# Exit status of a process whose job lost another process (a bad input is 2).
EXIT_LOST = 1

_lock = threading.Lock()
_started: dict = {}
_command: dict = {}
_exiting = threading.Event()  # set when this process starts leaving (JAX's shutdown barrier)
_stop = threading.Event()  # set when it has passed the barrier: the watchdog stops
_ALIVE = "dpprobe/alive/"  # the watchdog's keys in the coordinator's key-value store


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """The process layout of a job (the fields its config shares with this one)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    process_timeout: int = 60

    @classmethod
    def of(cls, config) -> ProcessConfig:
        return cls(config.coordinator, config.num_processes, config.process_id,
                   config.process_timeout)

    @property
    def multi(self) -> bool:
        return self.coordinator is not None or (self.num_processes or 1) > 1


def start(config) -> None:
    """Join the job's processes when `config` asks for several (`coordinator` or
    `num_processes` > 1): `jax.distributed.initialize` with CPU collectives over Gloo, before
    JAX starts a backend, then the watchdog (`_watch`). A job that is already started with the
    same layout is left as is."""
    layout = ProcessConfig.of(config)
    if not layout.multi:
        return
    import jax
    from jax._src import distributed

    with _lock:
        if _started:
            if _started["layout"] != layout:
                raise ValueError(f"this process already runs as {_started['layout']}")
            return
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _started["layout"] = layout
        timeout = layout.process_timeout
        heartbeat = 3 * timeout + 10  # JAX's own check (an abort, a page of C++ log) after ours
        shutdown = max(300, heartbeat)  # at exit, the others wait this long for process 0
        try:
            with _service_outside(layout, heartbeat, shutdown):
                jax.distributed.initialize(
                    coordinator_address=layout.coordinator, num_processes=layout.num_processes,
                    process_id=layout.process_id, initialization_timeout=timeout,
                    heartbeat_timeout_seconds=heartbeat,
                    shutdown_timeout_seconds=shutdown)
        except Exception as err:  # the others did not come within the timeout, a bad address
            _started.clear()
            raise RuntimeError(f"could not join the job's processes at {config_address()} "
                               f"within {timeout} s: {_first_line(err)}") from err
        _started["count"] = jax.process_count()
        _started["name"] = f"process {jax.process_index()} of {jax.process_count()}"
        watchdog = threading.Thread(target=_watch, name="dpprobe-watchdog", daemon=True, args=(
            distributed.global_state.client, jax.process_index(), jax.process_count(), timeout))
        watchdog.start()
        atexit.register(_leave)  # before JAX's own exit handler (atexit runs last first)


def _leave() -> None:
    """At exit: JAX's shutdown barrier (every process waits for the others to finish, process
    0 writing the outputs), watched by the watchdog, which stops once it is passed."""
    import jax

    _exiting.set()
    jax.distributed.shutdown()
    _stop.set()


@contextlib.contextmanager
def _service_outside(layout: ProcessConfig, heartbeat: int, shutdown: int):
    """On process 0 (given `coordinator`, `num_processes` and `process_id`): run the job's
    coordination service in its own process (`multihost.coordinator`), which outlives this
    one, and have `jax.distributed.initialize` start none here. Elsewhere: nothing."""
    if layout.process_id != 0 or layout.coordinator is None or layout.num_processes is None:
        yield
        return
    from jax._src import distributed

    port = layout.coordinator.rsplit(":", 1)[1]
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")
    helper = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "coordinator.py"), bind,
         str(layout.num_processes), str(heartbeat), str(shutdown),
         str(layout.process_timeout + 5)],  # a script: it imports jaxlib only
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    if helper.stdout.readline().strip() != b"ready":
        helper.wait()
        raise RuntimeError(f"the coordination service could not start on {bind} (exit status "
                           f"{helper.returncode}; is the port taken?)")
    make_service = distributed._jax.get_distributed_runtime_service
    distributed._jax.get_distributed_runtime_service = lambda *args, **kwargs: _NoService()
    try:
        yield
    finally:
        distributed._jax.get_distributed_runtime_service = make_service


class _NoService:
    """What JAX holds as process 0's service when it runs in `multihost.coordinator`."""

    def shutdown(self) -> None:
        pass


def _watch(client, index: int, count: int, timeout: float) -> None:
    """Every second, count up this process's key in the coordinator's key-value store and read
    the others': a process whose count stays put for `timeout` seconds, or a coordinator that
    does not answer, ends this process (`fail`). A collective with a dead process fails at once
    by itself; this catches a process that is computing, reading or writing meanwhile."""
    last: dict[str, tuple[str | None, float]] = {}
    beat = 0
    while not _stop.is_set():
        beat += 1
        try:
            client.key_value_set(f"{_ALIVE}{index}", str(beat), allow_overwrite=True)
            values = dict(client.key_value_dir_get(_ALIVE))
        except Exception as err:  # noqa: BLE001 - any failure to reach the coordinator
            if _exiting.is_set():  # the job may have ended: the barrier says if it did not
                return
            fail(f"lost contact with the coordinator at {config_address()} "
                 f"({_first_line(err)}): process 0 stopped or cannot be reached")
        now = time.monotonic()
        for other in range(count):
            key = f"{_ALIVE}{other}"
            value = values.get(key)
            if key not in last or last[key][0] != value:
                last[key] = (value, now)
            elif now - last[key][1] > timeout and not _stop.is_set():
                fail(f"process {other} has not answered for {timeout} s: it stopped or hangs")
        _stop.wait(1.0)


def config_address() -> str:
    layout = _started.get("layout")
    return layout.coordinator if layout and layout.coordinator else "the coordinator"


def _first_line(err) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__


def active() -> bool:
    """Whether this process is one of several of a started job."""
    return bool(_started.get("name"))


def count() -> int:
    """The processes of this job (1 unless started as several)."""
    return _started["count"] if active() else 1


def check_rows(num_examples: int) -> None:
    """Every process of the job must hold at least one row (N and the count are public)."""
    if num_examples < count():
        raise ValueError(f"{num_examples} rows cannot be split over {count()} processes")


def is_writer() -> bool:
    """Whether this process writes the job's outputs: process 0 of a multi-process job."""
    if not active():
        return True
    import jax

    return jax.process_index() == 0


def writer_config(config, fields: tuple[str, ...]):
    """`config` on process 0; on the others, with the output `fields` unset and quiet."""
    if is_writer():
        return config
    return dataclasses.replace(config, **dict.fromkeys(fields), quiet=True)


def describe_failure(err: BaseException, message: str) -> tuple[str, int]:
    """(the line, the exit status) of a multi-process job's error `err` (`message`: its line):
    a failed collective means that another process stopped (status `EXIT_LOST`); any other
    error is this process's own (status 2, as for one process)."""
    if any(word in message for word in ("Gloo", "gloo", "Connection reset", "Connection closed",
                                        "heartbeat")):
        return f"another process of the job stopped ({message})", EXIT_LOST
    return message, 2


def fail(message: str, code: int = EXIT_LOST, command: str | None = None) -> None:
    """Print `dpprobe COMMAND: error: process i of N: message` once and leave now: JAX's exit
    handler would wait at the shutdown barrier for a process that is gone."""
    with _lock:
        name = _started.get("name", "process ?")
        command = command or _command.get("name") or ""
        try:
            sys.stdout.flush()
            print(f"dpprobe{' ' + command if command else ''}: error: {name}: {message}",
                  file=sys.stderr, flush=True)
        finally:
            os._exit(code)


def name_command(command: str) -> None:
    """The command named in `fail`'s line (the CLI's)."""
    _command["name"] = command
