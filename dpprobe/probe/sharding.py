"""Data parallelism for the in-memory trainer: rows sharded over a 1-D device mesh.

The clipped sum is a sum over rows, so each device sums its own rows and XLA reduces the
partial sums across devices (the mesh's axes are automatic, compiler-chosen); the noise is then
added once, to the reduced sum, exactly as on one device. The partial sums and their reduction
are float64 (`dp.accumulate`): with D devices one row moves the computed sum by at most
C (1 + 1e-6) for N up to 3.4 x 10^9 / (D + 1).
"""

from __future__ import annotations

import jax
import numpy as np

from dpprobe.dp.sampling import pad_rows

__all__ = ["make_data_mesh", "shard_rows"]


def make_data_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh named "data" over the first `num_devices` devices (default: all)."""
    devices = jax.devices()[: num_devices or jax.device_count()]
    return _auto_mesh(jax.sharding.Mesh(np.array(devices), ("data",)))


def _auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def shard_rows(mesh: jax.sharding.Mesh, *arrays):
    """Pad rows to a multiple of the mesh size and shard them over its "data" axis.

    Returns the sharded arrays followed by a 0/1 row mask (padding rows are 0). In a
    multi-host job (`jax.distributed.initialize()`), pass each process's own rows (every
    process the same number): the global array is assembled with
    `jax.make_array_from_process_local_data`.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _auto_mesh(mesh)
    local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    rows = -(-len(arrays[0]) // local_devices) * local_devices
    out = []
    for array in pad_rows(*arrays, rows=rows):
        sharding = NamedSharding(mesh, PartitionSpec("data", *([None] * (array.ndim - 1))))
        out.append(jax.make_array_from_process_local_data(sharding, array))
    return out
