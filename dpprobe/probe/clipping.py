"""Closed-form per-example clipping for a linear classifier; no per-example gradient is built.

For logits z_i = W^T x_i + b and either loss below, dloss_i/dz_i = r_i with
  softmax cross-entropy:           r_i = softmax(z_i) - y_i
  sigmoid (one-vs-all) cross-entr.: r_i = sigmoid(z_i) - y_i   (loss summed over classes)
so the per-example gradient is (x_i r_i^T, r_i) and

    ||g_i||^2 = ||x_i||^2 ||r_i||^2 + ||r_i||^2 = (||x_i||^2 + 1) ||r_i||^2.

The clipped sum is then sum_i s_i g_i = (X^T (s * R), sum_i s_i r_i) with
s_i = min(1, C / ||g_i||): two matmuls, memory O(N (d + C)).

With K augmented views per example (De et al. 2022,
https://arxiv.org/abs/2204.13650, eq. 4) the example's gradient is the mean
of its view gradients, g_i = (1/K) sum_v (x_iv r_iv^T, r_iv), whose squared norm is
(1/K^2) sum_{v,w} (x_iv . x_iw + 1)(r_iv . r_iw): a K x K Gram form, still closed.

Every function here works on a stack of P configs at once: `params["w"]` is (P, d, C) and
`params["b"]` is (P, C), so one matmul serves every config of a sweep.

The norms are `dp.norms.dense_grad_norms` with the views as tokens: upper bounds that hold
under float32 rounding (its docstring has the argument), so each example's contribution stays
within C whatever the input values. `linear_clipper` is this closed form behind the clipper
interface of `dp.clipping`.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from dpprobe.dp.accumulate import FLOAT64_SUMS, row_block_sum, sum_block_rows
from dpprobe.dp.clipping import ClippedSum, Clipper
from dpprobe.dp.norms import dense_grad_norms, input_gram

_HIGHEST = jax.lax.Precision.HIGHEST

__all__ = [
    "LOSSES",
    "clipped_grad_sum",
    "example_losses",
    "feature_gram",
    "linear_clipper",
    "linear_logits",
    "per_example_grad_norms",
    "residuals",
]

Loss = Literal["softmax", "sigmoid"]
LOSSES: tuple[str, ...] = get_args(Loss)


def linear_logits(params: dict, features: jax.Array) -> jax.Array:
    """Logits of P stacked linear models: features (..., d) -> (..., P, C)."""
    return jnp.einsum("...d,pdc->...pc", features, params["w"], precision=_HIGHEST) + params["b"]


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
    """Per-example Gram matrix of the views, (N, K, K) (`dp.norms.input_gram`)."""
    return input_gram(features)


def _as_views(features: jax.Array) -> jax.Array:
    if features.ndim == 2:
        return features[:, None, :]
    if features.ndim == 3:
        return features
    raise ValueError(f"features must be (N, d) or (N, views, d), got shape {features.shape}")


def _residuals_and_norms(params, features, onehot, loss, gram):
    """Residuals (N, V, P, C) and per-example gradient norms (N, P): upper bounds under
    float32 rounding (`dp.norms.dense_grad_norms`, the views as tokens)."""
    res = residuals(linear_logits(params, features), onehot[:, None, None, :], loss)
    if gram is None:
        gram = feature_gram(features)
    return res, dense_grad_norms(gram, res, in_dim=features.shape[2])


def per_example_grad_norms(
    params: dict,
    features: jax.Array,
    onehot: jax.Array,
    *,
    loss: Loss,
    gram: jax.Array | None = None,
) -> jax.Array:
    """L2 norms of every example's (view-averaged) gradient under each config: (N, P).

    These are the norms the clipping uses: upper bounds, at most a relative ~gamma above the
    exact value (module docstring)."""
    features = _as_views(features)
    return _residuals_and_norms(params, features, onehot, loss, gram)[1]


def clipped_grad_sum(
    params: dict,
    features: jax.Array,
    onehot: jax.Array,
    clip_norm: jax.Array,
    *,
    loss: Loss,
    mask: jax.Array | None = None,
    gram: jax.Array | None = None,
    finite_rows: bool = False,
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
      finite_rows: the caller guarantees every row of `features` is finite (it ran
        `zero_nonfinite_rows`), which saves a pass over the features here.

    Returns:
      ({"w": (P, d, C), "b": (P, C)} clipped sums, (P,) number of examples that were clipped).

    Formal guarantee:
      rows of `features` are distinct individuals; each contributes at most `clip_norm` in L2 norm
      to the returned sum of its config (a row whose norm is not finite contributes nothing), for
      any input values. Called inside an `x64_jit` program, the sum is float64 and rounding
      moves it by at most a relative 2 N^2 2^-53 more (`dp.accumulate`); outside, float32.
    """
    sums, _, num_clipped = _clip(params, features, onehot, clip_norm, loss, mask, gram,
                                 finite_rows)
    return sums, num_clipped


