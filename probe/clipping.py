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

Rounding. The clipping factor is computed from an *upper bound* of each norm that holds whatever
the float32 rounding (residuals enter scaled by their largest entry, so that no square of a tiny
residual flushes to zero): with B = ((1/K) sum_v sqrt(||x_v||^2 + 1) ||r_v||)^2 (the triangle bound,
all terms positive), the computed squared norm S' satisfies |S' - S| <= gamma B with
gamma = 2 (d + C + K^2 + 8) 2^-24 (Higham's bound for sums and dot products of n float32 terms,
doubled), so sqrt(S' + gamma B) >= ||g_i||. For K = 1, S = B and the bound is a relative
(1 + gamma) on the squared norm (about 1e-4 for d = 768); for views whose Gram form cancels
(large, nearly antipodal views) it keeps the clipped contribution within C where the float32
value alone would not; the bound is floored at B / 16 (see `_residuals_and_norms`). Exact float64
norms would do the same, but float64 reductions run many times slower than float32 on CPUs and
GPUs. Every einsum runs at `precision=HIGHEST`, so TF32 or
bf16 passes on accelerators never enter the bound. A row whose norm is not finite (NaN/Inf
features, or a norm that overflows float32) gets clipping factor 0: it contributes nothing.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
_F32_UNIT_ROUNDOFF = 2.0**-24

__all__ = [
    "LOSSES",
    "clipped_grad_sum",
    "example_losses",
    "feature_gram",
    "linear_logits",
    "per_example_grad_norms",
    "residuals",
    "zero_nonfinite_rows",
]

Loss = Literal["softmax", "sigmoid"]
LOSSES: tuple[str, ...] = ("softmax", "sigmoid")


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
    """Per-example Gram matrix of the views, (N, K, K); for K = 1 it is ||x_i||^2."""
    return jnp.einsum("nvd,nwd->nvw", features, features, precision=_HIGHEST)


def zero_nonfinite_rows(features: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Features with every row (example) that holds a NaN or Inf set to zero, and the mask
    zeroed there: such rows become null records. The trainers call it once per program (it is a
    pass over the features, fused with the float16 -> float32 cast), then `clipped_grad_sum`
    with `finite_rows=True`."""
    finite = jnp.isfinite(features.reshape(features.shape[0], -1)).all(axis=1)
    shape = (-1,) + (1,) * (features.ndim - 1)
    return jnp.where(finite.reshape(shape), features, 0.0), mask * finite


def _as_views(features: jax.Array) -> jax.Array:
    if features.ndim == 2:
        return features[:, None, :]
    if features.ndim == 3:
        return features
    raise ValueError(f"features must be (N, d) or (N, views, d), got shape {features.shape}")


def _residuals_and_norms(params, features, onehot, loss, gram):
    """Residuals (N, V, P, C) and per-example gradient norms (N, P): an upper bound that holds
    under float32 rounding (module docstring); NaN or inf where the row is not finite.

    The residuals enter scaled by their largest entry m (per example and config): a squared
    residual below ~1e-19 would flush to zero on CPUs and GPUs and hide an example of norm
    up to ~1e19, while r / m lies in [-1, 1] and the norm is m times the scaled one.
    """
    views, dim = features.shape[1], features.shape[2]
    res = residuals(linear_logits(params, features), onehot[:, None, None, :], loss)
    if gram is None:
        gram = feature_gram(features)
    gamma = 2.0 * (dim + res.shape[-1] + views * views + 8) * _F32_UNIT_ROUNDOFF
    peak = jnp.max(jnp.abs(res), axis=(1, 3))  # (N, P)
    scaled = res / jnp.maximum(peak, jnp.finfo(res.dtype).tiny)[:, None, :, None]
    if views == 1:  # Plain examples: sqrt(||x||^2 + 1) ||r||, a product of positive terms.
        res_norms = jnp.sqrt(jnp.sum(jnp.square(scaled[:, 0]), axis=-1))
        bound = jnp.sqrt((gram[:, 0, 0, None] + 1.0) * (1.0 + gamma)) * res_norms
        return res, peak * bound
    res_gram = jnp.einsum("nvpc,nwpc->npvw", scaled, scaled, precision=_HIGHEST)
    sq_norms = jnp.einsum("nvw,npvw->np", gram + 1.0, res_gram, precision=_HIGHEST) / views**2
    feature_norms = jnp.sqrt(jnp.diagonal(gram, axis1=1, axis2=2) + 1.0)  # (N, V)
    scaled_norms = jnp.sqrt(jnp.diagonal(res_gram, axis1=2, axis2=3))  # (N, P, V)
    triangle = jnp.einsum("nv,npv->np", feature_norms, scaled_norms, precision=_HIGHEST) / views
    bound = jnp.maximum(sq_norms, 0.0) + gamma * jnp.square(triangle)
    # Floor at (triangle / 4)^2: the final sum adds the per-view terms x_v (s r_v) / K, of total
    # size s * triangle; the floor keeps them below 4 C, so the float32 rounding of that sum
    # stays ~1e-7 C instead of growing with a cancelling example's terms (up to C / sqrt(gamma)).
    # It clips harder only examples whose view gradients cancel by more than 3/4.
    return res, peak * jnp.sqrt(jnp.maximum(bound, jnp.square(triangle / 4.0)))


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

    DP contract: rows of `features` are distinct individuals; each contributes at most
    `clip_norm` in L2 norm to the returned sum of its config (a row whose norm is not finite
    contributes nothing), for any input values.
    """
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
    sums = {
        "w": jnp.einsum("nvd,nvpc->pdc", features, weighted, precision=_HIGHEST),
        "b": jnp.sum(weighted, axis=(0, 1)),
    }
    return sums, num_clipped
