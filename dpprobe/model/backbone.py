"""The backbone a feature-space model was trained behind, rebuilt from the store's provenance
(recorded in the model file) by `extract`'s own code, so that images become the features the
probe reads: the same timm model and weights (a local file whose sha256 must match the record,
or the recorded random init) and the same preprocessing, or ScatterNet.

Refused in one line: a model trained on precomputed embeddings (no backbone to run), weights
not on this machine, a weights file whose sha256 differs from the record, and a rebuilt
backbone whose preprocessing differs from the record (e.g. another timm version's config).
"""

from __future__ import annotations

import math
import os

__all__ = ["backbone_input_shape", "load_backbone"]

# Preprocessing fields that must match the record for the features to be the same.
_CHECKED = ("kind", "input_size", "mean", "std", "crop_pct", "crop_mode", "interpolation",
            "resize", "crop", "scale")


def load_backbone(record: dict, path: str, *, weights: str | None = None, device=None,
                  dim: int | None = None):
    """`extract.Backbone` of a model file's backbone record.

    Args:
      record: the file's "backbone" entry ({"backbone": provenance, "preprocessing": ...}).
      path: the model file (named in errors).
      weights: a local weights file to use instead of the recorded path (its sha256 must be
        the recorded one).
      device: torch device (default: cuda if available).
      dim: the head's number of features: ScatterNet's channels when the record names none
        (a store of arrays, or one written before the mode was recorded), so that every image
        is converted to them.
    """
    from dpprobe import extract

    provenance, prep = record.get("backbone") or {}, record.get("preprocessing") or {}
    name = provenance.get("name")
    if name in (None, "none"):
        raise ValueError(f"{path} was trained on precomputed embeddings (backbone none): give "
                         "it features, not images")
    resize, crop = prep.get("resize"), prep.get("crop")
    side = (prep.get("input_size") or [None])[-1]
    if name != "scatternet" and crop is None and resize and side and resize < side:
        # Written before `--resize R` alone below the model's side kept the whole R x R image:
        # timm's transform resized it back to the model's side (crop_pct 1), which resize =
        # crop = that side reproduces exactly.
        resize = crop = side
        prep = prep | {"resize": side, "crop": side}
    if name == "scatternet":
        backbone = extract.create_backbone("scatternet", resize=resize, crop=crop, device=device,
                                           mode=prep.get("mode") or _scatternet_mode(record, dim))
    else:
        source = provenance.get("weights_source")
        kwargs = {}
        if source == "file":
            file = weights or provenance.get("weights_file")
            if not file or not os.path.isfile(file):
                raise FileNotFoundError(
                    f"{path}: the backbone's weights file {file} is not on this machine; pass "
                    f"`weights=PATH` to a copy (sha256 {provenance.get('weights_sha256')})")
            digest = extract.file_sha256(file)
            if digest != provenance.get("weights_sha256"):
                raise ValueError(f"{path}: weights file {file} has sha256 {digest}, the model "
                                 f"was trained on {provenance.get('weights_sha256')}; refusing "
                                 "other weights")
            kwargs["weights"] = file
        elif source == "random-init":
            if weights is not None:
                raise ValueError(f"{path}: the backbone was randomly initialized (seed "
                                 f"{provenance.get('seed')}); it takes no `weights`")
            kwargs |= {"random_init": True, "seed": int(provenance.get("seed") or 0)}
        elif weights is not None:
            raise ValueError(f"{path}: the backbone's weights came from the hub without a "
                             "recorded sha256; `weights` cannot be checked against them")
        backbone = extract.create_backbone(name, resize=resize, crop=crop, device=device,
                                           **kwargs)
    differ = [k for k in _CHECKED if k in prep and backbone.preprocessing.get(k) != prep[k]
              and not _same_number_list(backbone.preprocessing.get(k), prep[k])]
    if differ:
        raise ValueError(f"{path}: the rebuilt backbone {name} preprocesses differently from "
                         f"the record ({', '.join(differ)}); use the timm version it was "
                         f"trained with ({provenance.get('timm_version')})")
    return backbone


def _same_number_list(a, b) -> bool:
    try:
        return len(a) == len(b) and all(math.isclose(x, y) for x, y in zip(a, b, strict=True))
    except TypeError:
        return False


def _scatternet_mode(record: dict, dim: int | None) -> str | None:
    """"L" or "RGB": the channels whose scattering has `dim` values (None: not inferable)."""
    try:
        channels = backbone_input_shape(record, dim)[0] if dim else None
    except (ValueError, KeyError):
        return None
    return {1: "L", 3: "RGB"}.get(channels)


def backbone_input_shape(record: dict, dim: int) -> tuple[int, int, int]:
    """(channels, height, width) of the images the backbone takes: timm's input size, or for
    ScatterNet the square single- or three-channel image whose scattering has `dim` values."""
    provenance, prep = record.get("backbone") or {}, record.get("preprocessing") or {}
    if provenance.get("name") == "scatternet":
        per_channel = int(provenance["coefficients_per_channel"])
        for channels in (1, 3):
            side = math.isqrt(dim // (channels * per_channel)) if dim % (
                channels * per_channel) == 0 else 0
            if side and side * side * channels * per_channel == dim:
                return channels, side * 2 ** int(provenance["J"]), side * 2 ** int(
                    provenance["J"])
        raise ValueError(f"cannot infer the ScatterNet input size from {dim} features")
    size = prep.get("input_size")
    if not size:
        raise ValueError("the backbone's input size is not recorded")
    return tuple(int(v) for v in size)
