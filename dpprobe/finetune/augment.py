"""Data augmentation on the device: K random views (crop with padding, horizontal flip) of one
image, for augmentation multiplicity (De et al. 2022, https://arxiv.org/abs/2204.13650, eq. 4).

Each view is a function of the example and a key alone, so a view never depends on the other
examples of a batch: the per-example gradient averaged over the views is still one example's
contribution, clipped as a whole (see `finetune.train`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["augment_views", "views_of"]


def augment_views(key: jax.Array, image: jax.Array, *, views: int, padding: int,
                  flip: bool) -> jax.Array:
    """`views` random views (K, H, W, C) of `image` (H, W, C): each a random H x W crop of the
    image reflect-padded by `padding` pixels on every side, then flipped left-right with
    probability 1/2 if `flip` (Zagoruyko & Komodakis' CIFAR recipe, as De et al. use).
    With padding 0 and no flip, every view is the image itself. Dtypes are explicit, so the
    views are the same in programs traced with x64 on (`finetune.batch_sums.clipped_sum`)."""

    def one(key):
        crop_key, flip_key = jax.random.split(key)
        view = image
        if padding:
            padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)),
                             mode="reflect")
            top, left = jax.random.randint(crop_key, (2,), 0, 2 * padding + 1, jnp.int32)
            view = jax.lax.dynamic_slice(padded, (top, left, jnp.int32(0)), image.shape)
        if flip:
            view = jnp.where(jax.random.bernoulli(flip_key, jnp.float32(0.5)), view[:, ::-1], view)
        return view

    return jax.vmap(one)(jax.random.split(key, views))


def views_of(example: jax.Array, key: jax.Array, *, views: int, padding: int,
             flip: bool) -> jax.Array:
    """The K views of one example: `example` (H, W, C) is augmented (`augment_views`); an
    example that already holds its views (K, H, W, C), e.g. precomputed, is used as it is."""
    if example.ndim == 4:
        return example
    return augment_views(key, example, views=views, padding=padding, flip=flip)
