"""Atomic checkpoints of a finetuning run, to resume it after a crash or a kill.

A checkpoint (orbax-checkpoint's `CheckpointManager`: each step is written to a temporary
directory and renamed into place when complete, so a kill mid-write leaves the previous one
intact) holds everything the run needs to go on exactly: parameters, optimizer state (with the
privatizer's step count), EMA, the step, the noise and augmentation keys, the batch sampler's
state, and the job's public configuration (a resume with another configuration is refused).

Formal guarantee: a resumed run continues the same run of the same `DpPlan`: it never re-spends the
budget (the steps done are not redone) and never reuses a noise draw (step t's noise is
`fold_in(noise_key, t)` for the saved key, and t only grows). The checkpoint holds secrets (the
noise key would let anyone subtract the noise from the released model): the directory is
created readable by its owner only, and the job removes it once the run is complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import jax
import numpy as np

from dpprobe.finetune.specs import TrainState

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves a run every `every` steps under `directory`, and finds the latest save."""

    def __init__(self, directory: str | os.PathLike, *, every: int, config: dict):
        import orbax.checkpoint as ocp  # ~1 s to import: only runs that checkpoint pay it

        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.every = every
        self.config = json.loads(json.dumps(config, default=str))
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                                 enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step: int) -> bool:
        """Whether the state after `step` steps is saved: a multiple of `every`."""
        return step % self.every == 0

    def save(self, state: TrainState, keys: jax.Array, rng: np.random.Generator, *,
             force: bool = False) -> bool:
        """Save `state` if it is `due` (or `force`); returns whether it saved. (The trainer
        asks `due` first: it builds the state's pytrees only for a save.)"""
        if not force and not self.due(state.step):
            return False
        ocp = self._ocp
        arrays = {"params": state.params, "opt_state": state.opt_state, "ema": state.ema,
                  "keys": np.asarray(jax.random.key_data(keys))}
        meta = {"step": int(state.step), "config": self.config,
                "sampler": _json_ints(rng.bit_generator.state)}
        self._reserve(sum(np.asarray(x).nbytes for x in jax.tree.leaves(arrays)))
        try:
            with _orbax_silenced():
                self._manager.save(state.step, args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
                    force=True)
                self._manager.wait_until_finished()
        except (OSError, ValueError) as err:  # orbax's own for a full disk (os_error_code=27)
            found = re.search(r"os_error_code='?(\d+)", str(err))
            code = int(found.group(1)) if found else getattr(err, "errno", None)
            why = os.strerror(code) if code else (str(err).strip().splitlines() or ["?"])[0]
            raise OSError(code or errno.EIO, f"cannot write the checkpoint of step {state.step} "
                          f"({why[:300]}); the last complete one is kept, and the same command "
                          "resumes from it", str(self.directory)) from err
        return True

    def _reserve(self, nbytes: int) -> None:
        """Refuse (OSError, in one line) a checkpoint the disk cannot take before orbax writes
        it: orbax's threads report a failed write with tracebacks, even after the error is
        caught. The space (the arrays' bytes and 1 MiB for metadata) is allocated in a
        temporary file, and freed."""
        fd, path = tempfile.mkstemp(prefix=".dpprobe-space-", dir=self.directory)
        try:
            os.posix_fallocate(fd, 0, nbytes + 2**20)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                return  # a filesystem that cannot reserve space: orbax's write tells
            raise OSError(err.errno, f"no room for a checkpoint of {nbytes + 2**20} bytes "
                          f"({err.strerror}); free space, or give another `out`",
                          str(self.directory)) from err
        finally:
            os.close(fd)
            os.remove(path)

    def restore(self, initial: TrainState):
        """The latest save as (state, keys, rng), with `initial` giving the pytree structure;
        None when there is none. Refuses (ValueError) a save of another configuration."""
        step = self.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        target = {"params": initial.params, "opt_state": initial.opt_state, "ema": initial.ema,
                  "keys": np.zeros((2, 2), np.uint32)}
        restored = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(jax.tree.map(_abstract, target)),
            meta=ocp.args.JsonRestore()))
        meta = restored["meta"]
        if meta["config"] != self.config:
            changed = sorted(k for k in set(meta["config"]) | set(self.config)
                             if meta["config"].get(k) != self.config.get(k))
            raise ValueError(f"{self.directory} holds a checkpoint of another run (differs in: "
                             f"{', '.join(changed)}); use another `out`, or the same options")
        arrays = restored["arrays"]
        rng = np.random.default_rng()
        rng.bit_generator.state = _python_ints(meta["sampler"])
        keys = jax.random.wrap_key_data(np.asarray(arrays["keys"], np.uint32))
        state = TrainState(arrays["params"], arrays["opt_state"], arrays["ema"], meta["step"])
        return state, keys, rng

    def close(self) -> None:
        self._manager.close()


@contextlib.contextmanager
def _orbax_silenced():
    """Orbax logs (absl) a failed write with its traceback from its threads, and a leftover
    temporary folder as a warning: the caller says it in one line instead."""
    logger = logging.getLogger("absl")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _abstract(x):
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype")
                                else x.dtype)


def _json_ints(tree):
    """The sampler's state with its big integers as strings (JSON readers cap integers)."""
    if isinstance(tree, dict):
        return {k: _json_ints(v) for k, v in tree.items()}
    return {"int": str(tree)} if isinstance(tree, int) and not isinstance(tree, bool) else tree


def _python_ints(tree):
    if isinstance(tree, dict):
        if set(tree) == {"int"}:
            return int(tree["int"])
        return {k: _python_ints(v) for k, v in tree.items()}
    return tree
