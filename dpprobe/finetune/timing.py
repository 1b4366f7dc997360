"""How fast a run trains: the first step's time (it compiles the step) and the images per second
of the steps after it, for the owner's timing file and the benchmarks (`StepClock`); the
progress lines a run prints on stderr (`print_progress`).

Timings depend on the private records (a record that decodes or trains slowly slows the run),
so they are never published: the job writes them to the owner's timing file
(`dpprobe.timings`), and the progress lines are the operator's terminal (off with `--quiet`);
neither is covered by the privacy guarantee.

The device runs asynchronously, so the clock waits for the parameters of the first step and of
the last one (`jax.block_until_ready`) and for nothing in between: timing does not slow the run.
Images are counted at the expected batch size q N per step (the sampled sizes stay secret, as
in `finetune.print_progress`); views are not counted separately.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax

__all__ = ["StepClock", "print_progress"]


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


def print_progress(total_steps: int, expected_batch: float, views: int,
                   epsilon_at: Callable[[int], float] | None = None, *, first_step: int = 0,
                   every: int | None = None, stream=None):
    """A `progress` callback: one line per `every` steps (about 20 lines in all) with the
    throughput and, if given, the epsilon spent so far (`epsilon_at(steps)`).

    The throughput counts the *expected* batch size q N (times K views) per step: the sampled
    sizes are kept secret (revealing them is not covered by the accounting). The first step's
    line says how long it took: it includes compiling the step (about 46 s for a ViT on a
    CPU), which would otherwise pass in silence."""
    every = every or max(1, total_steps // 20)
    stream = stream or sys.stderr  # the one in use now, not the one at import
    start = time.perf_counter()
    first = [True]

    def report(step: int):
        if first[0]:  # the first step compiles the training step: say how long that took
            first[0] = False
            print(f"step {step}/{total_steps} took {time.perf_counter() - start:.1f} s "
                  "(it compiled the training step; later steps reuse it)", file=stream,
                  flush=True)
        if step % every and step != total_steps:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        rate = (step - first_step) * expected_batch * views / seconds
        spent = f"  epsilon spent {epsilon_at(step):.3f}" if epsilon_at else ""
        print(f"step {step}/{total_steps}  {rate:.0f} img/s (expected batch){spent}",
              file=stream, flush=True)

    return report
