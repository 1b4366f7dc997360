"""The small tanh CNNs trained end to end with DP-SGD by Tramer & Boneh (2021).

Tramer & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)"
(https://arxiv.org/abs/2011.11660), App. Table 9, which takes the MNIST model from Papernot
et al. 2021 (tempered sigmoids, https://arxiv.org/abs/2007.14191). The paper's table was not
readable offline; the layers below are those of the authors' code (ftramer/Handcrafted-DP,
`models.py`: `MNIST_CNN` and `CIFAR10_CNN`), which the table describes.

`cnn` (MNIST / Fashion-MNIST, 28 x 28 x 1; works for any side >= 16 and any channels):
    conv 16 8x8 stride 2 pad 2 -> tanh -> maxpool 2x2 stride 1
    -> conv 32 4x4 stride 2 pad 0 -> tanh -> maxpool 2x2 stride 1
    -> flatten -> linear 32 -> tanh -> linear num_classes
  (28 x 28: maps 13, 12, 5, 4, so 4 * 4 * 32 = 512 flattened features.)
`cnn_cifar` (CIFAR-10, 32 x 32 x 3; any side divisible by 8):
    [conv 3x3 pad 1 -> tanh] x (32, 32), maxpool 2, x (64, 64), maxpool 2, x (128, 128), maxpool 2
    -> flatten -> linear 128 -> tanh -> linear num_classes

Flattening is in NHWC order ((h, w, c), not torch's (c, h, w)); a converted torch model needs its
first linear layer's input features permuted. Initialization is torch's default for the kernels
(uniform +-1/sqrt(fan_in)), zero biases, and the zero-initialized head of
`finetune.models.common`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe.finetune.models._conv import Conv
from dpprobe.finetune.models.common import float32_logits, zero_head

__all__ = ["CifarCNN", "TemperedCNN"]

# torch's kaiming_uniform(a=sqrt(5)) default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
_TORCH_KERNEL_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def _conv(cin: int, cout: int, size: int, stride: int, pad: int, rngs: nnx.Rngs) -> Conv:
    """Convolution with torch's default kernel init and a zero bias."""
    return Conv(cin, cout, size, stride, pad, kernel_init=_TORCH_KERNEL_INIT, rngs=rngs)


def _linear(din: int, dout: int, rngs: nnx.Rngs) -> nnx.Linear:
    """Linear with torch's default kernel init and a zero bias."""
    return nnx.Linear(din, dout, kernel_init=_TORCH_KERNEL_INIT, rngs=rngs)


def _max_pool(x: jax.Array, stride: int) -> jax.Array:
    """2 x 2 max pool, no padding: the maximum of the window's four shifted slices, the values
    of `nnx.max_pool` (`lax.reduce_window`). Its backward is elementwise selects, where
    reduce_window's is select-and-gather reduce-windows and a scatter, which XLA:CPU runs
    slowly: the small CNN's batch gradient (28 px, p 256) 1.25-1.4x faster (README)."""
    oh, ow = (x.shape[1] - 2) // stride + 1, (x.shape[2] - 2) // stride + 1
    parts = [x[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
             for i in (0, 1) for j in (0, 1)]
    return jnp.maximum(jnp.maximum(parts[0], parts[1]), jnp.maximum(parts[2], parts[3]))


class TemperedCNN(nnx.Module):
    """The MNIST CNN (`cnn`): two tanh convolutions, a tanh hidden layer of 32, the head."""

    def __init__(self, num_classes: int, *, image_size: int, in_channels: int, rngs: nnx.Rngs,
                 head_bias_init: float = 0.0):
        side = (image_size + 4 - 8) // 2 + 1 - 1  # conv1, then the stride-1 pool
        side = (side - 4) // 2 + 1 - 1  # conv2, pool
        if side < 1:
            raise ValueError(f"image_size must be >= 16 for the cnn, got {image_size}")
        self.conv1 = _conv(in_channels, 16, 8, 2, 2, rngs)
        self.conv2 = _conv(16, 32, 4, 2, 0, rngs)
        self.fc1 = _linear(side * side * 32, 32, rngs)
        self.head = zero_head(32, num_classes, head_bias_init=head_bias_init, rngs=rngs)

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits, the 32 tanh hidden units: (N, H, W, C) -> (N, 32)."""
        x = _max_pool(jnp.tanh(self.conv1(x)), 1)
        x = _max_pool(jnp.tanh(self.conv2(x)), 1)
        return jnp.tanh(self.fc1(x.reshape(x.shape[0], -1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))


class CifarCNN(nnx.Module):
    """The CIFAR-10 CNN (`cnn_cifar`): six tanh 3x3 convolutions, three pools, tanh 128."""

    WIDTHS = (32, 32, 64, 64, 128, 128)

    def __init__(self, num_classes: int, *, image_size: int, in_channels: int, rngs: nnx.Rngs,
                 head_bias_init: float = 0.0):
        if image_size < 8 or image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 for cnn_cifar, got {image_size}")
        channels = (in_channels, *self.WIDTHS)
        self.convs = nnx.List([_conv(cin, cout, 3, 1, 1, rngs)
                               for cin, cout in zip(channels[:-1], channels[1:], strict=True)])
        side = image_size // 8
        self.fc1 = _linear(side * side * channels[-1], 128, rngs)
        self.head = zero_head(128, num_classes, head_bias_init=head_bias_init, rngs=rngs)

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits, the 128 tanh hidden units: (N, H, W, C) -> (N, 128)."""
        for i, conv in enumerate(self.convs):
            x = jnp.tanh(conv(x))
            if i % 2:
                x = _max_pool(x, 2)
        return jnp.tanh(self.fc1(x.reshape(x.shape[0], -1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))

