"""Tramer & Boneh's ScatterNet + CNN (`scatternet_cnn`): a fixed ScatterNet, then a small CNN
trained with DP-SGD.

Tramer & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)"
(https://arxiv.org/abs/2011.11660): on Fashion-MNIST at (3, 1e-5) their end-to-end CNN reaches
86.0%, the same kind of CNN on ScatterNet features 89.0%. The layers are those of the authors'
code (ftramer/Handcrafted-DP, `models.py`: `MNIST_CNN` with `use_scattering`):

    ScatterNet (kymatio's Scattering2D, J = 2, L = 8: 81 coefficients per input channel at
    1/4 of the side; fixed wavelets, no parameters)
    -> GroupNorm, 27 groups, no scale or offset (a function of the example alone)
    -> conv 16 3x3 stride 2 pad 1 -> tanh -> conv 32 3x3 stride 1 pad 1 -> tanh
    -> flatten -> linear 32 -> tanh -> linear num_classes

The model is `front` (the ScatterNet and the GroupNorm: no parameters, no randomness, one
example at a time) and the trained CNN on its output. The front is kymatio's own
JAX frontend (`kymatio.jax.Scattering2D`, the same filters as the torch ScatterNet of
`extract`, logits within float rounding), run in float32 whatever the body's dtype.
`finetune.fronts` trains the CNN on the front's output computed once per training image
when no augmentation changes the images between steps (here ~0.4 ms per image on CPU, more
than the CNN's step).

`scatternet_cnn_linear` (ours, `linear=True`) adds Tramer & Boneh's other model, ScatterNet +
linear, beside the CNN: its head reads the CNN's 32 features and the front's output flattened
(3,969 at 28 px), so the logits are the CNN's plus a linear model's on the ScatterNet features,
both trained together (one head, zero-initialized, clipped with the rest). On Fashion-MNIST at
(3, 1e-5) it beats both (README: `benchmarks/finetune_fmnist.py`).

Input: images scaled to [0, 1] (mean 0, std 1; Tramer & Boneh's input), any side divisible by
4, any channel count (81 coefficients per channel, channel-major, as `extract`'s ScatterNet).
Initialization: torch's default for the kernels, zero biases, the zero-initialized head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe.finetune.models._conv import Conv
from dpprobe.finetune.models.cnn import _TORCH_KERNEL_INIT
from dpprobe.finetune.models.common import float32_logits, zero_head

__all__ = ["GROUPS", "SCATTER_J", "SCATTER_L", "ScatterCNN", "scatter_groupnorm", "scattering"]

SCATTER_J, SCATTER_L = 2, 8
GROUPS = 27  # Tramer & Boneh's num_groups for Fashion-MNIST
COEFFICIENTS = 1 + SCATTER_J * SCATTER_L + SCATTER_L**2 * SCATTER_J * (SCATTER_J - 1) // 2  # 81


@functools.lru_cache(maxsize=8)
def _scattering_2d(side: int):
    """kymatio's JAX Scattering2D for `side` x `side` images (filters built once per side)."""
    from kymatio.jax import Scattering2D

    return Scattering2D(J=SCATTER_J, shape=(side, side), L=SCATTER_L)


def scattering(x: jax.Array) -> jax.Array:
    """ScatterNet coefficients of NHWC images: (N, S, S, C) -> float32 (N, S/4, S/4, 81 C),
    channel c's 81 coefficients at [81 c, 81 c + 81) (kymatio's order)."""
    n, side, _, channels = x.shape
    coefficients = _scattering_2d(side)(jnp.moveaxis(x.astype(jnp.float32), -1, 1))
    coefficients = coefficients.reshape(n, channels * COEFFICIENTS, side // 4, side // 4)
    return jnp.moveaxis(coefficients, 1, -1)


def scatter_groupnorm(x: jax.Array, groups: int = GROUPS, epsilon: float = 1e-5) -> jax.Array:
    """GroupNorm without scale or offset over NHWC channels (torch's GroupNorm(groups, C,
    affine=False)): each example's groups of C / groups consecutive channels to mean 0,
    variance 1, statistics in float32."""
    n, h, w, c = x.shape
    g = x.astype(jnp.float32).reshape(n, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = jnp.square(g - mean).mean(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) * jax.lax.rsqrt(var + epsilon)).reshape(n, h, w, c)


class ScatterCNN(nnx.Module):
    """`scatternet_cnn`: the CNN on `front(x)`; with `linear`, `scatternet_cnn_linear`: the
    head also reads `front(x)` flattened (module docstring). With `on_features` set
    (`finetune.fronts`, training on precomputed features) it reads the front's output instead
    of images; the parameters are the same."""

    def __init__(self, num_classes: int, *, image_size: int, in_channels: int, rngs: nnx.Rngs,
                 head_bias_init: float = 0.0, linear: bool = False):
        if image_size < 8 or image_size % 4:
            raise ValueError("image_size must be a multiple of 4 (ScatterNet's J = 2) and >= 8 "
                             f"for the ScatterNet models, got {image_size}")
        channels, flat = in_channels * COEFFICIENTS, (image_size // 4 + 1) // 2
        self.conv1 = Conv(channels, 16, 3, 2, 1, kernel_init=_TORCH_KERNEL_INIT, rngs=rngs)
        self.conv2 = Conv(16, 32, 3, 1, 1, kernel_init=_TORCH_KERNEL_INIT, rngs=rngs)
        self.fc1 = nnx.Linear(flat * flat * 32, 32, kernel_init=_TORCH_KERNEL_INIT, rngs=rngs)
        linear_inputs = (image_size // 4) ** 2 * channels if linear else 0
        self.head = zero_head(32 + linear_inputs, num_classes, head_bias_init=head_bias_init,
                              rngs=rngs)
        self.linear = linear
        self.on_features = False

    @staticmethod
    def front(x: jax.Array) -> jax.Array:
        """The fixed part, no parameters: ScatterNet then GroupNorm, float32 (N, S/4, S/4, 81 C)
        from images (N, S, S, C) in [0, 1]; a function of each example alone."""
        return scatter_groupnorm(scattering(x))

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (N, 32) from images (or, `on_features`, from the front's output); with
        `linear`, (N, 32 + S/4 S/4 81 C): then the front's output flattened in NHWC order."""
        front = x if self.on_features else self.front(x).astype(x.dtype)
        h = jnp.tanh(self.conv1(front))
        h = jnp.tanh(self.conv2(h))
        h = jnp.tanh(self.fc1(h.reshape(h.shape[0], -1)))
        if self.linear:
            h = jnp.concatenate([h, front.reshape(front.shape[0], -1)], axis=-1)
        return h

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))
