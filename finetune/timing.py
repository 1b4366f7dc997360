"""How fast a run trains: the first step's time (it compiles the step) and the images per second
of the steps after it, for results.json and the benchmarks.

The device runs asynchronously, so the clock waits for the parameters of the first step and of
the last one (`jax.block_until_ready`) and for nothing in between: timing does not slow the run.
Images are counted at the expected batch size q N per step (the sampled sizes stay secret, as
in `finetune.print_progress`); views are not counted separately.
"""

from __future__ import annotations

import time

import jax

__all__ = ["StepClock"]


class StepClock:
    """Call `step_done(state)` after each step, then `compile_seconds` and
    `images_per_second(expected_batch)` (None until two steps are done)."""

    def __init__(self):
        self._start = time.perf_counter()
        self._first_end: float | None = None
        self._last_end: float | None = None
        self._steps = 0

    def step_done(self, state, *, last: bool = False) -> None:
        """After a step; `last`: the run's final step (the clock waits for its results)."""
        self._steps += 1
        if self._steps == 1 or last:
            jax.block_until_ready(state)
            now = time.perf_counter()
            if self._steps == 1:
                self._first_end = now
            self._last_end = now

    @property
    def compile_seconds(self) -> float | None:
        """The first step's wall time: compiling the step and running it once."""
        return None if self._first_end is None else self._first_end - self._start

    def images_per_second(self, expected_batch: float) -> float | None:
        """`expected_batch` images per step over the steps after the first."""
        if self._steps < 2 or self._last_end is None:
            return None
        return (self._steps - 1) * expected_batch / max(self._last_end - self._first_end, 1e-9)
