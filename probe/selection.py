"""Private model selection: each candidate's count of correct predictions, plus Gaussian noise.

Formal guarantee: under zero-out neighbours a record replaced by a null record changes each
count by at most 1 (a null record, like a row with non-finite features or a label outside
[0, C), is never counted as correct), so releasing k noisy counts with noise std sigma is the
Gaussian mechanism with sensitivity 1, k times: `DpPlan(sigma, steps=k, clip_norm=1)`. The
noise comes from a generator seeded by OS entropy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from probe.clipping import linear_logits
from probe.normalization import normalize_features

__all__ = ["correct_counts", "noisy_correct_counts"]


@functools.partial(jax.jit, static_argnames=("normalization", "groups"))
def _block_counts(params, features, labels, mask, *, normalization, groups):
    features = normalize_features(features.astype(jnp.float32), normalization, groups=groups)
    logits = linear_logits(params, features)  # (n, P, C) or (n, V, P, C)
    if logits.ndim == 4:
        logits = logits.mean(axis=1)
    num_classes = logits.shape[-1]
    valid = (mask > 0) & (labels >= 0) & (labels < num_classes)
    correct = (jnp.argmax(logits, axis=-1) == labels[:, None]) & jnp.isfinite(logits).all(-1)
    return jnp.sum(correct & valid[:, None], axis=0)


def correct_counts(params: dict, features, labels, *, normalization: str = "none",
                   groups: int = 1, block_rows: int = 8192) -> np.ndarray:
    """Exact number of rows each stacked model (P of them) classifies correctly: (P,) int.

    Rows with non-finite logits or labels outside [0, C) never count. An exact statistic of
    `features`: publish it only if they are public (else use `noisy_correct_counts`).
    """
    features, labels = np.asarray(features), np.asarray(labels)
    block_rows = max(1, min(block_rows, len(labels)))
    params = jax.device_put(params)
    total = np.zeros(params["w"].shape[0], np.int64)
    for start in range(0, len(labels), block_rows):
        x, y = features[start:start + block_rows], labels[start:start + block_rows]
        mask = np.zeros(block_rows, np.float32)
        mask[:len(y)] = 1.0
        if len(y) < block_rows:  # one compiled kernel for every block
            x = np.concatenate([x, np.zeros((block_rows - len(y), *x.shape[1:]), x.dtype)])
            y = np.concatenate([y, np.zeros(block_rows - len(y), y.dtype)])
        total += np.asarray(_block_counts(params, x, y.astype(np.int32), mask,
                                          normalization=normalization, groups=groups))
    return total


def noisy_correct_counts(params: dict, features, labels, noise_multiplier: float, *,
                         normalization: str = "none", groups: int = 1) -> np.ndarray:
    """`correct_counts` + N(0, noise_multiplier^2) each (float64): k Gaussian mechanisms of
    sensitivity 1 (module docstring), to be recorded as `DpPlan(noise_multiplier, k)`."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    counts = correct_counts(params, features, labels, normalization=normalization, groups=groups)
    return counts + noise_multiplier * np.random.default_rng().standard_normal(counts.shape)
