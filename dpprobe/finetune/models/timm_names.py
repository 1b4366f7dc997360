"""The way back from our ResNet / EfficientNet / ConvNeXt / BiT ResNetV2 to timm: every
`nnx.Param` and frozen BatchNorm statistic of the NNX model under its timm state-dict key, in
timm's layout.

The NNX modules mirror timm's module names (`finetune.models.resnet`, `.efficientnet`), so a
key is the module path joined by dots, with the head under timm's name (`fc`, `classifier`),
a ResNet shortcut's `down_conv`/`down_bn` as `downsample.0`/`.1`, ConvNeXt's `head_norm` and
MLP `mlp_fc1`/`mlp_fc2` as `head.norm`, `mlp.fc1`/`.fc2` (as 1 x 1 convolutions, (out, in, 1,
1), where timm holds them so: `ConvNeXt.conv_mlp`), a ResNetV2's `stem_conv`/`downsample_conv`
as `stem.conv`/`downsample.conv` and its head as timm's 1 x 1 convolution, and the leaves
renamed (kernel -> weight, HWIO -> OIHW for a convolution, (in, out) -> (out, in) for a
Linear; scale -> weight, mean -> running_mean, var -> running_var). `load_into_timm` writes
them into a timm model of the same architecture and requires that every timm tensor but
BatchNorm's
`num_batches_tracked` counters (unused in eval mode) is written: the inverse of
`model_from_timm`, tested both ways.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from dpprobe.finetune.models.bit import ResNetV2
from dpprobe.finetune.models.convnext import ConvNeXt
from dpprobe.finetune.models.efficientnet import EfficientNet
from dpprobe.finetune.models.layers import arrays_into_timm
from dpprobe.finetune.models.resnet import ResNet

__all__ = ["load_into_timm", "timm_arrays"]

_LEAVES = {"scale": "weight", "mean": "running_mean", "var": "running_var", "bias": "bias"}
_MODULES = {"down_conv": "downsample.0", "down_bn": "downsample.1", "head_norm": "head.norm",
            "mlp_fc1": "mlp.fc1", "mlp_fc2": "mlp.fc2"}
_HEADS = {ResNet: "fc", EfficientNet: "classifier", ConvNeXt: "head.fc"}
# BiT's ResNetV2 (`finetune.models.bit`): its stem and shortcut convolutions, its head timm's
# 1 x 1 convolution ((out, in, 1, 1)).
_HEADS[ResNetV2] = "head.fc"
_MODULES |= {"stem_conv": "stem.conv", "downsample_conv": "downsample.conv"}


def timm_arrays(model: ResNet | EfficientNet | ConvNeXt) -> dict[str, np.ndarray]:
    """timm's state-dict key -> float32 array in timm's layout, for every parameter and
    BatchNorm statistic of `model` (ValueError for another model class)."""
    if type(model) not in _HEADS:
        raise ValueError(f"timm_arrays converts a ResNet, EfficientNet, ConvNeXt or ResNetV2, got "
                         f"{type(model).__name__}")
    head = _HEADS[type(model)]
    conv_mlp = getattr(model, "conv_mlp", False)
    arrays = {}
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))):
        *modules, leaf = (str(p) for p in path)
        modules = [head if i == 0 and m == "head" else _MODULES.get(m, m)
                   for i, m in enumerate(modules)]
        array = np.asarray(value[...], np.float32)
        if leaf == "kernel":
            array = array.transpose(3, 2, 0, 1) if array.ndim == 4 else array.T
            if conv_mlp and modules[-1] in ("mlp.fc1", "mlp.fc2"):
                array = array[:, :, None, None]  # timm's 1 x 1 convolution
            if isinstance(model, ResNetV2) and ".".join(modules) == head:
                array = array[:, :, None, None]  # ResNetV2's head: a 1 x 1 convolution
            leaf = "weight"
        arrays[".".join([*modules, _LEAVES.get(leaf, leaf)])] = array
    return arrays


def load_into_timm(model: ResNet | EfficientNet | ConvNeXt, timm_model: Any) -> None:
    """Write `model`'s parameters and statistics into `timm_model` (same architecture and
    classes); ValueError if a tensor is missing on either side or has another shape."""
    arrays_into_timm(timm_arrays(model), timm_model,
                     unwritten_ok=lambda key: key.endswith("num_batches_tracked"))
