"""Per-example feature normalization: a function of one example alone, so it costs no privacy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["NORMALIZATIONS", "normalize_features", "normalized_norm_bound"]

NORMALIZATIONS: tuple[str, ...] = ("none", "l2", "group")


def normalize_features(
    features, method: str = "none", *, groups: int = 1, eps: float = 1e-5
) -> jnp.ndarray:
    """Normalize each example (each view) on its own.

    Args:
      features: (..., d) float array (NumPy or JAX). With "none" it is returned unchanged
        (float64 is cast to float32); otherwise the result is float32.
      method: "none"; "l2" (unit L2 norm); "group": split the d features into `groups`
        contiguous groups and standardize each to zero mean, unit variance, as the GroupNorm
        that Tramer & Boneh (2021, https://arxiv.org/abs/2011.11660) put on ScatterNet
        features (channel-major layout).
      groups: number of groups for "group"; must divide d.
      eps: added to the variance / norm for stability.
    """
    if method == "none":  # left as it is (float16 stays float16; the step casts to float32)
        return features if features.dtype in (np.float16, np.float32) else (
            features.astype(np.float32))
    features = jnp.asarray(features, jnp.float32)
    if method == "l2":
        norms = jnp.linalg.norm(features, axis=-1, keepdims=True)
        return features / jnp.maximum(norms, eps)
    if method == "group":
        dim = features.shape[-1]
        if groups < 1 or dim % groups:
            raise ValueError(f"groups must divide the feature dim {dim}, got {groups}")
        grouped = features.reshape(*features.shape[:-1], groups, dim // groups)
        mean = grouped.mean(axis=-1, keepdims=True)
        var = grouped.var(axis=-1, keepdims=True)
        return ((grouped - mean) / jnp.sqrt(var + eps)).reshape(features.shape)
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {method!r}")


def normalized_norm_bound(method: str, dim: int) -> float:
    """The largest L2 norm an example can have after `normalize_features(method)`: 1 for
    "l2"; sqrt(d) for "group" (each group of n features has mean 0 and sum of squares
    n var / (var + eps) < n); inf for "none". A public bound, e.g. a clip norm that clips
    nothing (float32 rounding aside)."""
    if method == "l2":
        return 1.0
    if method == "group":
        return float(np.sqrt(dim))
    if method == "none":
        return float("inf")
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {method!r}")
