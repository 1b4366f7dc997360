"""Accuracy of stacked linear probes: top-1, top-k and per-class, for every run at once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from probe.clipping import linear_logits

__all__ = ["evaluate"]


@functools.partial(jax.jit, static_argnames=("num_classes", "top_k"))
def _correct(params, features, labels, *, num_classes: int, top_k: int):
    logits = linear_logits(params, features)  # (N, P, C)
    if features.ndim == 3:  # several views of a test example: average their logits
        logits = logits.mean(axis=1)
    top = jax.lax.top_k(logits, top_k)[1]  # (N, P, k)
    hits = top == labels[:, None, None]
    top1 = hits[..., 0]
    topk = hits.any(axis=-1)
    onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)  # (N, C)
    per_class_correct = jnp.einsum("np,nc->pc", top1.astype(jnp.float32), onehot)
    return top1.sum(0), topk.sum(0), per_class_correct, onehot.sum(0)


def evaluate(params: dict, features, labels, *, top_k: int = 5) -> dict[str, np.ndarray]:
    """Accuracy of each stacked run on a labelled split.

    Args:
      params: {"w": (P, d, C), "b": (P, C)}.
      features: (N, d) (already normalized the way the probe was trained).
      labels: (N,) integer labels.
      top_k: k of the top-k accuracy (clamped to the number of classes).

    Returns:
      {"top1": (P,), "top5" (or f"top{k}"): (P,), "per_class": (P, C)} as fractions in [0, 1];
      a class with no examples gets NaN.
    """
    num_classes = int(params["w"].shape[-1])
    k = min(top_k, num_classes)
    labels = jnp.asarray(np.asarray(labels), jnp.int32)
    top1, topk, per_class, counts = _correct(
        params, jnp.asarray(features, jnp.float32), labels, num_classes=num_classes, top_k=k
    )
    n = float(labels.shape[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        per_class = np.asarray(per_class) / np.asarray(counts)[None, :]
    return {
        "top1": np.asarray(top1) / n,
        f"top{top_k}": np.asarray(topk) / n,
        "per_class": per_class,
    }
