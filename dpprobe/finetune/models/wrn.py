"""Wide-ResNet with GroupNorm and weight-standardized convolutions (De et al. 2022).

De et al., "Unlocking High-Accuracy Differentially Private Image Classification through Scale"
(https://arxiv.org/abs/2204.13650), Sec. 3.1 and App. C.1: the WRN-d-k of Zagoruyko & Komodakis
(2016) with every BatchNorm replaced by GroupNorm (16 groups), every convolution weight-
standardized, no dropout. Layout as in the authors' reference (jax_privacy's
`image_classification/models/cifar.py`):

    stem: WSConv 3x3, 16 channels
    3 groups of n = (d - 4) / 6 blocks, widths 16k, 32k, 64k, strides 1, 2, 2; each block is
        h = conv3x3(GN(relu(x)));  h = conv3x3(GN(relu(h)));  out = h + shortcut
      where the first block of a group has the shortcut conv1x1(GN(relu(x))) (its own GN, the
      group's stride) and the others the identity
    relu -> GN -> global average pool -> zero-initialized linear head

Note the order activation -> GroupNorm -> convolution, which is the reference's (not BN-ReLU
pre-activation). Weight standardization per output filter i, over its fan-in (kh, kw, c_in):

    W_hat[..., i] = gain_i * (W[..., i] - mean_i) / sqrt(max(fan_in * var_i, 1e-4))

(population variance), i.e. the paper's (W - mu) / (sigma sqrt(fan_in)) with the reference's
floor and learnable per-filter gain; each convolution also has a bias. 3x3 convolutions pad 1
on each side (torch's WRN; the reference's SAME padding pads (0, 1) at stride 2).
GroupNorm eps is 1e-5 (haiku's and torch's default). For 28 x 28 inputs the maps are
28, 14, 7; for 32 x 32 they are 32, 16, 8.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype

from dpprobe.finetune.models._conv import conv2d
from dpprobe.finetune.models.common import float32_logits, zero_head

__all__ = ["WSConv", "WideResNet", "standardize_weight"]

GROUPS = 16
GROUP_NORM_EPS = 1e-5
WS_EPS = 1e-4


def standardize_weight(kernel: jax.Array, gain: jax.Array, eps: float = WS_EPS) -> jax.Array:
    """Scaled weight standardization of an HWIO kernel (statistics in at least float32).

    Returns gain * (kernel - mean) / sqrt(max(fan_in * var, eps)), mean and (population)
    variance over the fan-in axes (0, 1, 2), fan_in = kh * kw * c_in; same dtype as `kernel`.
    """
    w = kernel.astype(jnp.promote_types(kernel.dtype, jnp.float32))
    mean = w.mean(axis=(0, 1, 2), keepdims=True)
    var = w.var(axis=(0, 1, 2), keepdims=True)
    fan_in = math.prod(kernel.shape[:-1])
    scale = jax.lax.rsqrt(jnp.maximum(fan_in * var, eps)) * gain.astype(w.dtype)
    return ((w - mean) * scale).astype(kernel.dtype)


class WSConv(nnx.Module):
    """NHWC convolution with a weight-standardized HWIO kernel, per-filter gain, and bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 *, rngs: nnx.Rngs):
        shape = (kernel_size, kernel_size, in_channels, out_channels)
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape))
        self.gain = nnx.Param(jnp.ones((out_channels,)))
        self.bias = nnx.Param(jnp.zeros((out_channels,)))
        self.stride = stride
        self.padding = (kernel_size - 1) // 2

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = standardize_weight(self.kernel[...], self.gain[...])
        x, kernel, bias = promote_dtype((x, kernel, self.bias[...]))
        return conv2d(x, kernel, self.stride, self.padding) + bias


def _group_norm(channels: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
    """GroupNorm(16 groups), two-pass float32 statistics within one example."""
    return nnx.GroupNorm(channels, num_groups=GROUPS, epsilon=GROUP_NORM_EPS,
                         use_fast_variance=False, rngs=rngs)


class Block(nnx.Module):
    """Residual block relu-GN-conv3x3 twice; a relu-GN-conv1x1 shortcut when `project`."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, project: bool,
                 *, rngs: nnx.Rngs):
        self.norm1 = _group_norm(in_channels, rngs)
        self.conv1 = WSConv(in_channels, out_channels, 3, stride, rngs=rngs)
        self.norm2 = _group_norm(out_channels, rngs)
        self.conv2 = WSConv(out_channels, out_channels, 3, rngs=rngs)
        if project:
            self.skip_norm = _group_norm(in_channels, rngs)
            self.skip_conv = WSConv(in_channels, out_channels, 1, stride, rngs=rngs)
        else:
            self.skip_norm = self.skip_conv = None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1(self.norm1(jax.nn.relu(x)))
        h = self.conv2(self.norm2(jax.nn.relu(h)))
        if self.skip_conv is None:
            return h + x
        return h + self.skip_conv(self.skip_norm(jax.nn.relu(x)))


class WideResNet(nnx.Module):
    """WRN-depth-width with GroupNorm and weight standardization; zero-initialized head."""

    def __init__(self, num_classes: int, *, depth: int, width: int, image_size: int,
                 in_channels: int, rngs: nnx.Rngs, head_bias_init: float = 0.0):
        if depth < 10 or (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n + 4 with n >= 1, got {depth}")
        if image_size < 4:
            raise ValueError(f"image_size must be >= 4 (two stride-2 stages), got {image_size}")
        blocks_per_group = (depth - 4) // 6
        self.stem = WSConv(in_channels, 16, 3, rngs=rngs)
        blocks, channels = [], 16
        for group, stride in enumerate((1, 2, 2)):
            out_channels = 16 * width * 2**group
            for i in range(blocks_per_group):
                blocks.append(Block(channels, out_channels, stride if i == 0 else 1, i == 0,
                                    rngs=rngs))
                channels = out_channels
        self.blocks = nnx.List(blocks)
        self.final_norm = _group_norm(channels, rngs)
        self.head = zero_head(channels, num_classes, head_bias_init=head_bias_init, rngs=rngs)

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits: the pooled final feature map, (N, H, W, C) -> (N, 64 * width)."""
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(jax.nn.relu(x)).mean(axis=(1, 2))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))

