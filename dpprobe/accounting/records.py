"""What a job's results may hold: DP outputs and public inputs, never statistics of private data.

Published (results JSON, CSV, plots, stdout):
  * DP outputs: the noised models and what is computed from them on public data (test metrics),
    noisy selection scores, and everything derived from those;
  * public inputs: the job's arguments, the privacy parameters and accounting, the store's
    description that does not depend on the private records: backbone, weights identity,
    preprocessing, the declared class list, shapes, dtype, the dataset size N (public under
    zero-out neighbours).
Never published: fingerprints of the data, clipping counts, sampled batch sizes, anything the
noise or the batches could be replayed from (seeds of a mechanism), label-derived shapes. Such
statistics go to the local diagnostics file (`write_diagnostics`), which must not be shared.
Nor any time of a run over private data: its duration, a rate, the time it ended, the store's
created/completed times (each as long as the records took); those go to the owner's timing
file (`dpprobe.timings`), which must not be shared either.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math

__all__ = [
    "DIAGNOSTICS_WARNING",
    "VERSION",
    "declared_num_classes",
    "header",
    "now",
    "public_split_attrs",
    "randomness",
    "warnings",
]

VERSION = importlib.metadata.version("dpprobe")

DIAGNOSTICS_WARNING = ("PRIVATE: exact statistics of the private training data (not DP). For "
                       "local debugging only; never share or publish this file.")

# The split attributes that describe a store without depending on its private records (not its
# created/completed times: extraction lasts as long as its records take).
_PUBLIC_SPLIT_KEYS = ("split", "num_examples", "feature_shape", "feature_dim", "views", "dtype",
                      "num_classes", "backbone", "preprocessing", "complete")
_PUBLIC_DATASET_KEYS = ("name", "spec", "split", "num_examples", "num_classes", "class_names")


def now() -> str:
    """UTC time, ISO 8601 to the second (for the private files only: diagnostics, timings)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def header(job: str, store, train_attrs: dict, test_attrs: dict) -> dict:
    """What every job's results begin with: version, job, store and its public description
    (no time: the owner's timing file has it, `dpprobe.timings`)."""
    return {
        "dpprobe_version": VERSION,
        "job": job,
        "store": str(store),
        "provenance": {"train": public_split_attrs(train_attrs),
                       "test": public_split_attrs(test_attrs)},
    }


def public_split_attrs(attrs: dict) -> dict:
    """A split's attributes without what depends on its records (the data fingerprint, the
    created/completed times)."""
    out = {k: attrs[k] for k in _PUBLIC_SPLIT_KEYS if k in attrs}
    dataset = attrs.get("dataset") or {}
    out["dataset"] = {k: dataset[k] for k in _PUBLIC_DATASET_KEYS if k in dataset}
    return out


def declared_num_classes(*split_attrs: dict) -> int:
    """The class count the store declares (a public input fixed at extraction), never one read
    off the private labels; every split must declare the same."""
    declared = {attrs.get("num_classes") for attrs in split_attrs}
    if len(declared) != 1 or not isinstance(next(iter(declared)), int):
        raise ValueError(f"the store's splits must declare one class count (num_classes), got "
                         f"{sorted(map(str, declared))}; re-extract with a declared class list")
    (count,) = declared
    if count < 2:
        raise ValueError(f"a classifier needs at least 2 classes, the store declares {count}")
    return count


def randomness(seed: int | None, drives: str) -> dict:
    """How a job drew its randomness; the seed itself is never written."""
    return {
        "noise_keys": "os-entropy",
        "batch_sampling_randomness": "os-entropy",
        "seed": "given" if seed is not None else "none",
        "seed_drives": (f"only {drives}, never a mechanism" if seed is not None else None),
    }


def warnings(train_attrs: dict | None = None, *, delta: float | None = None,
             num_examples: int | None = None) -> list[str]:
    """What a user must know about a job's guarantee or its features: a delta of at least 1/N,
    and features of a randomly initialized backbone. Jobs print them, record them in their
    results as "warnings", and the plots show them.

    Args:
      train_attrs: the store's train split attributes (its backbone provenance), if any.
      delta, num_examples: the job's delta and N, if any.

    Returns:
      The warnings, as sentences; read off public inputs only.
    """
    out = []
    if delta is not None and num_examples and delta >= 1.0 / num_examples:
        suggested = 10.0 ** -(math.ceil(math.log10(num_examples)) + 1)
        out.append(f"delta = {delta:g} >= 1/N = {1 / num_examples:.3g}: a mechanism that "
                   "publishes a few records outright meets such a delta; choose delta well "
                   f"below 1/N (e.g. --delta {suggested:g})")
    backbone = (train_attrs or {}).get("backbone") or {}
    if backbone.get("weights_source") == "random-init":
        out.append(f"the features come from a RANDOMLY INITIALIZED backbone "
                   f"({backbone.get('name')}, seed {backbone.get('seed')}): they carry no "
                   "pretrained knowledge; fine for tests, meaningless for accuracy")
    return out
