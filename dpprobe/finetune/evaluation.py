"""Evaluation of a fine-tuned model: its logits on images in padded batches, and its accuracy.

The job's evaluation (`evaluate_model`) and a released model's predictions (`dpmodel`) both
compute logits with `iter_logits`, one compiled program for batches of `EVAL_BATCH_SIZE` rows
from the first row on, so that a released model predicts, on the same images, the classes its
job scored.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpprobe.dp.sampling import pad_rows
from dpprobe.finetune.graph_key import graph_key, graph_of

__all__ = ["EVAL_BATCH_SIZE", "evaluate_model", "iter_logits", "normalize_images"]

# Images per compiled evaluation call (speed and memory only).
EVAL_BATCH_SIZE = 256


def normalize_images(images, mean: tuple[float, ...], std: tuple[float, ...]) -> jax.Array:
    """The model's input: uint8 images scaled to [0, 1] (float images as they are), then
    (x - mean) / std per channel (public constants)."""
    x = images.astype(jnp.float32)
    if images.dtype == jnp.uint8:
        x = x / 255.0
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


@functools.partial(jax.jit, static_argnames=("graphdef", "mean", "std"))
def _batch_logits(graphdef, params, rest, images, *, mean, std):
    return nnx.merge(graph_of(graphdef), params, rest)(normalize_images(images, mean, std))


def iter_logits(model: nnx.Module, images, *, mean: tuple[float, ...], std: tuple[float, ...],
                batch_size: int = EVAL_BATCH_SIZE) -> Iterator[np.ndarray]:
    """Float32 logits of `model` on `images` (uint8 or float NHWC), batch by batch.

    Every batch is padded to `batch_size` rows, so one compiled program serves all; the job's
    evaluation (`evaluate_model`) and a released model's predictions (`dpmodel`) both call
    this, so that they compute the same logits for the same rows.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    graphdef = graph_key(graphdef)  # hashed once, not per batch
    mean, std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    for start in range(0, len(images), batch_size):
        x, mask = pad_rows(images[start:start + batch_size], rows=batch_size)
        logits = _batch_logits(graphdef, params, rest, x, mean=mean, std=std)
        yield np.asarray(logits)[:int(mask.sum())]


def evaluate_model(model: nnx.Module, images, labels, spec, *,
                   batch_size: int = EVAL_BATCH_SIZE) -> float:
    """Top-1 accuracy of `model` on (public) images and labels, in padded batches
    (`iter_logits`; ties go to the lower class index)."""
    labels = np.asarray(labels)
    correct, start = 0, 0
    for logits in iter_logits(model, images, mean=spec.mean, std=spec.std,
                              batch_size=batch_size):
        correct += int(np.sum(np.argmax(logits, -1) == labels[start:start + len(logits)]))
        start += len(logits)
    return correct / len(labels)


