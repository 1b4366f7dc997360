"""Which rows each step sees: Poisson batch selection, and one pad-and-mask helper.

Every compiled kernel takes a fixed number of rows; a short chunk or batch is padded with zero
rows whose mask is 0 (a masked row contributes nothing to any sum, so padding never changes a
result or a guarantee).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["PoissonStep", "pad_rows", "poisson_batches"]


def pad_rows(*arrays, rows: int):
    """Pad each array's leading axis with zeros to `rows` rows; returns (*padded, mask) where
    mask (rows,) float32 is 1 on the given rows and 0 on the padding. The arrays must have the
    same number of rows, at most `rows`."""
    count = len(arrays[0])
    if any(len(a) != count for a in arrays):
        raise ValueError(f"arrays have different row counts: {[len(a) for a in arrays]}")
    if count > rows:
        raise ValueError(f"{count} rows exceed the block size {rows}")
    mask = np.zeros((rows,), np.float32)
    mask[:count] = 1.0
    padded = []
    for array in arrays:
        array = np.asarray(array)
        if count < rows:
            array = np.concatenate([array, np.zeros((rows - count, *array.shape[1:]),
                                                    array.dtype)])
        padded.append(array)
    return (*padded, mask)


class PoissonStep(NamedTuple):
    """One step's physical batches for every run: `index` (batches, runs, p) row indices and
    `mask` (batches, runs, p) 0/1 (padding rows point at row 0 with mask 0), and `sizes` (runs,)
    the logical batch sizes (private: never published)."""

    index: np.ndarray
    mask: np.ndarray
    sizes: np.ndarray


def poisson_batches(num_examples: int, rates: Sequence[float], steps: Sequence[int],
                    physical_batch_size: int, rng: np.random.Generator | None = None
                    ) -> Iterator[PoissonStep]:
    """Per step, the Poisson-sampled logical batch of each run, cut into physical batches.

    Formal guarantee:
      At each of its steps, run r's batch includes every row independently with probability
      `rates[r]`, independently across steps and runs; a run with fewer steps than the longest gets
      empty batches afterwards (`jax_privacy.batch_selection.CyclicPoissonSampling` with cycle
      length 1; Beltran et al. 2024, https://arxiv.org/abs/2406.17298, Lemma 1). Cutting a batch
      into physical batches (the last one padded and masked) changes nothing in that distribution.

    Args:
      num_examples: N (public).
      rates: q of each run, in (0, 1].
      steps: T of each run.
      physical_batch_size: p, rows per compiled call; each step has max_r ceil(B_r / p)
        physical batches (at least 1).
      rng: None (the private choice) seeds a generator from OS entropy; a seeded generator
        makes the batches public: for tests only.
    """
    # Imported here: jax_privacy's __init__ loads its accountants, auditing and SciPy, which
    # full-batch jobs never need (see benchmarks/startup.py).
    from jax_privacy import batch_selection

    if physical_batch_size < 1:
        raise ValueError(f"physical_batch_size must be >= 1, got {physical_batch_size}")
    rng = np.random.default_rng() if rng is None else rng  # OS entropy
    iterators = [
        batch_selection.CyclicPoissonSampling(sampling_prob=float(q), iterations=int(t))
        .batch_iterator(num_examples, rng)
        for q, t in zip(rates, steps, strict=True)
    ]
    p = physical_batch_size
    for _ in range(max(steps)):
        chosen = [next(it, np.zeros((0,), np.int64)) for it in iterators]
        sizes = np.array([len(rows) for rows in chosen], np.int64)
        num_batches = max(1, -(-int(sizes.max()) // p))
        index = np.zeros((num_batches, len(chosen), p), np.int64)
        mask = np.zeros((num_batches, len(chosen), p), np.float32)
        for r, rows in enumerate(chosen):
            padded, row_mask = pad_rows(rows.astype(np.int64), rows=num_batches * p)
            index[:, r], mask[:, r] = padded.reshape(num_batches, p), row_mask.reshape(
                num_batches, p)
        yield PoissonStep(index, mask, sizes)
