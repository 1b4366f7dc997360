"""Linear probes on features (`dpprobe probe`, `dpprobe tune`) in a model file: the head
(w (d, C), b (C,)), the per-example normalization it was trained behind, tune's private
standardization (folded into the head, its statistics kept beside it), and the store's
backbone provenance, which turns images into the features the probe reads.

A loaded probe computes its logits with `probe.block_logits` over `probe.fixed_blocks`, the
function and the blocks of its job's test evaluation (`probe.evaluate_chunks`), so that on the
store's test split it predicts the classes its job scored, row by row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["linear_arrays", "linear_document", "linear_logits_chunks"]


def linear_arrays(w: np.ndarray, b: np.ndarray, standardizer=None) -> dict[str, np.ndarray]:
    """The head's arrays, and the standardization's released statistics when there is one."""
    arrays = {"head/w": np.asarray(w, np.float32), "head/b": np.asarray(b, np.float32)}
    if standardizer is not None:
        arrays |= {"standardize/mean": np.asarray(standardizer.mean, np.float32),
                   "standardize/scale": np.asarray(standardizer.scale, np.float32)}
    return arrays


def linear_document(*, dim: int, num_classes: int, loss: str, normalization: str, groups: int,
                    feature_dtype: str, standardization: dict | None = None) -> dict:
    """The transforms and head of a probe on `dim` features (public inputs; the
    standardization's description is a DP output with its own plan in the ledger)."""
    transforms = [{"op": "normalize", "method": normalization, "groups": groups,
                   "privacy": "per example (a function of one example): no privacy cost"}]
    if standardization is not None:
        transforms.append({"op": "standardize", "folded_into_head": True,
                           "arrays": ["standardize/mean", "standardize/scale"],
                           "note": "x -> (x - mean) / scale per feature, privately released "
                                   "(Tramer & Boneh); folded into the head (w / scale, "
                                   "b - (mean / scale) w), so the head applies to the "
                                   "normalized features"} | standardization)
    return {
        "kind": "linear",
        "input": {"kind": "features", "dim": dim, "store_dtype": feature_dtype},
        "transforms": transforms,
        "head": {"op": "linear", "arrays": ["head/w", "head/b"], "num_classes": num_classes,
                 "loss": loss,
                 "probabilities": "softmax" if loss == "softmax" else
                 "sigmoid per class (one-vs-all)"},
    }


def linear_logits_chunks(arrays: dict, document: dict,
                         chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """Logits (n, C) of the probe, block by block (`probe.fixed_blocks`: blocks of
    `probe.EVAL_BLOCK_ROWS` consecutive rows), for feature chunks of any sizes."""
    from dpprobe import probe

    normalize = document["transforms"][0]
    params = {"w": arrays["head/w"][None], "b": arrays["head/b"][None]}

    def labelled():
        for chunk in chunks:
            yield chunk, np.zeros(len(chunk), np.int32)

    for x, _, mask in probe.fixed_blocks(labelled()):
        logits = probe.block_logits(params, x, normalization=normalize["method"],
                                    groups=int(normalize["groups"]))
        yield np.asarray(logits)[:int(mask.sum()), 0]
