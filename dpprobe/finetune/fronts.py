"""Training a model with a fixed front on the front's output, computed once per image.

A model may read its images through a fixed `front` (`ScatterCNN`: a ScatterNet and a
GroupNorm; no parameters, no randomness, a function of one example), every parameter after
it, and read the front's output instead when its `on_features` is set. When nothing changes
the images between steps (one view, no crop, no flip), every step would recompute the same
front of the same images; `cached_front` computes it once for the training images, so the
trainer runs the model on those features. The result is the same computation, step for step
(the front's float32 output is what the model would feed the rest), at the cost of holding
the features in memory (Fashion-MNIST's ScatterNet: 60,000 x 7 x 7 x 81 float32, 0.95 GB; above
`CACHE_MAX_BYTES` they are not held). With augmentation the trainer runs the whole model each
step. One difference: with `--mixed-precision` the model run on images reads bfloat16 pixels
(the trainer casts its input), the cached front float32 ones, as evaluation does.

Formal guarantee: the map x_i -> front(normalize(x_i)) is a fixed function of example i alone,
so the training set maps record by record (a null record's non-finite image gives non-finite
features, still a null record; an image the front turns non-finite becomes one, as a
non-finite gradient would have made it). DP-SGD on the mapped set is the same mechanism,
`plan.dp_event()` for the same zero-out neighbours and public N.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from dpprobe.dp.sampling import pad_rows
from dpprobe.finetune.evaluation import normalize_images
from dpprobe.finetune.specs import FinetuneSpec

__all__ = ["CACHE_MAX_BYTES", "FRONT_BATCH", "cached_front", "front_features"]

FRONT_BATCH = 1024  # images per compiled call of the front (memory and speed only)
CACHE_MAX_BYTES = 8 * 2**30  # larger features are not held: the front then runs every step


def _has_fixed_front(model) -> bool:
    return callable(getattr(model, "front", None)) and getattr(model, "on_features", None) is False


@functools.partial(jax.jit, static_argnames=("front", "mean", "std"))
def _front_batch(images, *, front, mean, std):
    return front(normalize_images(images, mean, std))


def front_features(front: Callable, images: np.ndarray, spec: FinetuneSpec, *,
                   batch_size: int = FRONT_BATCH) -> np.ndarray:
    """float32 `front(normalize_images(images))`, `batch_size` images per call (the last
    batch padded with zero images, `dp.sampling.pad_rows`, and cut)."""
    mean, std = tuple(map(float, spec.mean)), tuple(map(float, spec.std))
    shape = jax.eval_shape(front, jax.ShapeDtypeStruct((1, *images.shape[1:]), np.float32))
    features = np.empty((len(images), *shape.shape[1:]), np.float32)
    for start in range(0, len(images), batch_size):
        padded, mask = pad_rows(images[start:start + batch_size], rows=batch_size)
        count = int(mask.sum())
        out = np.asarray(_front_batch(padded, front=front, mean=mean, std=std), np.float32)
        features[start:start + count] = out[:count]
    return features


def cached_front(model: nnx.Module, images: np.ndarray, spec: FinetuneSpec):
    """(model, images, spec, wrap) for the trainer: unchanged (wrap the identity) unless the
    model has a fixed front and the spec draws no augmentation; then a copy of it reading
    features, the front's features of `images`, the spec reading them as they are (mean 0,
    std 1), and `wrap` setting a trained copy back to reading images."""
    augmented = spec.augmult > 1 or spec.crop_padding or spec.flip
    if (not _has_fixed_front(model) or augmented or np.asarray(images).ndim != 4
            or not len(images)):
        return model, images, spec, lambda trained: trained
    shape = jax.eval_shape(model.front, jax.ShapeDtypeStruct((1, *images.shape[1:]), np.float32))
    size = len(images) * int(np.prod(shape.shape)) * 4
    if size > CACHE_MAX_BYTES:
        print(f"finetune: the model's fixed front would need {size / 2**30:.1f} GiB for the "
              f"{len(images):,} training images (more than {CACHE_MAX_BYTES / 2**30:g}): it runs "
              "at every step instead", file=sys.stderr, flush=True)
        return model, images, spec, lambda trained: trained
    print(f"finetune: the model's fixed front ({type(model).__name__}.front) computed once for "
          f"the {len(images):,} training images (no augmentation)", file=sys.stderr, flush=True)
    features = front_features(model.front, np.asarray(images), spec)
    features_spec = dataclasses.replace(spec, mean=(0.0,), std=(1.0,))

    def wrap(trained: nnx.Module) -> nnx.Module:
        trained.on_features = False
        return trained

    on_features = nnx.clone(model)
    on_features.on_features = True
    return on_features, features, features_spec, wrap
