"""Accuracy of stacked linear probes: top-1, top-k and per-class, for every run at once.

Rows are processed in fixed-size blocks (the last one padded and masked), so memory stays
O(block (d + P C)) for any test set and one compiled kernel serves every block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dp.clipping import valid_labels
from dp.sampling import pad_rows
from probe.clipping import linear_logits
from probe.normalization import normalize_features

__all__ = ["count_totals", "evaluate", "evaluate_chunks"]


@functools.partial(jax.jit, static_argnames=("num_classes", "top_k", "normalization", "groups"))
def _counts(params, features, labels, mask, *, num_classes, top_k, normalization, groups):
    features = normalize_features(features.astype(jnp.float32), normalization, groups=groups)
    logits = linear_logits(params, features)  # (N, P, C) or (N, V, P, C)
    if features.ndim == 3:  # several views of a test example: average their logits
        logits = logits.mean(axis=1)
    # Rank of the true class, ties broken towards the lower class index (as top-k and argmax
    # do): it is in the top k iff fewer than k classes rank above it. No sort needed.
    onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    true_logit = jnp.einsum("npc,nc->np", logits, onehot)[..., None]
    lower_index = jnp.arange(num_classes) < labels[:, None, None]
    rank = jnp.sum((logits > true_logit) | ((logits == true_logit) & lower_index), axis=-1)
    # A prediction with a NaN or Inf logit is wrong: NaN compares false with everything, so
    # its rank would be 0 (a "hit") without this. A label outside [0, C) is never a hit either
    # (`probe.selection` relies on it: a null record must count 0).
    in_range = valid_labels(labels, num_classes)
    valid = (mask[:, None] > 0) & in_range[:, None] & jnp.all(jnp.isfinite(logits), axis=-1)
    top1, topk = (rank == 0) & valid, (rank < top_k) & valid
    onehot = onehot * mask[:, None]
    per_class = jnp.einsum("np,nc->pc", top1.astype(jnp.float32), onehot)
    return top1.sum(0), topk.sum(0), per_class, onehot.sum(0)


def evaluate_chunks(
    params: dict,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    top_k: int = 5,
    normalization: str = "none",
    groups: int = 1,
    block_rows: int | None = None,
) -> dict[str, np.ndarray]:
    """Accuracy of each stacked run over (features, labels) chunks (e.g. streamed from disk).

    Args:
      params: {"w": (P, d, C), "b": (P, C)}.
      chunks: iterable of (features (n, d) or (n, views, d), labels (n,)) pairs, raw (the
        per-example normalization the probe was trained with is applied here).
      top_k: k of the top-k accuracy (clamped to the number of classes).
      normalization, groups: as in `ProbeSpec`.
      block_rows: rows per compiled block (default: the first chunk's, at most 8192).

    Returns:
      {"top1": (P,), f"top{top_k}": (P,), "per_class": (P, C)} as fractions in [0, 1]; a class
      with no examples gets NaN. A prediction with any NaN or Inf logit counts as wrong.
    """
    num_classes = int(params["w"].shape[-1])
    top1, topk, per_class, class_counts = count_totals(
        params, chunks, top_k=min(top_k, num_classes), normalization=normalization,
        groups=groups, block_rows=block_rows)
    n = class_counts.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        per_class = per_class / class_counts[None, :]
    return {"top1": top1 / n, f"top{top_k}": topk / n, "per_class": per_class}


def count_totals(params: dict, chunks: Iterable[tuple[np.ndarray, np.ndarray]], *,
                 top_k: int = 5, normalization: str = "none", groups: int = 1,
                 block_rows: int | None = None) -> list[np.ndarray]:
    """Exact counts of each stacked run over (features, labels) chunks: [top-1 hits (P,),
    top-k hits (P,), per-class hits (P, C), examples per class (C,)] (float64).

    Rows are cut into fixed blocks (the last padded and masked), one compiled kernel for all.
    """
    num_classes = int(params["w"].shape[-1])
    kwargs = dict(num_classes=num_classes, top_k=min(top_k, num_classes),
                  normalization=normalization, groups=groups)
    params = jax.device_put(params)  # once, not once per block
    totals = None
    for features, labels in chunks:
        features, labels = np.asarray(features), np.asarray(labels, np.int32)
        if not block_rows:  # the first chunk in equal blocks of at most 8192 rows
            num_blocks = max(1, math.ceil(len(labels) / 8192))
            block_rows = max(1, math.ceil(len(labels) / num_blocks))
        for start in range(0, len(labels), block_rows):
            x, y, mask = pad_rows(features[start:start + block_rows],
                                  labels[start:start + block_rows], rows=block_rows)
            counts = [np.asarray(c, np.float64) for c in _counts(params, x, y, mask, **kwargs)]
            totals = counts if totals is None else [
                t + c for t, c in zip(totals, counts, strict=True)]
    if totals is None:
        raise ValueError("no examples to evaluate")
    return totals


def evaluate(params: dict, features, labels, *, top_k: int = 5, normalization: str = "none",
             groups: int = 1) -> dict[str, np.ndarray]:
    """Accuracy of each stacked run on one labelled split held in memory.

    `features` are raw: pass the probe's `normalization`/`groups` (see `evaluate_chunks`).
    """
    return evaluate_chunks(params, [(features, labels)], top_k=top_k,
                           normalization=normalization, groups=groups)
