"""timm's ResNet in Flax NNX, converted from a timm (torch) instance with its weights.

He et al. 2016 (https://arxiv.org/abs/1512.03385). The forward is timm 1.0.31's
`ResNet.forward` in eval mode on NHWC input:

    conv1 (7 x 7, stride 2) -> bn1 -> act1 -> maxpool (3 x 3, stride 2, pad 1)
    -> layer1..layer4 -> mean over H, W -> head

with BasicBlock  act2(bn2(conv2(act1(bn1(conv1(x))))) + shortcut)  and Bottleneck
act3(bn3(conv3(act2(bn2(conv2(act1(bn1(conv1(x)))))))) + shortcut), the shortcut x or
downsample = bn(conv1x1(x)). BatchNorm is frozen at its running statistics
(`finetune.models.layers`), so each example's logits depend on that example only. Drop block
and drop path are not reproduced (identities in eval mode). Supported: timm's `resnet*` and
`resnext*` (grouped 3 x 3 convolutions) with the single-convolution stem; refused with a
ValueError: deep stems (resnet*c/d), average-pool downsampling, squeeze-excite and
anti-aliasing variants, pooling other than average.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from dpprobe.finetune.models.common import HeadOnFeatures
from dpprobe.finetune.models.layers import (
    ACTIVATIONS,
    activation_name,
    batchnorm_from_torch,
    conv_from_torch,
    is_identity,
    timm_builder,
)

__all__ = ["ResNet", "resnet_from_timm"]


class Block(nnx.Module):
    """A BasicBlock (two convolutions) or Bottleneck (three), with its shortcut."""

    def __init__(self, block: Any):
        kind = type(block).__name__
        if kind not in ("BasicBlock", "Bottleneck"):
            raise ValueError(f"unsupported ResNet block {kind}")
        if not (is_identity(block.se) and is_identity(block.aa)):
            raise ValueError("squeeze-excite and anti-aliasing ResNet blocks are not supported")
        depth = 2 if kind == "BasicBlock" else 3
        self.depth = depth
        for i in range(1, depth + 1):
            setattr(self, f"conv{i}", conv_from_torch(getattr(block, f"conv{i}")))
            setattr(self, f"bn{i}", batchnorm_from_torch(getattr(block, f"bn{i}")))
        self.acts = tuple(activation_name(getattr(block, f"act{i}"))
                          for i in range(1, depth + 1))
        down = block.downsample
        if down is None:
            self.down_conv = self.down_bn = None
        elif (type(down).__name__ == "Sequential" and len(down) == 2
              and type(down[0]).__name__ == "Conv2d"):
            self.down_conv = conv_from_torch(down[0])
            self.down_bn = batchnorm_from_torch(down[1])
        else:
            raise ValueError(f"unsupported ResNet downsample: {down}")

    def __call__(self, x: jax.Array) -> jax.Array:
        shortcut = x if self.down_conv is None else self.down_bn(self.down_conv(x))
        for i in range(1, self.depth + 1):
            x = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(x))
            if i < self.depth:
                x = ACTIVATIONS[self.acts[i - 1]](x)
        return ACTIVATIONS[self.acts[-1]](x + shortcut)


def _max_pool(x: jax.Array) -> jax.Array:
    """torch's MaxPool2d(3, stride 2, padding 1) on NHWC (padding never wins: -inf)."""
    window = (1,) * (x.ndim - 3) + (3, 3, 1)
    strides = (1,) * (x.ndim - 3) + (2, 2, 1)
    pads = ((0, 0),) * (x.ndim - 3) + ((1, 1), (1, 1), (0, 0))
    return jax.lax.reduce_window(x, -jax.numpy.inf, jax.lax.max, window, strides, pads)


class ResNet(HeadOnFeatures):
    """timm's ResNet in NNX (module docstring); built by `resnet_from_timm`."""

    def __init__(self, timm_model: Any, head: nnx.Linear):
        self.conv1 = conv_from_torch(timm_model.conv1)
        self.bn1 = batchnorm_from_torch(timm_model.bn1, activation_name(timm_model.act1))
        for i in range(1, 5):
            setattr(self, f"layer{i}", nnx.List([Block(b) for b in getattr(timm_model,
                                                                            f"layer{i}")]))
        self.head = head

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (timm's `forward_head(..., pre_logits=True)`): (N, H, W, C) -> (N, D)."""
        x = _max_pool(self.bn1(self.conv1(x)))
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in layer:
                x = block(x)
        return x.mean(axis=(-3, -2))


def _check_supported(timm_model: Any) -> None:
    """Raise ValueError for a stem, block or pooling this module does not reproduce."""
    if type(timm_model.conv1).__name__ != "Conv2d":
        raise ValueError("deep-stem ResNets (resnet*c, resnet*d) are not supported")
    pool = timm_model.maxpool
    if (type(pool).__name__ != "MaxPool2d" or pool.kernel_size != 3 or pool.stride != 2
            or pool.padding != 1):
        raise ValueError(f"the ResNet stem pool must be MaxPool2d(3, 2, 1), got {pool}")
    if getattr(timm_model.global_pool, "pool_type", "avg") != "avg":
        raise ValueError("ResNet pooling must be 'avg'")


resnet_from_timm = timm_builder(ResNet, "fc", _check_supported)
