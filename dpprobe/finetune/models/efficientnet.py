"""timm's EfficientNet (and EfficientNet-Lite, MobileNet-style stacks of the same blocks) in
Flax NNX, converted from a timm (torch) instance with its weights.

Tan & Le 2019 (https://arxiv.org/abs/1905.11946). The forward is timm 1.0.31's
`EfficientNet.forward` in eval mode on NHWC input:

    conv_stem -> bn1 (BatchNorm + act) -> blocks -> conv_head -> bn2 -> mean over H, W -> head

with blocks of two kinds (timm's `_efficientnet_blocks`):
  * DepthwiseSeparableConv: conv_dw (depthwise) -> bn1 -> [se] -> conv_pw (1 x 1) -> bn2
    [+ x];
  * InvertedResidual (MBConv): conv_pw (1 x 1 expand) -> bn1 -> conv_dw (depthwise) -> bn2 ->
    [se] -> conv_pwl (1 x 1 project) -> bn3 [+ x];
and squeeze-excite x * gate(conv_expand(act(conv_reduce(mean_HW(x))))). BatchNorm is frozen at
its running statistics (`finetune.models.layers`), so each example's logits depend on that
example only. `tf_` models pad their strided convolutions as TF's "same" (timm's
`Conv2dSame`). Dropout and drop path are not reproduced (identities in eval mode). Supported:
`efficientnet_b*`, `tf_efficientnet_b*`, `efficientnet_lite*`, `tf_efficientnet_lite*`,
`mobilenetv2_*` and other timm `EfficientNet` instances built from these blocks; refused with
a ValueError: EdgeResidual/CondConv/UIR blocks, space-to-depth stems, anti-aliasing, pooling
other than average.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from dpprobe.finetune.models import layers
from dpprobe.finetune.models.common import HeadOnFeatures

__all__ = ["EfficientNet", "efficientnet_from_timm"]


class SqueezeExcite(nnx.Module):
    """x * gate(conv_expand(act(conv_reduce(mean over H, W of x)))), per example."""

    def __init__(self, se: Any):
        self.conv_reduce = layers.conv_from_torch(se.conv_reduce)
        self.conv_expand = layers.conv_from_torch(se.conv_expand)
        self.act = layers.activation_name(se.act1)
        self.gate = layers.activation_name(se.gate)

    def __call__(self, x: jax.Array) -> jax.Array:
        s = x.mean(axis=(-3, -2), keepdims=True)
        s = self.conv_expand(layers.ACTIVATIONS[self.act](self.conv_reduce(s)))
        return x * layers.ACTIVATIONS[self.gate](s)


class Block(nnx.Module):
    """One DepthwiseSeparableConv or InvertedResidual block: its layers in timm's order."""

    _LAYERS = {"DepthwiseSeparableConv": ("conv_dw", "bn1", "se", "conv_pw", "bn2"),
               "InvertedResidual": ("conv_pw", "bn1", "conv_dw", "bn2", "se", "conv_pwl",
                                    "bn3")}

    def __init__(self, block: Any):
        kind = type(block).__name__
        if kind not in self._LAYERS:
            raise ValueError(f"unsupported EfficientNet block {kind}")
        if getattr(block, "conv_s2d", None) is not None:
            raise ValueError("space-to-depth blocks are not supported")
        if type(block.aa).__name__ != "Identity":
            raise ValueError(f"anti-aliasing is not supported: {block.aa}")
        self.order = self._LAYERS[kind]
        for name in self.order:
            layer = getattr(block, name)
            if name == "se":
                layer = None if type(layer).__name__ == "Identity" else SqueezeExcite(layer)
            elif name.startswith("bn"):
                layer = layers.batchnorm_from_torch(layer)
            else:
                layer = layers.conv_from_torch(layer)
            setattr(self, name, layer)
        self.has_skip = bool(block.has_skip)

    def __call__(self, x: jax.Array) -> jax.Array:
        shortcut = x
        for name in self.order:
            layer = getattr(self, name)
            if layer is not None:
                x = layer(x)
        return x + shortcut if self.has_skip else x


class EfficientNet(HeadOnFeatures):
    """timm's EfficientNet in NNX (module docstring); built by `efficientnet_from_timm`."""

    def __init__(self, timm_model: Any, head: nnx.Linear):
        self.conv_stem = layers.conv_from_torch(timm_model.conv_stem)
        self.bn1 = layers.batchnorm_from_torch(timm_model.bn1)
        self.blocks = nnx.List([nnx.List([Block(b) for b in stage])
                                for stage in timm_model.blocks])
        if type(timm_model.conv_head).__name__ == "Identity":
            self.conv_head = self.bn2 = None
        else:
            self.conv_head = layers.conv_from_torch(timm_model.conv_head)
            self.bn2 = layers.batchnorm_from_torch(timm_model.bn2)
        self.head = head

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (timm's `forward_head(..., pre_logits=True)`): (N, H, W, C) -> (N, D)."""
        x = self.bn1(self.conv_stem(x))
        for stage in self.blocks:
            for block in stage:
                x = block(x)
        if self.conv_head is not None:
            x = self.bn2(self.conv_head(x))
        return x.mean(axis=(-3, -2))


def _check_supported(timm_model: Any) -> None:
    """Raise ValueError for a block, pooling or layer this module does not reproduce."""
    pool = timm_model.global_pool
    if getattr(pool, "pool_type", "avg") != "avg":
        raise ValueError(f"EfficientNet pooling must be 'avg', got {pool.pool_type!r}")


efficientnet_from_timm = layers.timm_builder(EfficientNet, "classifier", _check_supported)
