"""Private model selection: each candidate's count of correct predictions, plus Gaussian noise.

Formal guarantee:
  under zero-out neighbours a record replaced by a null record changes each count by at most 1 (a
  null record, like a row with non-finite features or a label outside [0, C), is never counted as
  correct), so releasing k noisy counts with noise std sigma is the Gaussian mechanism with
  sensitivity 1, k times: `DpPlan(sigma, steps=k, clip_norm=1)`. The noise comes from a generator
  seeded by OS entropy.
"""

from __future__ import annotations

import numpy as np

from dpprobe.probe.evaluation import count_totals

__all__ = ["correct_counts", "noisy_correct_counts"]


def correct_counts(params: dict, features, labels, *, normalization: str = "none",
                   groups: int = 1) -> np.ndarray:
    """Exact number of rows each stacked model (P of them) classifies correctly: (P,) int.

    Rows with non-finite logits or labels outside [0, C) never count (`count_totals`). An
    exact statistic of `features`: publish it only if they are public (else use
    `noisy_correct_counts`).
    """
    top1 = count_totals(params, [(features, labels)], top_k=1, normalization=normalization,
                        groups=groups)[0]
    return np.rint(top1).astype(np.int64)


def noisy_correct_counts(params: dict, features, labels, noise_multiplier: float, *,
                         normalization: str = "none", groups: int = 1) -> np.ndarray:
    """`correct_counts` + N(0, noise_multiplier^2) each (float64): k Gaussian mechanisms of
    sensitivity 1 (module docstring), to be recorded as `DpPlan(noise_multiplier, k)`."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    counts = correct_counts(params, features, labels, normalization=normalization, groups=groups)
    return counts + noise_multiplier * np.random.default_rng().standard_normal(counts.shape)
