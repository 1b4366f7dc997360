"""Private feature standardization: per-feature mean and scale, each released once with the
Gaussian mechanism, then x -> (x - mean) / scale for every example.

Tramer & Boneh (2021, https://arxiv.org/abs/2011.11660, "data normalization") standardize
ScatterNet features with privately estimated statistics. Here, on the features after their
per-example normalization:

    mean  = (sum_i clip_B(x_i)                + N(0, (sigma B)^2 I)) / N
    scale = (sum_i clip_B'(|x_i - mean|)      + N(0, (sigma B')^2 I)) / N * sqrt(pi / 2)

with B' = B + ||mean|| (|x_i - mean| has norm at most ||x_i|| + ||mean||, so it is clipped only
when x_i is), and the scale floored at `floor_multiple` times its noise std, so that no feature
is divided by noise. The scale is the mean absolute deviation, rescaled to the standard
deviation of a Gaussian: its per-example vector has a bounded norm, where a variance would need
the squares of the features (norm up to ||x||^2) to be clipped.

Formal guarantee:
  For zero-out neighbours (N public): a row replaced by a null row (non-finite features, or masked
  out) contributes nothing to either sum, and every other row contributes at most B (then B') in L2
  norm, so each release is the Gaussian mechanism of noise multiplier sigma: together
  `accounting.DpPlan(sigma, steps=2)`. The second release depends on the first only through its
  (public) output: adaptive composition, which the plan's two steps account for. Noise keys come
  from OS entropy (`dp.make_keys`). In floating point: both sums are float64, a BLAS dot over
  blocks of `block_rows` rows (8192 by default) and a compensated sum across blocks
  (`dp.accumulate`), and the noise is added in float64, so one row moves a computed sum by at
  most B (1 + 2 b^2 2^-53 + 5 N 2^-53) <= B (1 + 6e-7) for N up to 10^9 and b = 8192.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dpprobe.dp.accumulate import CompensatedSum
from dpprobe.dp.noise import gaussian_noise

__all__ = ["Standardizer", "private_standardizer", "clipped_row_sum"]


@dataclasses.dataclass(frozen=True)
class Standardizer:
    """x -> (x - mean) / scale, per feature. A DP output when made by `private_standardizer`.

    Attributes:
      mean, scale: (d,) float32.
      noise_multiplier, clip_norms: of the two releases (mean, then scale).
      floor: the smallest scale (a multiple of the scale's noise std).
    """

    mean: np.ndarray
    scale: np.ndarray
    noise_multiplier: float = 0.0
    clip_norms: tuple[float, float] = (math.inf, math.inf)
    floor: float = 0.0

    def apply(self, features) -> np.ndarray:
        """Standardized float32 features, (..., d)."""
        return ((np.asarray(features, np.float32) - self.mean) / self.scale).astype(np.float32)

    def fold(self, params: dict) -> dict:
        """Stacked linear models {"w": (P, d, C), "b": (P, C)} on standardized features, as
        the same models on the features before standardization: w / scale, b - (mean/scale) w.
        """
        w = np.asarray(params["w"], np.float64) / self.scale[None, :, None]
        b = np.asarray(params["b"], np.float64) - np.einsum("d,pdc->pc", self.mean, w)
        return {"w": w.astype(np.float32), "b": b.astype(np.float32)}

    def to_dict(self) -> dict:
        """The public description (the statistics themselves go with the model)."""
        return {"noise_multiplier": self.noise_multiplier,
                "clip_norms": [float(c) for c in self.clip_norms], "floor": self.floor,
                "num_floored": int(np.sum(self.scale <= np.float32(self.floor)))}


def clipped_row_sum(rows: np.ndarray, clip_norm: float, mask=None) -> np.ndarray:
    """sum_i min(1, B / ||v_i||) v_i over the rows v_i of (N, d) (float64); rows that are not
    finite or whose `mask` is 0 contribute nothing (null rows). Each row contributes at most
    `clip_norm` in L2: rows are scaled to a hair below it (a relative 1e-12, far above float64
    rounding), and a norm that overflows makes a null row. Floating-point warnings are
    silenced: whether one fires would tell whether some row is null or zero."""
    with np.errstate(all="ignore"):
        rows = np.asarray(rows, np.float64)
        finite = np.isfinite(rows).all(axis=1)
        if mask is not None:
            finite &= np.asarray(mask) > 0
        rows = np.where(finite[:, None], rows, 0.0)
        norms = np.linalg.norm(rows, axis=1)
        bound = clip_norm * (1.0 - 1e-12)
        over = norms > bound
        factor = np.where(over, bound / np.where(over, norms, 1.0), 1.0)
        factor = np.where(np.isfinite(norms), factor, 0.0)
        return factor @ rows


def private_standardizer(features, *, noise_multiplier: float, clip_norm: float,
                         key: jax.Array, mask=None, floor_multiple: float = 3.0,
                         block_rows: int = 8192) -> Standardizer:
    """Release per-feature mean and scale of `features` with the Gaussian mechanism.

    Args:
      features: (N, d), or (N, views, d) (an example's views are averaged for the statistics),
        after their per-example normalization. Rows are distinct individuals.
      noise_multiplier: sigma of each of the two releases.
      clip_norm: B, the L2 bound of each example's contribution to the mean (group-normalized
        features have norm at most sqrt(d), so B = sqrt(d) clips nothing but float32 rounding).
      key: a secret key (`dp.make_keys`); the two releases use `fold_in(key, 0)` and 1.
      mask: optional (N,); rows with mask 0 are null rows (as the trainers treat a label
        outside the class set) and contribute nothing.
      floor_multiple: the scale is at least this many times its own noise std.
      block_rows: rows per block of the float64 sums (memory only).

    Returns:
      A `Standardizer`; record it as `accounting.DpPlan(noise_multiplier, steps=2)`.
    """
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier}")
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm}")
    features = np.asarray(features)
    if features.ndim not in (2, 3):
        raise ValueError(f"features must be (N, d) or (N, views, d), got {features.shape}")
    num_examples, dim = features.shape[0], features.shape[-1]
    mask = np.ones(num_examples, bool) if mask is None else np.asarray(mask) > 0
    if mask.shape != (num_examples,):
        raise ValueError(f"mask must be ({num_examples},), got {mask.shape}")

    def rows(start):  # one block of examples, views averaged, in float64
        block = np.asarray(features[start:start + block_rows], np.float64)
        return block.mean(axis=1) if block.ndim == 3 else block

    def release(transform, bound, index):
        total = CompensatedSum()  # float64 across blocks, compensated (`dp.accumulate`)
        for start in range(0, num_examples, block_rows):
            block_mask = mask[start:start + block_rows]
            total.add(clipped_row_sum(transform(rows(start)), bound, block_mask))
        total = np.asarray(total.value(), np.float64)
        noise = np.asarray(gaussian_noise(jax.random.fold_in(key, index), dim, np.float64))
        return (total + noise_multiplier * bound * noise) / num_examples

    # The mean is rounded to float32 (as released) before anything else is computed from it,
    # so that B' and the floor written to the results are functions of the release.
    mean = release(lambda v: v, clip_norm, 0).astype(np.float32).astype(np.float64)
    deviation_bound = clip_norm + float(np.linalg.norm(mean))
    scale = release(lambda v: np.abs(v - mean), deviation_bound, 1) * math.sqrt(math.pi / 2)
    floor = floor_multiple * noise_multiplier * deviation_bound / num_examples * math.sqrt(
        math.pi / 2)
    scale = np.maximum(scale, floor)
    return Standardizer(mean.astype(np.float32), scale.astype(np.float32),
                        float(noise_multiplier), (float(clip_norm), deviation_bound), floor)
