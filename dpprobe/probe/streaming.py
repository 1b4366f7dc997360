"""Full-batch DP training with the clipped sum accumulated over row chunks streamed from disk.

The full-batch gradient is a sum over examples, so summing per-chunk clipped sums gives the
in-memory result (up to float summation order); the noise is added once per step, to the total
(`probe.step.dp_update`). Memory is O(rows_per_chunk (d + P C) + P d C), whatever N is, and
within a budget whatever P is: the runs are trained in groups that each stream the chunks, and
the chunks are cut into pieces of at most the rows the budget leaves (`probe.budget`). Each
chunk is its own input boundary: normalized, non-finite rows and labels outside [0, C)
nulled, padded to a fixed size and masked, inside one compiled kernel.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpprobe.dp.accumulate import add_parts, x64_jit
from dpprobe.dp.clipping import valid_labels, zero_nonfinite_rows
from dpprobe.dp.distributed import sum_over_processes
from dpprobe.dp.sampling import pad_rows
from dpprobe.probe.budget import plan_stream
from dpprobe.probe.clipping import clipped_grad_sum
from dpprobe.probe.normalization import normalize_features
from dpprobe.probe.specs import PerformanceFlags, ProbeSpec, RunSpec, TrainResult
from dpprobe.probe.step import (
    dp_update_jit,
    init_state_jit,
    result,
    run_arrays,
    shared_start_sums,
    step_bar,
)
from dpprobe.probe.train import check_full_batch, check_labels

__all__ = ["train_probe_streaming"]


def _prefetch(iterable: Iterable, depth: int) -> Iterator:
    """Iterate `iterable` in a background thread, `depth` items ahead (I/O overlaps compute)."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def worker():
        try:
            for item in iterable:
                items.put(item)
        except BaseException as err:  # re-raised in the consumer
            items.put(err)
        items.put(done)

    threading.Thread(target=worker, daemon=True).start()
    while (item := items.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def _padded_chunks(chunks: Iterable, rows: int | None, max_rows: int):
    """Each (features, labels) chunk cut into pieces of at most `rows` rows (default: the
    first chunk's, at most `max_rows`), each padded to `rows` rows."""
    for features, labels in chunks:
        labels = check_labels(labels).astype(np.int32)
        features = np.asarray(features)
        if not rows:
            if not len(labels):
                continue
            rows = min(len(labels), max_rows)
        for start in range(0, len(labels), rows):
            yield pad_rows(features[start:start + rows], labels[start:start + rows], rows=rows)


@functools.partial(x64_jit, static_argnames=("spec",))
def _chunk_sums(params, features, labels, mask, clip, *, spec):
    """Clipped sums of one padded chunk. Normalize first: a finite but huge row can normalize
    to NaN, which the zeroing then catches."""
    features = normalize_features(features.astype(jnp.float32), spec.normalization,
                                  groups=spec.groups)
    features, mask = zero_nonfinite_rows(features, mask)
    mask = mask * valid_labels(labels, spec.num_classes)
    onehot = jax.nn.one_hot(labels, spec.num_classes, dtype=jnp.float32)
    return clipped_grad_sum(params, features, onehot, clip, loss=spec.loss, mask=mask,
                            finite_rows=True)


def train_probe_streaming(
    chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
    runs: Sequence[RunSpec],
    keys: jax.Array,
    spec: ProbeSpec,
    *,
    num_examples: int,
    dim: int,
    flags: PerformanceFlags | None = None,
    progress: bool = False,
) -> TrainResult:
    """`probe.train_probe` with the rows streamed in chunks (stores larger than memory).

    Args:
      chunks: a callable returning a fresh iterable of (features, labels) row chunks (e.g.
        `extract.iter_split_chunks(store, "train")`); it is called once per step. In a
        multi-process job, this process's rows only (`dp.distributed.process_rows`): the
        chunks' clipped sums are added over processes before the noise.
      runs, keys, spec, progress: as for `train_probe`.
      num_examples: N (public; the chunks must hold exactly N rows in total).
      dim: feature dim d.
      flags: `rows_per_chunk`, `prefetch_depth` and `memory_budget` are used: the runs are
        trained in consecutive groups, each streaming the chunks, and each compiled chunk call
        holds at most the rows the budget leaves (`probe.budget.plan_stream`).

    Formal guarantee:
      As `train_probe`: each chunk's sum is float64 (`dp.accumulate.row_block_sum`), the
      chunks' sums are added with a compensated float64 sum (`dp.accumulate.add_parts`) and
      the total is noised in float64, so one row moves the computed sum by at most C (1 + 1e-6)
      for N up to 10^9, whatever the chunk size. Cutting chunks into pieces only lowers the
      rows R of one part in the bound of `dp.accumulate`. A run's mechanism does not depend on
      its group: its clipped sums are the same function of the rows and its parameters (up to
      summation order), and its noise is drawn from its own key at each step (`fold_in(key, t)`).
    """
    flags = flags or PerformanceFlags()
    check_full_batch(runs)
    plan = plan_stream(runs, dim, spec.num_classes, budget=flags.memory_budget,
                       chunk_rows=flags.rows_per_chunk)
    rows = min(flags.rows_per_chunk, plan.max_rows) if flags.rows_per_chunk else None
    parts = [_train_group(chunks, [runs[i] for i in group], keys[group.start:group.stop], spec,
                          num_examples=num_examples, dim=dim, rows=rows,
                          max_rows=plan.max_rows, depth=flags.prefetch_depth,
                          progress=progress)
             for group in plan.groups]
    if len(parts) == 1:
        return parts[0]
    return TrainResult({name: np.concatenate([p.params[name] for p in parts])
                        for name in parts[0].params},
                       np.concatenate([p.clipped_fraction for p in parts]))


def _train_group(chunks, runs, keys, spec, *, num_examples, dim, rows, max_rows, depth,
                 progress) -> TrainResult:
    """`train_probe_streaming` for one group of runs: every step streams the chunks once."""
    arrays = run_arrays(runs, keys, num_examples)
    state = init_state_jit(spec, arrays, dim)
    total = int(arrays.steps.max())

    def sum_fn(params, clip):  # one pass over the chunks
        sums, seen = None, 0
        for features, labels, mask in _prefetch(_padded_chunks(chunks(), rows, max_rows),
                                                depth):
            sums = add_parts(sums, _chunk_sums(params, features, labels, mask, clip, spec=spec))
            seen += int(mask.sum())
        sums, seen = sum_over_processes((sums.value(), seen))  # one process: unchanged
        if int(seen) != num_examples:  # public: the store's row count
            raise ValueError(f"the chunks held {seen} rows, expected {num_examples}")
        return sums

    with step_bar(total, progress, "probe steps (streamed)") as bar:
        for step in range(total):
            bar.wait_for(f"step {step + 1}, reading the store"
                         + (" (the first compiles)" if step == 0 else ""))
            sums, num_clipped = (shared_start_sums(spec, arrays, dim, sum_fn) if step == 0
                                 else sum_fn(state.params, arrays.clip))
            state = dp_update_jit(spec, arrays, state, sums, num_clipped, step,
                                  arrays.denominator)
            bar.update(1)
    return result(state, arrays)
