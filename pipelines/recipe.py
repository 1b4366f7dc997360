"""The defaults of `dpprobe tune` that depend on the store: the per-example normalization its
backbone needs.

The store's provenance names its backbone (`extract`'s `Backbone.provenance`), and that is a
public input, so choosing from it costs no privacy. Measured on Fashion-MNIST ScatterNet
features (`benchmarks/tune_recipe.py`, epsilon 3, free selection over r, T = 100): without
normalization the best r of the linear scaling search lies far outside any sensible range and
the tuned model reaches 78.7-81.5%; Tramer & Boneh's GroupNorm over ScatterNet's channel groups
gives 89.4-89.8%, with 9, 27 or 81 groups alike (within run-to-run noise); 27 is their choice.
"""

from __future__ import annotations

__all__ = ["SCATTERNET_MAX_GROUPS", "backbone_normalization"]

# Tramer & Boneh (2021, https://arxiv.org/abs/2011.11660) normalize ScatterNet's 81 channels
# (J = 2, L = 8) in 27 groups.
SCATTERNET_MAX_GROUPS = 27


def backbone_normalization(backbone: dict | None) -> tuple[str, int | None]:
    """(normalization, groups) for a store whose backbone provenance is `backbone`.

    * ScatterNet: GroupNorm whose groups are whole scattering channels, the largest divisor of
      the coefficients per input channel that is at most 27 (27 for J = 2, L = 8). The features
      are channel-major, (input channels x coefficients x H x W), so a group of d / G
      contiguous features is a run of whole channels whenever G divides the coefficients per
      input channel, whatever the number of input channels and the spatial size.
    * timm backbones and precomputed embeddings: none. Not measured here (no pretrained weights
      offline); the pooled embeddings of ViTs leave the model through its final LayerNorm, and
      unit-norm ("l2") features would move the best total step size r by about sqrt(d), out of
      the default search range.
    """
    backbone = backbone or {}
    if backbone.get("name") == "scatternet":
        channels = int(backbone.get("coefficients_per_channel") or 0)
        if channels > 0:
            groups = max(g for g in range(1, SCATTERNET_MAX_GROUPS + 1) if channels % g == 0)
            return "group", groups
    return "none", None
