"""A physical batch on the host side of the trainer (`finetune.train`): its rows' images and
their placement on the device(s)."""

from __future__ import annotations

import jax
import numpy as np

from finetune.specs import FinetuneFlags

__all__ = ["batch_rows", "placement"]


def batch_rows(images: np.ndarray, own: np.ndarray) -> np.ndarray:
    """The images of a physical batch's rows; a row past the real ones (a gradient canary's)
    reads a zero image, a public constant: its loss ignores it, and a real record's image
    (were it non-finite, it would null the canary rows) must not decide it."""
    picked = images[np.minimum(own, len(images) - 1)]
    picked[own >= len(images)] = 0
    return picked


def placement(flags: FinetuneFlags):
    """Puts a physical batch on the device(s): split over a "data" mesh axis when
    `flags.devices` > 1 (XLA then sums each device's clipped gradients across devices)."""
    if flags.devices == 1:
        return lambda *arrays: arrays
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.local_devices()[: flags.devices]), ("data",))

    def place(*arrays):
        return tuple(jax.device_put(a, NamedSharding(
            mesh, PartitionSpec("data", *([None] * (a.ndim - 1))))) for a in arrays)

    return place
