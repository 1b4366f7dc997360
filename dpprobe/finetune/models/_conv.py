"""NHWC convolution: `jax.lax.conv_general_dilated`, or as an explicit patch matrix times the
kernel (im2col) while tracing vmapped per-example gradients.

The two compute the same cross-correlation up to float rounding (tested directly and through
every golden test against torch in
tests/finetune/test_finetune_models.py). Which is faster depends on
how the gradient is taken (2 CPU cores, jaxlib 0.10.2, ms per physical batch, medians of 5-7,
alternated in one process):

  program                                        CNN 28 px, p 256    WRN-16-4 28 px, p 32
                                                 lax      im2col     lax      im2col
  batch gradient (the non-private step)          21       34         591      667
  book-keeping clipped sum (the DP default)      27       40         764      815
  per-example clipped sum (jax_privacy, vmapped) 69       68         1953     1431

The book-keeping clipper never differentiates a kernel through the convolution (its rule forms
each example's kernel gradient from the input's shifted windows, or the im2col patches A where
a ghost norm needs them, `finetune.models.taps`), so XLA's convolutions serve the forward and
the input gradients. Under `vmap(grad)` the per-example kernel gradient of
`patches @ kernel` is a batched matmul, while JAX batches lax's as a grouped convolution with
one group per example, which XLA:CPU runs slowly; `finetune.batch_sums.clipped_sum` therefore
traces the per-example clipper inside `im2col_convolutions()`.

An output smaller than the kernel on both sides (a ResNet's or BiT's last stages at 32 px:
2 x 2 and 1 x 1 under 3 x 3 kernels) is always computed as patches @ kernel
(`smaller_than_kernel`): XLA:CPU's convolution is slow there (256 examples,
jaxlib 0.10.2, -O3, ms, medians of 3 in one process; the gradient of a squared sum in both
arguments):

  input, kernel, channels          lax forward / gradient    patches forward / gradient
  2 x 2, 3 x 3, 256 -> 256         167 / 355                 9.8 / 23
  1 x 1, 3 x 3, 512 -> 512         78 / 176                  8.2 / 22
  4 x 4, 3 x 3, 128 -> 256, s 2    9.5 / 73                  4.8 / 12   (output 2 x 2)
  3 x 3, 3 x 3, 128 -> 128         6.5 / 18                  14 / 15    (output 3 x 3: lax)
  8 x 8, 3 x 3, 64 -> 128, s 2     6.2 / 18                  10 / 15    (output 4 x 4: lax)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Conv", "conv2d", "im2col", "im2col_convolutions", "padded_windows",
           "shifted_windows", "smaller_than_kernel"]

_IM2COL = contextvars.ContextVar("im2col_convolutions", default=False)


def padded_windows(x: jax.Array, kernel: tuple[int, int], stride: int,
                   pads) -> list[jax.Array]:
    """The windows of NHWC `x` (leading axes kept), padded by `pads` ((top, bottom), (left,
    right)), that a kernel's offsets (i, j) see at `stride`: kh kw arrays (..., OH, OW, C) in
    (kh, kw) order, the columns of the im2col patches."""
    kh, kw = kernel
    lead = [(0, 0)] * (x.ndim - 3)
    x = jnp.pad(x, [*lead, *pads, (0, 0)])
    oh = (x.shape[-3] - kh) // stride + 1
    ow = (x.shape[-2] - kw) // stride + 1
    return [x[..., i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride, :]
            for i in range(kh) for j in range(kw)]


def shifted_windows(x: jax.Array, size: int, stride: int, padding: int) -> list[jax.Array]:
    """The inputs that a `size` x `size` kernel's offsets (i, j) see in NHWC `x`, padded by
    `padding` on every side: size^2 arrays (N, OH, OW, C) in (kh, kw) order, the columns of
    `im2col`."""
    return padded_windows(x, (size, size), stride, ((padding, padding), (padding, padding)))


def im2col(x: jax.Array, size: int, stride: int, padding: int) -> jax.Array:
    """The patches of NHWC `x` under a `size` x `size` kernel: (N, OH, OW, size * size * C),
    features ordered (kh, kw, c_in) as an HWIO kernel flattens."""
    return jnp.concatenate(shifted_windows(x, size, stride, padding), axis=-1)


@contextlib.contextmanager
def im2col_convolutions():
    """Within this context (while tracing), `conv2d` computes patches @ kernel (im2col)."""
    token = _IM2COL.set(True)
    try:
        yield
    finally:
        _IM2COL.reset(token)


def smaller_than_kernel(shape: tuple[int, ...], kernel: tuple[int, int], stride: int,
                        pads) -> bool:
    """Whether the output of a (kh, kw) `kernel` at `stride` on an NHWC input of `shape`
    padded by `pads` ((top, bottom), (left, right)) is smaller than the kernel on both sides,
    where patches @ kernel is the faster convolution (module docstring)."""
    (top, bottom), (left, right) = pads
    out_h = (shape[-3] + top + bottom - kernel[0]) // stride + 1
    out_w = (shape[-2] + left + right - kernel[1]) // stride + 1
    return out_h < kernel[0] and out_w < kernel[1]


def conv2d(x: jax.Array, kernel: jax.Array, stride: int, padding: int) -> jax.Array:
    """Cross-correlation of NHWC `x` with HWIO `kernel`, `padding` zeros on each side.

    Output side (side + 2 padding - k) // stride + 1, as torch's Conv2d with symmetric padding.
    `jax.lax.conv_general_dilated`, or im2col inside `im2col_convolutions()` and for an output
    smaller than the kernel.
    """
    im2col_here = _IM2COL.get() or smaller_than_kernel(x.shape, kernel.shape[:2], stride,
                                                       [(padding, padding)] * 2)
    return (_im2col_conv2d if im2col_here else _lax_conv2d)(x, kernel, stride, padding)


@functools.partial(jax.jit, static_argnums=(2, 3))  # one dispatch when called eagerly
def _lax_conv2d(x: jax.Array, kernel: jax.Array, stride: int, padding: int) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), [(padding, padding)] * 2,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _im2col_conv2d(x: jax.Array, kernel: jax.Array, stride: int, padding: int) -> jax.Array:
    patches = im2col(x, kernel.shape[0], stride, padding)
    return jnp.einsum("nhwk,ko->nhwo", patches, kernel.reshape(-1, kernel.shape[-1]))


class Conv(nnx.Module):
    """`conv2d` with a bias: kernel (k, k, c_in, c_out) and bias (c_out,) are `nnx.Param`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 padding: int, *, kernel_init: nnx.Initializer, rngs: nnx.Rngs):
        shape = (kernel_size, kernel_size, in_channels, out_channels)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape))
        self.bias = nnx.Param(jnp.zeros((out_channels,)))
        self.stride, self.padding = stride, padding

    def __call__(self, x: jax.Array) -> jax.Array:
        x, kernel, bias = nnx.nn.dtypes.promote_dtype((x, self.kernel[...], self.bias[...]))
        return conv2d(x, kernel, self.stride, self.padding) + bias
