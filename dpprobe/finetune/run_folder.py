"""A job's output folder (`finetune --out DIR`): checked before the job reads its data, and
written by one run at a time.

dpprobe never changes a file it did not create. DIR may be a new path or a folder, but not the
data the job reads nor a folder inside it (the job's files would become records of an image
folder); a `DIR/checkpoint` that dpprobe did not write is refused (the job deletes its
checkpoint folder once the run is complete). One run writes DIR at a time: an flock on
`DIR/.dpprobe-JOB.lock`, holding the run's pid; the kernel releases it when the process dies
(SIGKILL included), so a killed run's lock is stale and the rerun takes it. A finished run
keeps its options beside its results (`OPTIONS_FILE`): a rerun with the same ones is already
complete, one with others is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from dpprobe.extract import parse_data_spec
from dpprobe.finetune.own_model import own_module_name

__all__ = ["OPTIONS_FILE", "check_checkpoint_folder", "check_outside_inputs", "finished_run",
           "hold", "input_paths", "run_options"]

# In a finished run's DIR: the options it ran with (private to its owner: they hold the seed).
OPTIONS_FILE = ".dpprobe-finetune-options.json"

# The names of a checkpoint folder's entries: a step, a step being written (orbax), the space
# a checkpoint reserves (`finetune.Checkpointer`).
_CHECKPOINT_ENTRY = re.compile(r"\d+(\.orbax-checkpoint-tmp.*)?|\.dpprobe-space-.*")


def check_outside_inputs(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None],
                         option: str = "out") -> None:
    """Refuse an output folder that is one of the job's inputs or lies inside one."""
    target = os.path.realpath(out)
    for path in inputs:
        if not path:
            continue
        real = os.path.realpath(path)
        if target == real or target.startswith(real.rstrip(os.sep) + os.sep):
            raise ValueError(f"`{option}` {os.fspath(out)} is {'' if target == real else 'inside '}"
                             f"the data {os.fspath(path)}; choose a folder outside the data")


def check_checkpoint_folder(folder: str | os.PathLike, option: str = "out") -> None:
    """Refuse a checkpoint folder that holds anything but a checkpoint's steps (the job deletes
    the folder when its run is complete)."""
    if not os.path.lexists(folder):
        return
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise ValueError(f"`{option}`: {os.fspath(folder)} exists and is not a checkpoint folder "
                         "dpprobe wrote; choose another `out`")
    foreign = sorted(n for n in os.listdir(folder) if not _CHECKPOINT_ENTRY.fullmatch(n))
    if foreign:
        raise ValueError(f"`{option}`: {os.fspath(folder)} holds {foreign[0]}, which dpprobe did "
                         "not write (the job deletes its checkpoint folder when done); choose "
                         "another `out`")


@contextlib.contextmanager
def hold(out: str | os.PathLike, job: str, option: str = "out") -> Iterator[None]:
    """Hold `out` for one run of `job` (creating the folder); another run is refused in one line.
    A folder this call created is removed again if the run leaves nothing in it."""
    created = not os.path.lexists(out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f".dpprobe-{job}.lock")
    handle = open(path, "a+")  # noqa: SIM115 - held for the run's lifetime
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ValueError(f"`{option}` {os.fspath(out)} is being written by {holder} (another "
                             f"{job} run); wait for it to finish, or give another `{option}`"
                             ) from None
        except OSError as err:  # a filesystem without flock: run unlocked
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        if created and os.listdir(out) == [os.path.basename(path)]:
            os.remove(path)
            os.rmdir(out)
        handle.close()


def input_paths(config) -> list[str]:
    """The local files and folders a finetune job reads (its output must not be, nor lie in,
    one).

    Args:
      config: the job's `FinetuneConfig` (its data specs, data folder and weights file).

    Returns:
      The paths that exist, without an `?option` tail.
    """
    paths = [config.data_dir, config.weights]
    for spec in (config.data, config.test_data):
        try:
            paths.append(parse_data_spec(spec)[1] if spec else None)
        except ValueError:
            pass  # refused by the reader, in its own words
    return [p.partition("?")[0] for p in paths if p and os.path.exists(p.partition("?")[0])]


def run_options(config) -> dict:
    """The options that make a run what it is (not where it writes, not how much it prints).

    Args:
      config: the job's `FinetuneConfig`.

    Returns:
      Its fields as JSON values, `out` and `quiet` None, an own module named by its class.
    """
    config = dataclasses.replace(config, model=own_module_name(config.model))
    return json.loads(json.dumps(dataclasses.asdict(config) | {"quiet": None, "out": None},
                                 default=str))


def finished_run(out: Path, config) -> dict | None:
    """The finished run in `out`, when it ran with `config`'s options.

    Args:
      out: the run folder.
      config: the job's `FinetuneConfig`.

    Returns:
      Its results with "already_complete" (the results file); None when `out` holds no
      finished run. A finished run with other options is refused (one line).
    """
    results_file = out / "results.json"
    if not results_file.is_file():
        return None
    try:
        results = json.loads(results_file.read_text())
        finished = results.get("job") == "finetune"
    except (OSError, ValueError, AttributeError):
        return None  # not a run of ours: the output checks refuse it
    if not finished:
        return None
    try:
        previous = json.loads((out / OPTIONS_FILE).read_text())
    except (OSError, ValueError):
        previous = None
    options = run_options(config)
    if previous != options:
        differ = ("" if not isinstance(previous, dict) else " (differs in: " + ", ".join(
            sorted(k for k in set(previous) | set(options)
                   if previous.get(k) != options.get(k))) + ")")
        hint = ""
        if isinstance(previous, dict) and previous.get("model") and config.model is None:
            hint = (f" (that run trained model {previous['model']}, and a run naming no model "
                    f"now gets the default for its image size: add `--model "
                    f"{previous['model']}` for that run)")
        raise ValueError(f"{out} holds a finished finetune run with other options{differ}; "
                         f"give a new `out` to train another model{hint}")
    return results | {"already_complete": str(results_file)}