def _clip(params, features, onehot, clip_norm, loss, mask, gram, finite_rows):
    """(clipped sums, per-example norms (N, P), (P,) examples clipped): `clipped_grad_sum`."""
    features = _as_views(features).astype(jnp.promote_types(features.dtype, jnp.float32))
    views = features.shape[1]
    if gram is None:
        gram = feature_gram(features)
    res, norms = _residuals_and_norms(params, features, onehot, loss, gram)
    # Rows whose norm is NaN or inf (non-finite features or residuals, or an overflow) contribute
    # nothing: factor 0, and their features and residuals are zeroed (NaN * 0 would be NaN).
    valid = jnp.isfinite(norms)
    if not finite_rows:
        row_finite = jnp.isfinite(jnp.diagonal(gram, axis1=1, axis2=2)).all(axis=1)  # (N,)
        features = jnp.where(row_finite[:, None, None], features, 0.0)
    # min(1, C / ||g||), written so that C = inf and ||g|| = 0 both give exactly 1.
    scale = jnp.minimum(1.0, clip_norm[None, :] / jnp.maximum(norms, jnp.finfo(norms.dtype).tiny))
    scale = jnp.where(valid, scale, 0.0)
    clipped = (norms > clip_norm[None, :]) | ~valid
    if mask is not None:
        scale = scale * mask[:, None]
        clipped = clipped & (mask[:, None] > 0)
    num_clipped = jnp.sum(clipped, axis=0)
    weighted = jnp.where((scale > 0)[:, None, :, None], res * (scale / views)[:, None, :, None],
                         0.0)
    # The row reduction accumulates in float64 inside an `x64_jit` program (`dp.accumulate`:
    # the sum's sensitivity stays within C (1 + 1e-6)), in float32 elsewhere.
    acc = jax.dtypes.canonicalize_dtype(FLOAT64_SUMS)

    def block_sum(features, weighted):
        return {"w": jnp.einsum("nvd,nvpc->pdc", features, weighted, precision=_HIGHEST,
                                preferred_element_type=acc),
                "b": jnp.sum(weighted, axis=(0, 1), dtype=acc)}

    def single_view_sum(features, weighted):
        return {"w": jnp.einsum("nd,npc->pdc", features, weighted, precision=_HIGHEST,
                                preferred_element_type=acc),
                "b": jnp.sum(weighted, axis=0, dtype=acc)}

    # Rows per float64 block, from public shapes (`dp.accumulate.sum_block_rows`).
    block_rows = sum_block_rows(8 * views * features.shape[2],
                                8 * math.prod(weighted.shape[2:]) * features.shape[2], views)
    if views == 1:  # the same sum without the views axis, which XLA:CPU laid out apart and
        # copied: two more float32 copies of the features (f32[N, 1, d] in layout {2, 0, 1})
        sums = row_block_sum(single_view_sum, features[:, 0], weighted[:, 0], block_rows)
    else:
        sums = row_block_sum(block_sum, features, weighted, block_rows)
    return sums, norms, num_clipped


def linear_clipper(loss: Loss) -> Clipper:
    """The closed form behind `dp.clipping`'s clipper interface: batch = (features, onehot),
    params and `clip_norm` stacked over P configs; the norms are (N, P)."""

    def clip(params, batch: tuple, clip_norm, mask) -> ClippedSum:
        features, onehot = batch
        sums, norms, _ = _clip(params, features, onehot, clip_norm, loss, mask, None, False)
        return ClippedSum(sums, norms)

    return clip
