"""The tune job's calls into `probe` (the private feature standardization, training a list of
runs, each trial's (noisy) correct count, the final test) and its read of a public validation
set. Host work and accounting stay in `pipelines.tune_job`; `probe` (JAX) is imported on first
use."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpprobe import accounting

__all__ = ["correct_counts", "load_public_validation", "private_standardization", "test_metrics",
           "train_runs"]


def private_standardization(normalized, labels, spec, mu: float):
    """The tune job's private feature standardization of `normalized` (features after
    `spec`'s per-example normalization, which bounds their norm): `probe.private_standardizer`
    at mu-GDP (two Gaussian releases of noise multiplier sqrt(2) / mu, each example clipped to
    the normalization's norm bound; labels outside the class set make null rows, as in
    training). Returns (standardizer, its DpPlan for the ledger)."""
    from dpprobe import dp, probe

    bound = probe.normalized_norm_bound(spec.normalization, normalized.shape[-1])
    sigma = math.sqrt(2.0) / mu
    labels = np.asarray(labels)
    standardizer = probe.private_standardizer(
        normalized, noise_multiplier=sigma, clip_norm=bound, key=dp.make_keys(1)[0],
        mask=dp.valid_labels(labels, spec.num_classes))
    return standardizer, accounting.DpPlan(sigma, 2, 1.0, bound)


def train_runs(features, labels, runs: Sequence, spec, quiet: bool) -> dict:
    """Train `runs` full batch (fresh OS-entropy keys); the stacked params."""
    from dpprobe import dp, probe

    result = probe.train_probe(features, labels, runs, dp.make_keys(len(runs)), spec,
                               progress=not quiet)
    return result.params


def correct_counts(params, features, labels, sigma: float | None, spec) -> np.ndarray:
    """Each trial's correct count on the scored data, plus N(0, sigma^2); exact with sigma None
    (public scoring)."""
    from dpprobe import probe

    kwargs = dict(normalization=spec.normalization, groups=spec.groups)
    if sigma is None:
        return probe.correct_counts(params, features, labels, **kwargs)
    return probe.noisy_correct_counts(params, features, labels, sigma, **kwargs)


def test_metrics(params, features, labels, spec) -> dict:
    """Test metrics of the final probe (the test split is public; its only use)."""
    from dpprobe import probe

    return probe.evaluate(params, features, labels, normalization=spec.normalization,
                          groups=spec.groups)


def load_public_validation(spec: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of a public validation set, `npz:PATH` holding `features` (in the
    store's feature space: the same backbone and preprocessing) and `labels`."""
    kind, _, path = spec.partition(":")
    if kind != "npz" or not path:
        raise ValueError(f"`public_validation` must be npz:PATH (features, labels), got {spec!r}")
    try:
        with np.load(path, allow_pickle=False) as data:
            features, labels = np.asarray(data["features"]), np.asarray(data["labels"])
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"cannot read the public validation set {path}: {err}") from err
    if features.ndim not in (2, 3) or features.shape[-1] != dim or len(labels) != len(features):
        raise ValueError(f"public validation set {path}: features {features.shape} and labels "
                         f"{labels.shape} do not fit the store's feature dim {dim}")
    return features, labels.astype(np.int32)
