"""Accuracy of stacked linear probes: top-1, top-k and per-class, for every run at once.

Rows are cut into blocks of `EVAL_BLOCK_ROWS` consecutive rows whatever the chunks they arrive
in (the last block padded and masked), and the runs into slices of at most `EVAL_CALL_BYTES` of
logits, so memory stays O(block d + P d C) for any test set and any number of runs, and one
compiled kernel serves every block. Each run's logits are computed on their own
(`block_logits`: a loop over the runs inside the compiled program), because a matmul over P
stacked runs rounds differently from one over a single run: this way a released model
(`dpmodel`, one run) given the same rows computes bitwise the logits its job evaluated, and
predicts the same class on every row.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dpprobe.dp.clipping import valid_labels
from dpprobe.dp.sampling import pad_rows
from dpprobe.probe import programs
from dpprobe.probe.clipping import linear_logits
from dpprobe.probe.normalization import normalize_features

__all__ = ["EVAL_BLOCK_ROWS", "EVAL_CALL_BYTES", "block_logits", "count_totals", "evaluate",
           "evaluate_chunks", "fixed_blocks"]

# Rows per compiled evaluation call (speed and memory only).
EVAL_BLOCK_ROWS = 1024
# Bytes of logits and ranks one call may hold: a sweep of many runs is evaluated a slice of
# runs at a time (each run's logits do not depend on the others: `block_logits`).
EVAL_CALL_BYTES = 64 << 20


@functools.partial(jax.jit, static_argnames=("normalization", "groups"))
def block_logits(params: dict, features, *, normalization: str = "none",
                 groups: int = 1) -> jax.Array:
    """Logits of P stacked linear probes on one block of raw features.

    Args:
      params: {"w": (P, d, C), "b": (P, C)}.
      features: (n, d) or (n, views, d), raw (normalized here, per example).
      normalization, groups: the per-example normalization the probes were trained with.

    Returns:
      (n, P, C) float32; with views, the mean of the views' logits. Run p's logits are computed
      as if it were alone (`jax.lax.map` over the runs), so they do not depend on P.
    """
    features = normalize_features(features.astype(jnp.float32), normalization, groups=groups)

    def one_run(weights):
        w, b = weights
        return linear_logits({"w": w[None], "b": b[None]}, features)[..., 0, :]

    logits = jnp.moveaxis(jax.lax.map(one_run, (params["w"], params["b"])), 0, -2)
    if features.ndim == 3:  # several views of a test example: average their logits
        logits = logits.mean(axis=1)
    return logits


def fixed_blocks(chunks: Iterable[tuple[np.ndarray, np.ndarray]],
                 rows: int = EVAL_BLOCK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                np.ndarray]]:
    """(features, labels, mask) blocks of exactly `rows` consecutive rows, cut from
    (features, labels) chunks of any sizes; the last block is padded and its mask is 0 there."""
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    count = 0
    for features, labels in chunks:
        features, labels = np.asarray(features), np.asarray(labels, np.int32)
        pending.append((features, labels))
        count += len(labels)
        while count >= rows:
            block_x = np.concatenate([f for f, _ in pending]) if len(pending) > 1 else pending[0][0]
            block_y = np.concatenate([y for _, y in pending]) if len(pending) > 1 else pending[0][1]
            yield block_x[:rows], block_y[:rows], np.ones(rows, np.float32)
            pending = [(block_x[rows:], block_y[rows:])]
            count -= rows
    if count:
        block_x = np.concatenate([f for f, _ in pending])
        block_y = np.concatenate([y for _, y in pending])
        yield pad_rows(block_x, block_y, rows=rows)


@functools.partial(jax.jit, static_argnames=("num_classes", "top_k"))
def _counts(logits, labels, mask, *, num_classes, top_k):
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
    block_rows: int = EVAL_BLOCK_ROWS,
) -> dict[str, np.ndarray]:
    """Accuracy of each stacked run over (features, labels) chunks (e.g. streamed from disk).

    Args:
      params: {"w": (P, d, C), "b": (P, C)}.
      chunks: iterable of (features (n, d) or (n, views, d), labels (n,)) pairs, raw (the
        per-example normalization the probe was trained with is applied here).
      top_k: k of the top-k accuracy (clamped to the number of classes).
      normalization, groups: as in `ProbeSpec`.
      block_rows: rows per compiled block (speed and memory only).

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
                 block_rows: int = EVAL_BLOCK_ROWS) -> list[np.ndarray]:
    """Exact counts of each stacked run over (features, labels) chunks: [top-1 hits (P,),
    top-k hits (P,), per-class hits (P, C), examples per class (C,)] (float64).

    Rows are cut into fixed blocks (`fixed_blocks`), one compiled kernel for all; the runs into
    equal slices whose logits fit `EVAL_CALL_BYTES`, so memory is bounded whatever P is.
    """
    num_runs, num_classes = (int(n) for n in params["w"].shape[::2])
    per_run = 32 * block_rows * num_classes  # logits, the rank's comparisons (float32, bool)
    count = -(-num_runs // max(1, EVAL_CALL_BYTES // per_run))
    size = -(-num_runs // count)
    slices = [jax.device_put({k: v[lo:lo + size] for k, v in params.items()})  # once each
              for lo in range(0, num_runs, size)]
    totals = None
    for x, y, mask in fixed_blocks(chunks, block_rows):
        counts = [_block_counts(part, x, y, mask, normalization=normalization, groups=groups,
                                num_classes=num_classes, top_k=min(top_k, num_classes))
                  for part in slices]
        counts = [np.concatenate(c) for c in zip(*(c[:3] for c in counts), strict=True)] + [
            counts[0][3]]
        totals = counts if totals is None else [
            t + c for t, c in zip(totals, counts, strict=True)]
    if totals is None:
        raise ValueError("no examples to evaluate")
    return totals


# Stored on disk by the `dpprobe` command: a repeated sweep skips tracing (`probe.programs`).
_stored_logits = programs.stored("probe.evaluation.block_logits", block_logits)
_stored_counts = programs.stored("probe.evaluation._counts", _counts)


def _block_counts(params, x, y, mask, *, normalization, groups, num_classes, top_k):
    logits = _stored_logits(params, x, normalization=normalization, groups=groups)
    return [np.asarray(c, np.float64) for c in _stored_counts(logits, y, mask,
                                                        num_classes=num_classes, top_k=top_k)]


def evaluate(params: dict, features, labels, *, top_k: int = 5, normalization: str = "none",
             groups: int = 1) -> dict[str, np.ndarray]:
    """Accuracy of each stacked run on one labelled split held in memory.

    `features` are raw: pass the probe's `normalization`/`groups` (see `evaluate_chunks`).
    """
    return evaluate_chunks(params, [(features, labels)], top_k=top_k,
                           normalization=normalization, groups=groups)
