"""Physical batches on the host side of the trainer (`finetune.train`): their rows' images,
how many go into one compiled call (`finetune.batch_sums.stacked_sums`), stacked, and their
placement on the device(s)."""

from __future__ import annotations

import math

import jax
import numpy as np

from dpprobe.finetune.specs import FinetuneFlags

__all__ = ["STACK_BYTES", "batch_rows", "batches_per_call", "placement", "stacked_rows"]

# The most bytes of images one compiled call takes (`batches_per_call`).
STACK_BYTES = 64 * 2**20


def batch_rows(images: np.ndarray, own: np.ndarray) -> np.ndarray:
    """The images of a physical batch's rows; a row past the real ones (a gradient canary's)
    reads a zero image, a public constant: its loss ignores it, and a real record's image
    (were it non-finite, it would null the canary rows) must not decide it."""
    picked = images[np.minimum(own, len(images) - 1)]
    picked[own >= len(images)] = 0
    return picked


def batches_per_call(flags: FinetuneFlags, expected_rows: float, row_bytes: int,
                     backend: str | None = None) -> int:
    """m, the physical batches one compiled call sums: `flags.batches_per_call`; else 1 on a
    CPU, where XLA runs the body of a loop 1.7x (book-keeping) to 7x (the plain gradient)
    slower than the same work at the top of a program (the small CNN's batch of 256: 32 vs
    56 ms, 31 vs 208 ms; README, "A step's physical batches in one compiled call"); else
    enough for a step's Poisson batch but in rare steps (its expected size q N plus four
    standard deviations, sqrt(q N) at most), within `STACK_BYTES` of images. Public: from q,
    N, p, the images' shape and the backend (`jax.default_backend()` when None)."""
    if flags.batches_per_call is not None:
        return flags.batches_per_call
    if (backend or jax.default_backend()) == "cpu":
        return 1
    p = flags.physical_batch_size
    need = math.ceil((expected_rows + 4 * math.sqrt(expected_rows) + 1) / p)
    return max(1, min(need, STACK_BYTES // max(1, p * row_bytes)))


def stacked_rows(images: np.ndarray, labels: np.ndarray, group, first: int, m: int):
    """The physical batches `group` ((index, mask) pairs of p global rows, at most m) as
    (m, p, ...) arrays: images (`batch_rows`, row `first` being this process's row 0),
    labels, mask and the global row index (int32). The slots past the group are zeros, which
    `stacked_sums` never reads."""
    n, p = len(group), len(group[0][0])
    index, mask = np.zeros((m, p), np.int64), np.zeros((m, p), np.float32)
    index[:n], mask[:n] = [i for i, _ in group], [k for _, k in group]
    own = index[:n].reshape(-1) - first
    stacked = np.empty((m * p,) + images.shape[1:], images.dtype)
    stacked[:n * p] = batch_rows(images, own)
    stacked[n * p:] = 0
    stacked_labels = np.zeros((m, p), labels.dtype)
    stacked_labels[:n] = labels[own].reshape(n, p)
    return (stacked.reshape((m, p) + images.shape[1:]), stacked_labels, mask,
            index.astype(np.int32))


def placement(flags: FinetuneFlags, axis: int = 0):
    """Puts a physical batch (or a stack of them, its batch `axis` 1) on the device(s): split
    over a "data" mesh axis when `flags.devices` > 1 (XLA then sums each device's clipped
    gradients across devices)."""
    if flags.devices == 1:
        return lambda *arrays: arrays
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.local_devices()[: flags.devices]), ("data",))

    def place(*arrays):
        return tuple(jax.device_put(a, NamedSharding(mesh, PartitionSpec(
            *([None] * axis), "data", *([None] * (a.ndim - axis - 1))))) for a in arrays)

    return place
