"""Training across processes (`jax.distributed`, one process per host): which rows each process
holds, the one sum over processes of their clipped sums, and the randomness every process must
share (the noise keys: `dp.make_keys`; the batch sampler: `shared_generator`).

The layout of a multi-process step: process i holds the contiguous rows `process_rows(N)` of
the N rows (every row in exactly one process), computes the clipped sum of its own rows, and
`sum_over_processes` adds the partial sums (an all-reduce over Gloo on CPUs, NCCL on GPUs).
Every process then adds the same noise (keys drawn on process 0 from OS entropy and broadcast)
to the same total, so every process holds the same model, and the noise is drawn once: the
mechanism is the single-process one, with the rows' sum computed in another order.

Formal guarantee:
  Each row lies in exactly one process's slice and is clipped there, so it moves the total by at
  most C (the sum over processes adds each partial sum once); the noise N(0, (sigma C)^2 I) is
  added once, after the sum, from keys shared by every process, and the Poisson batch of each
  step is drawn once, by a generator every process seeds with the same secret seed (OS entropy on
  process 0, broadcast). A multi-process run is therefore exactly the `DpEvent` of its plan.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["local_batches", "process_rows", "shared_generator", "sum_over_processes"]


def process_rows(total: int, index: int | None = None, count: int | None = None
                 ) -> tuple[int, int]:
    """[start, stop): the contiguous rows of `total` that process `index` of `count` holds
    (default: this process of this job); sizes differ by at most one row."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    return index * total // count, (index + 1) * total // count


def _sum_leading(tree):
    return jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), tree)


def sum_over_processes(tree: Any) -> Any:
    """The leafwise sum over every process of the job of `tree` (arrays of the same shapes and
    dtypes on every process), the same on every process; `tree` itself in a one-process job.

    One all-reduce per leaf (`multihost_utils.broadcast_one_to_all`'s pattern, with every
    process contributing): each process's leaf becomes one row of a global array sharded over
    the processes, and a compiled sum over that axis is replicated back to all of them (the
    all-reduce hands every process the same bits:
    `tests/pipelines/test_processes.py` checks the models of 2 and 3 processes bit for
    bit). Dtypes are kept: float64 partial sums add in float64."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec

    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = jax.sharding.Mesh(devices, ("processes", "local"))
    tree = jax.tree.map(np.asarray, tree)  # Python numbers too (a row count)
    wide = any(leaf.dtype.itemsize == 8 for leaf in jax.tree.leaves(tree))
    with jax.enable_x64(wide):  # float64 partial sums stay float64
        stacked = jax.tree.map(
            lambda x: multihost_utils.host_local_array_to_global_array(
                x[None], mesh, PartitionSpec("processes")), tree)
        with jax.set_mesh(mesh):
            total = jax.jit(_sum_leading, out_shardings=PartitionSpec())(stacked)
        return jax.tree.map(lambda x: jnp.asarray(x.addressable_data(0)), total)


def shared_generator() -> np.random.Generator:
    """A NumPy generator seeded from OS entropy, the same seed on every process of the job
    (process 0's, broadcast): every process then draws the same Poisson batches. Secret like
    the noise keys (a seed printed would make the batches public)."""
    seed = np.frombuffer(os.urandom(16), np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        seed = np.asarray(multihost_utils.broadcast_one_to_all(seed))
    return np.random.default_rng(seed)


def local_batches(index: np.ndarray, mask: np.ndarray, start: int, stop: int,
                  physical_batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The rows of one step's physical batches (`index`, `mask`: (batches, p), as
    `dp.poisson_batches` cuts them) that lie in [start, stop), packed again into physical
    batches of p rows, the last one padded (index `start`, mask 0); at least one batch, so that
    a process whose rows were not sampled still adds its (zero) part to the sum."""
    rows = index[(mask > 0) & (index >= start) & (index < stop)]
    p = physical_batch_size
    count = max(1, -(-len(rows) // p))
    packed = np.full(count * p, start, np.int64)
    packed[:len(rows)] = rows
    valid = np.zeros(count * p, np.float32)
    valid[:len(rows)] = 1.0
    return list(zip(packed.reshape(count, p), valid.reshape(count, p), strict=True))
