"""The streamed trainer's memory budget: how many runs share one pass over the store, and how
many rows one compiled chunk call holds.

Beyond the chunks read ahead, a streamed sweep of P runs over d features and C classes holds
  * the runs' state, about `STATE_BYTES_PER_PARAM` bytes per parameter ((d + 1) C per run):
    weights and biases, the optimizer state, the float64 clipped sum and its compensation, the
    float64 noise, the update, and the job's copy of the result (calibrated on the streamed
    job: benchmarks/probe_load.py);
  * one chunk call's working set, per row: the features (as read, float32, float64 for the
    sum's row reduction), `ROW_BYTES_PER_FEATURE` d, and for each of the P' runs summed in
    that call its logits, residuals and clipping weights, `ROW_BYTES_PER_LOGIT` P' C. P' is
    P, or, when every run of the group takes one step, the group's distinct clip norms (the
    first step sums once per clip norm: `probe.step.shared_start_sums`).

`plan_stream` splits the runs into consecutive groups whose state and chunk calls fit the
budget, each group streaming the store on its own (time linear in the runs: one pass per group
and step), and caps the rows per call at what the budget leaves (chunks are cut into pieces of
at most that many rows). Neither changes what a run computes: its clipped sums (up to the
summation order) and its noise (its own key) are the same in any group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dpprobe.probe.specs import DEFAULT_MEMORY_BUDGET, RunSpec

__all__ = ["DEFAULT_MEMORY_BUDGET", "MIN_ROWS", "StreamPlan", "plan_stream"]

STATE_BYTES_PER_PARAM = 96
ROW_BYTES_PER_FEATURE = 16
ROW_BYTES_PER_LOGIT = 32
# Rows per chunk call below which the budget no longer shrinks it (the per-call overhead
# would dominate); a group of one run gets at least this many, whatever the budget.
MIN_ROWS = 256


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """Consecutive run groups (each a `range` of run indices, streamed on its own) and the most
    rows one chunk call may hold."""

    groups: tuple[range, ...]
    max_rows: int


def _summed_runs(runs: Sequence[RunSpec]) -> int:
    """P': the runs one chunk call sums for (the distinct clip norms when all take one step)."""
    if max(r.plan.steps for r in runs) > 1:
        return len(runs)
    return len({r.plan.clip_norm for r in runs})


def plan_stream(runs: Sequence[RunSpec], dim: int, num_classes: int, *,
                budget: int = DEFAULT_MEMORY_BUDGET,
                chunk_rows: int | None = None) -> StreamPlan:
    """Groups of runs and rows per chunk call within `budget` bytes (the module docstring).

    Args:
      runs: the sweep's runs, in order.
      dim, num_classes: d and C (public).
      budget: bytes for the state and one chunk call (a soft bound: one run with `MIN_ROWS`
        rows is always allowed).
      chunk_rows: the rows the chunks arrive in (caps `max_rows`), if known.
    """
    if budget < 1:
        raise ValueError(f"memory budget must be >= 1 byte, got {budget}")
    per_run = STATE_BYTES_PER_PARAM * (dim + 1) * num_classes
    rows = MIN_ROWS if chunk_rows is None else min(MIN_ROWS, chunk_rows)

    def fits(size: int) -> bool:
        group = runs[:size]  # the first `size` runs stand for any group of that size
        call = rows * (ROW_BYTES_PER_FEATURE * dim
                       + ROW_BYTES_PER_LOGIT * _summed_runs(group) * num_classes)
        return size * per_run + call <= budget

    size = len(runs)
    if not fits(size):  # the largest size that fits (bisection: `fits` is monotone)
        low, high = 1, size
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        size = low
    count = -(-len(runs) // size)
    size = -(-len(runs) // count)  # equal groups
    groups = tuple(range(start, min(start + size, len(runs)))
                   for start in range(0, len(runs), size))
    summed = max(_summed_runs(runs[g.start:g.stop]) for g in groups)
    left = budget - size * per_run
    max_rows = max(MIN_ROWS, left // (ROW_BYTES_PER_FEATURE * dim
                                      + ROW_BYTES_PER_LOGIT * summed * num_classes))
    if chunk_rows is not None:
        max_rows = min(max_rows, chunk_rows)
    return StreamPlan(groups, int(max_rows))
