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

import json
import os
from pathlib import Path

import jax
import numpy as np

from finetune.specs import TrainState

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

    def save(self, state: TrainState, keys: jax.Array, rng: np.random.Generator, *,
             force: bool = False) -> bool:
        """Save `state` if its step is a multiple of `every` (or `force`); returns whether it
        saved."""
        if not force and state.step % self.every:
            return False
        ocp = self._ocp
        arrays = {"params": state.params, "opt_state": state.opt_state, "ema": state.ema,
                  "keys": np.asarray(jax.random.key_data(keys))}
        meta = {"step": int(state.step), "config": self.config,
                "sampler": _json_ints(rng.bit_generator.state)}
        self._manager.save(state.step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()
        return True

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
