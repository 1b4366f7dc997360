"""Book-keeping rules (`dp.taps`) for Flax's own `nnx.Conv`, so that a user's NNX model built
from Flax layers is clipped without per-example kernel gradients (`dp.bookkeeping`).

A 2-D `nnx.Conv` computes y = patches(x) W with W its HWIO kernel flattened to
(kh kw c_in, c_out) and the patches' features ordered (kh, kw, c_in) the same way, so one
example's kernel gradient is A^T B reshaped (one group: ghost norm or instantiation by cost).
With `feature_group_count` g > 1 (depthwise when g = c_in) the kernel is (kh, kw, c_in / g,
c_out) and output channel o reads only group o // (c_out / g)'s input channels: each group's
block of A^T B is its kernel block, formed per example at the kernel's own size.

Options the rules do not implement (dilation, a mask, circular / reflect / causal padding, 1-D
or 3-D kernels) give no rule: such a layer is clipped through per-example offsets, exact and
slower, and named in the clipper's notice (`dp.taps.unknown_layers`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import canonicalize_padding

from dpprobe.dp.norm_bounds import HIGHEST
from dpprobe.dp.taps import Rule, register_rule

__all__ = ["conv_rule", "grouped_kernel_grads", "nnx_conv_patches"]


def _pair(value) -> tuple[int, int]:
    value = 1 if value is None else value
    return (value, value) if isinstance(value, int) else tuple(value)


def _pads(module: nnx.Conv, shape: tuple[int, ...]) -> tuple | None:
    """((top, bottom), (left, right)) of an input of `shape` (..., H, W, C), or None."""
    padding = canonicalize_padding(module.padding, 2)
    if isinstance(padding, str):
        if padding not in ("SAME", "VALID"):
            return None
        return tuple(jax.lax.padtype_to_pads(shape[-3:-1], module.kernel_size,
                                             _pair(module.strides), padding))
    return tuple(tuple(p) for p in padding)


def nnx_conv_patches(module: nnx.Conv, x: jax.Array) -> jax.Array:
    """The im2col patches of `x` (..., H, W, C) under a 2-D `nnx.Conv`'s kernel, strides and
    padding: (..., OH, OW, kh kw C), features ordered (kh, kw, c) as its kernel flattens."""
    kh, kw = module.kernel_size
    sh, sw = _pair(module.strides)
    (top, bottom), (left, right) = _pads(module, x.shape)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(top, bottom), (left, right), (0, 0)])
    oh, ow = (x.shape[-3] - kh) // sh + 1, (x.shape[-2] - kw) // sw + 1
    windows = [x[..., i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw, :]
               for i in range(kh) for j in range(kw)]
    return jnp.concatenate(windows, axis=-1)


def grouped_kernel_grads(a: jax.Array, b: jax.Array, kernel_shape: tuple,
                         groups: int) -> dict[str, jax.Array]:
    """Every example's kernel gradient of a grouped convolution from its patches a (n, T,
    kh kw c_in) and output gradient b (n, T, c_out): group g's block of the kernel is its
    input channels' patches times its output channels' b (the other blocks of A^T B are not
    parameters); depthwise (one channel per group) costs as much as the forward.

    Args:
      a, b: the patches and the output gradients, per example.
      kernel_shape: (kh, kw, c_in / groups, c_out), the HWIO kernel's shape.
      groups: the convolution's feature groups.

    Returns:
      {"kernel": (n, kh, kw, c_in / groups, c_out)}.
    """
    kh, kw, per_group, out = kernel_shape
    n, tokens = a.shape[:2]
    a = a.reshape(n, tokens, kh * kw, groups, per_group)
    b = b.reshape(n, tokens, groups, out // groups)
    g = jnp.einsum("ntkgc,ntgo->nkcgo", a, b, precision=HIGHEST)
    return {"kernel": g.reshape(n, kh, kw, per_group, out)}


def _grouped_row_grads(module: nnx.Conv, a: jax.Array, b: jax.Array) -> dict[str, jax.Array]:
    return grouped_kernel_grads(a, b, module.kernel.shape, module.feature_group_count)


_PLAIN = Rule(inputs=nnx_conv_patches)
_GROUPED = Rule(inputs=nnx_conv_patches, row_grads=_grouped_row_grads)


def conv_rule(module: Any) -> Rule | None:
    """The rule of one `nnx.Conv` (module docstring), or None for options it does not cover.

    Args:
      module: an `nnx.Conv`.

    Returns:
      The plain rule (one group), the grouped rule, or None.
    """
    if (len(module.kernel_size) != 2 or module.mask is not None
            or _pair(module.input_dilation) != (1, 1)
            or _pair(module.kernel_dilation) != (1, 1)
            or _pads(module, (1, 1, 1)) is None):  # a string padding it lacks: no shape needed
        return None
    return _PLAIN if module.feature_group_count == 1 else _GROUPED


register_rule(nnx.Conv, conv_rule)
