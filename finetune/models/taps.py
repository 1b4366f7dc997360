"""Book-keeping rules (`dp.taps`) for this package's layers: the im2col convolution, the
weight-standardized convolution and the ViT's patch embed.

Each layer computes y = A W with A its im2col patches (or the image's non-overlapping patches)
and W its kernel flattened to (d, p), so one example's kernel gradient is A^T B. For a
weight-standardized convolution W = standardize(kernel, gain) (`finetune.models.wrn`), a fixed
function of the parameters, so the gradients of the kernel and the gain are the chain rule
through it (`jax.vjp`, one example at a time) where the layer has many tokens, and a ghost
norm through the standardization's (linear) chain rule where it has few
(`finetune.models.ws_ghost`, chosen by cost).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dp.taps import Rule, register_rule
from finetune.models._conv import Conv, im2col
from finetune.models.vit import PatchEmbed
from finetune.models.wrn import WSConv, standardize_weight
from finetune.models.ws_ghost import WS_GHOST

__all__: list[str] = []


def _conv_rows(module, x):
    return im2col(x, module.kernel.shape[0], module.stride, module.padding)


def _conv_example_grads(module, x, b):
    """Every example's A^T B, (n, k k c_in, c_out), rows ordered (kh, kw, c_in) as `im2col`'s,
    for a layer of one input channel (None otherwise: the patches' einsum is faster there):
    one convolution grouped by example, b its kernel dilated by the stride, from x
    (n, K, H, W, 1) (K views) and b (n, K OH OW, c_out), never forming the k^2-wide patches."""
    if x.shape[-1] != 1:
        return None
    size, stride, pad = module.kernel.shape[0], module.stride, module.padding
    n, p = x.shape[0], b.shape[-1]
    x = x.reshape(n, -1, *x.shape[-3:-1])  # (n, K, H, W)
    x = jnp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    views, height, width = x.shape[1:]
    oh, ow = (height - size) // stride + 1, (width - size) // stride + 1
    lhs = x.transpose(2, 3, 0, 1).reshape(1, height, width, n * views)  # channel i K + v
    kernel = b.reshape(n, views, oh, ow, p).transpose(2, 3, 1, 0, 4).reshape(
        oh, ow, views, n * p)  # output channel i p + o
    out = jax.lax.conv_general_dilated(  # group i: example i's views against its b
        lhs, kernel, (1, 1), "VALID", rhs_dilation=(stride, stride),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=n,
        precision=jax.lax.Precision.HIGHEST)
    return out[0, :size, :size].reshape(size * size, n, p).transpose(1, 0, 2)


def _standardized_grads(module, g):
    kernel, gain = module.kernel[...], module.gain[...]
    _, pullback = jax.vjp(standardize_weight, kernel, gain)
    kernel_grad, gain_grad = pullback(g.reshape(kernel.shape).astype(kernel.dtype))
    return {"kernel": kernel_grad, "gain": gain_grad}


def _patch_rows(module, x):
    n, h, w, c = x.shape
    ph, pw = module.kernel.shape[:2]
    gh, gw = h // ph, w // pw
    patches = x[:, :gh * ph, :gw * pw].reshape(n, gh, ph, gw, pw, c)
    return patches.transpose(0, 1, 3, 2, 4, 5).reshape(n, gh * gw, ph * pw * c)


register_rule(Conv, Rule(inputs=_conv_rows, example_grads=_conv_example_grads))
register_rule(WSConv, Rule(inputs=_conv_rows, params=("kernel", "gain"),
                           grads=_standardized_grads, ghost=WS_GHOST,
                           example_grads=_conv_example_grads))
register_rule(PatchEmbed, Rule(inputs=_patch_rows))
