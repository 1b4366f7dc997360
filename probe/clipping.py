"""Closed-form per-example clipping for a linear classifier; no per-example gradient is built.

For logits z_i = W^T x_i + b and either loss below, dloss_i/dz_i = r_i with
  softmax cross-entropy:           r_i = softmax(z_i) - y_i
  sigmoid (one-vs-all) cross-entr.: r_i = sigmoid(z_i) - y_i   (loss summed over classes)
so the per-example gradient is (x_i r_i^T, r_i) and

    ||g_i||^2 = ||x_i||^2 ||r_i||^2 + ||r_i||^2 = (||x_i||^2 + 1) ||r_i||^2.

The clipped sum is then sum_i s_i g_i = (X^T (s * R), sum_i s_i r_i) with
s_i = min(1, C / ||g_i||): two matmuls, memory O(N (d + C)).

With K augmented views per example (De et al. 2022, eq. 4) the example's gradient is the mean
of its view gradients, g_i = (1/K) sum_v (x_iv r_iv^T, r_iv), whose squared norm is
(1/K^2) sum_{v,w} (x_iv . x_iw + 1)(r_iv . r_iw): a K x K Gram form, still closed.

Every function here works on a stack of P configs at once: `params["w"]` is (P, d, C) and
`params["b"]` is (P, C), so one matmul serves every config of a sweep.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = [
    "LOSSES",
    "clipped_grad_sum",
    "example_losses",
    "feature_gram",
    "linear_logits",
    "per_example_grad_norms",
    "residuals",
]

Loss = Literal["softmax", "sigmoid"]
LOSSES: tuple[str, ...] = ("softmax", "sigmoid")


def linear_logits(params: dict, features: jax.Array) -> jax.Array:
    """Logits of P stacked linear models: features (..., d) -> (..., P, C)."""
    return jnp.einsum("...d,pdc->...pc", features, params["w"]) + params["b"]


def residuals(logits: jax.Array, onehot: jax.Array, loss: Loss) -> jax.Array:
    """dloss/dlogits, the same shape as `logits` (onehot broadcasts against it)."""
    if loss == "softmax":
        return jax.nn.softmax(logits, axis=-1) - onehot
    if loss == "sigmoid":
        return jax.nn.sigmoid(logits) - onehot
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def example_losses(logits: jax.Array, onehot: jax.Array, loss: Loss) -> jax.Array:
    """Per-example loss, reduced over the class axis."""
    if loss == "softmax":
        return -jnp.sum(onehot * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    if loss == "sigmoid":
        log_p, log_not_p = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
        return -jnp.sum(onehot * log_p + (1.0 - onehot) * log_not_p, axis=-1)
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def feature_gram(features: jax.Array) -> jax.Array:
    """Per-example Gram matrix of the views, (N, K, K); for K = 1 it is ||x_i||^2."""
    return jnp.einsum("nvd,nwd->nvw", features, features)


def _as_views(features: jax.Array) -> jax.Array:
    if features.ndim == 2:
        return features[:, None, :]
    if features.ndim == 3:
        return features
    raise ValueError(f"features must be (N, d) or (N, views, d), got shape {features.shape}")


def _residuals_and_norms(params, features, onehot, loss, gram):
    """Residuals (N, V, P, C) and per-example squared gradient norms (N, P)."""
    views = features.shape[1]
    res = residuals(linear_logits(params, features), onehot[:, None, None, :], loss)
    if gram is None:
        gram = feature_gram(features)
    if views == 1:  # Plain examples: (||x||^2 + 1) ||r||^2.
        sq_norms = (gram[:, 0, 0, None] + 1.0) * jnp.sum(jnp.square(res[:, 0]), axis=-1)
    else:
        res_gram = jnp.einsum("nvpc,nwpc->npvw", res, res)
        sq_norms = jnp.einsum("nvw,npvw->np", gram + 1.0, res_gram) / views**2
    return res, jnp.maximum(sq_norms, 0.0)


def per_example_grad_norms(
    params: dict,
    features: jax.Array,
    onehot: jax.Array,
    *,
    loss: Loss,
    gram: jax.Array | None = None,
) -> jax.Array:
    """L2 norms of every example's (view-averaged) gradient under each config: (N, P)."""
    features = _as_views(features)
    _, sq_norms = _residuals_and_norms(params, features, onehot, loss, gram)
    return jnp.sqrt(sq_norms)


def clipped_grad_sum(
    params: dict,
    features: jax.Array,
    onehot: jax.Array,
    clip_norm: jax.Array,
    *,
    loss: Loss,
    mask: jax.Array | None = None,
    gram: jax.Array | None = None,
) -> tuple[dict, jax.Array]:
    """Sum over examples of per-example gradients clipped to `clip_norm`, per config.

    Args:
      params: {"w": (P, d, C), "b": (P, C)} stacked linear models.
      features: (N, d), or (N, K, d) for K augmented views per example; float16 features
        are widened to float32.
      onehot: (N, C) one-hot labels (float).
      clip_norm: (P,) per-config clipping bound; `inf` disables clipping.
      loss: "softmax" or "sigmoid".
      mask: optional (N,) 0/1 weights; masked rows contribute nothing (padding).
      gram: optional precomputed `feature_gram(features)` (it does not change across steps).

    Returns:
      ({"w": (P, d, C), "b": (P, C)} clipped sums, (P,) number of examples that were clipped).

    DP contract: rows of `features` are distinct individuals; each contributes at most
    `clip_norm` in L2 norm to the returned sum of its config.
    """
    features = _as_views(features).astype(jnp.promote_types(features.dtype, jnp.float32))
    views = features.shape[1]
    res, sq_norms = _residuals_and_norms(params, features, onehot, loss, gram)
    norms = jnp.sqrt(sq_norms)
    # min(1, C / ||g||), written so that C = inf and ||g|| = 0 both give exactly 1.
    scale = jnp.minimum(1.0, clip_norm[None, :] / jnp.maximum(norms, jnp.finfo(norms.dtype).tiny))
    clipped = norms > clip_norm[None, :]
    if mask is not None:
        scale = scale * mask[:, None]
        clipped = clipped & (mask[:, None] > 0)
    num_clipped = jnp.sum(clipped, axis=0)
    weighted = res * (scale / views)[:, None, :, None]
    sums = {
        "w": jnp.einsum("nvd,nvpc->pdc", features, weighted),
        "b": jnp.sum(weighted, axis=(0, 1)),
    }
    return sums, num_clipped
