"""Book-keeping rules (`dp.taps`) for this package's layers: the im2col convolution, the
weight-standardized convolution, the ViT's patch embed, and the convolutions of timm's
convolutional families (grouped and depthwise included).

Each layer computes y = A W with A its im2col patches (or the image's non-overlapping patches)
and W its kernel flattened to (d, p), so one example's kernel gradient is A^T B. For a
weight-standardized convolution W = standardize(kernel, gain) (`finetune.models.wrn`; BiT's
`finetune.models.bit`: standardize(kernel), no gain), a fixed
function of the parameters, so the gradients of the kernel and the gain are the chain rule
through it (`jax.vjp`, one example at a time) where the layer has many tokens, and a ghost
norm through the standardization's (linear) chain rule where it has few
(`finetune.models.ws_ghost`, chosen by cost).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpprobe.dp.bookkeeping import after
from dpprobe.dp.flax_rules import grouped_kernel_grads
from dpprobe.dp.norm_bounds import HIGHEST
from dpprobe.dp.taps import Rule, register_offset_layer, register_rule
from dpprobe.finetune.models import beit, convnext, layers
from dpprobe.finetune.models._conv import Conv, im2col, padded_windows, shifted_windows
from dpprobe.finetune.models.bit import StdConv, standardize_std
from dpprobe.finetune.models.layers import Conv2d, FrozenBatchNorm, GroupedConv2d, conv_patches
from dpprobe.finetune.models.vit import Block, PatchEmbed, VisionTransformer
from dpprobe.finetune.models.wrn import WSConv, standardize_weight
from dpprobe.finetune.models.ws_ghost import WS_GHOST

__all__: list[str] = []


def _conv_rows(module, x):
    return im2col(x, module.kernel.shape[0], module.stride, module.padding)


def _conv_example_grads(module, x, b):
    """Every example's A^T B, (n, k k c_in, c_out), rows ordered (kh, kw, c_in) as `im2col`'s,
    from x (n, K, H, W, c_in) (K views) and b (n, K OH OW, c_out), never forming the k^2-wide
    patches. Few output positions and a small gradient (the CNN's two layers): multiply-adds
    over the positions (`_position_sums`). Otherwise (WRN-16-4's layers): for each kernel
    offset (i, j), the input's window shifted by it, (n, K OH OW, c_in), against b, one
    batched matmul per offset, the windows formed one at a time (`dp.bookkeeping.after`; the
    scheduler formed all nine of a WRN layer's at once, 45 MB). The patches' one einsum held
    the patches and, while forming them, their k^2 slices (13 MB of the CNN's 26 MiB peak).
    The clipped sum's temporary memory per batch is now 16.4 MiB for the CNN (p 256) and
    213.7 MiB for WRN-16-4 (p 32), 0.99x and 1.34x the plain gradient's (README, "Measured
    performance")."""
    size, n, channels = module.kernel.shape[0], x.shape[0], x.shape[-1]
    # One channel: a window would make a matrix-vector product; a kernel row's windows side
    # by side make one matmul (the CNN's clipped sum, whose first layer is 8 x 8 of one
    # channel: 30.0 -> 26.9 ms and 20.9 -> 19.0 MiB; rows of its 16-channel second layer too:
    # 30.0 MiB).
    group = size if channels == 1 else 1
    matmuls, each = n * size * size // group, group * channels * b.shape[1] * b.shape[-1]
    if b.shape[1] <= _POSITIONS_MAX and matmuls >= _MATMULS_MIN and each <= _MATMUL_MAX:
        return _position_sums(module, x, b)
    windows = shifted_windows(x.reshape(-1, *x.shape[-3:]),  # views as more images
                              size, module.stride, module.padding)
    grads = []
    for start in range(0, size * size, group):
        window = jnp.concatenate(windows[start:start + group], axis=-1).reshape(
            n, -1, group * channels)
        if grads:  # formed after the previous window's matmul
            window = after(window, grads[-1])
        grads.append(jnp.einsum("ntc,ntp->ncp", window, b, precision=HIGHEST))
    return jnp.concatenate(grads, axis=1)


# Position sums where the windows would make many small matmuls: at most 256 positions (the
# unrolled sums' compile time), at least 512 matmuls of at most 2^16 multiply-adds each.
# Measured on XLA:CPU, the layers alone (ms, windows' matmuls -> position sums; n examples,
# positions, rows x columns of the gradient per matmul, matmuls): the CNN's conv2 (256, 25,
# 16 x 32, 4,096) 4.9 -> 1.4 and conv1 (256, 169, 8 x 16, 2,048) 4.8 -> 3.3; (64, 100,
# 16 x 32, 576) 1.38 -> 1.04. The other way round: few matmuls, a WRN stem at 16 px (32, 256,
# 3 x 16, 288) 0.4 -> 1.3, WRN-16-4's stage-2 1 x 1 shortcut (32, 196, 64 x 128, 32) 1.2 ->
# 4.7; large ones, its stage 3 (32, 49, 128 x 256, 288) 35 -> 43; many positions, its stage 1
# (32, 784, 64 x 64, 288) 52 -> 299. One batch's clipped sum in the trainer, the CNN at p 256:
# 20.6 -> 15.0 ms (the plain gradient 15.0).
_POSITIONS_MAX, _MATMULS_MIN, _MATMUL_MAX, _CHUNK = 256, 512, 2**16, 4


def _position_sums(module, x, b):
    """Every example's A^T B as in `_conv_example_grads`, summed over the output positions:
    the input's k x k patch at each position times that position's row of b, elementwise
    multiply-adds that XLA fuses, `_CHUNK` positions per fusion, patches sliced from the
    padded input inside it. For a gradient of a few thousand entries per example the batched
    matmuls of the windows cost more in dispatch than in arithmetic (thousands of matmuls of
    16 x 25 by 25 x 32 for the CNN's second convolution at p 256)."""
    size, stride, pad = module.kernel.shape[0], module.stride, module.padding
    n, (height, width, channels), out = x.shape[0], x.shape[-3:], b.shape[-1]
    x = jnp.pad(x.reshape(n, -1, height, width, channels),
                ((0, 0), (0, 0), (pad, pad), (pad, pad), (0, 0)))
    oh, ow = ((side - size) // stride + 1 for side in x.shape[2:4])
    b = b.reshape(n, x.shape[1], oh, ow, out)
    positions = [(v, i, j) for v in range(x.shape[1]) for i in range(oh) for j in range(ow)]
    total = None
    for start in range(0, len(positions), _CHUNK):
        part = None
        for v, i, j in positions[start:start + _CHUNK]:
            patch = x[:, v, stride * i:stride * i + size, stride * j:stride * j + size]
            term = patch[..., None] * b[:, v, i, j, None, None, None, :]
            part = term if part is None else part + term
        total = part if total is None else total + part
    return total.reshape(n, size * size * channels, out)


def _standardized_grads(module, g):
    kernel, gain = module.kernel[...], module.gain[...]
    _, pullback = jax.vjp(standardize_weight, kernel, gain)
    kernel_grad, gain_grad = pullback(g.reshape(kernel.shape).astype(kernel.dtype))
    return {"kernel": kernel_grad, "gain": gain_grad}


def _std_grads(module, g):
    """A `StdConv`'s kernel gradient from its W_hat gradient g: the chain rule through
    timm's standardization (`bit.standardize_std`, no gain)."""
    kernel = module.kernel[...]
    _, pullback = jax.vjp(lambda v: standardize_std(v, module.eps), kernel)
    return {"kernel": pullback(g.reshape(kernel.shape).astype(kernel.dtype))[0]}


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
# BiT's convolutions (timm's StdConv2d): the same, without a gain and with eps added to the
# variance (`finetune.models.ws_ghost` covers both standardizations).
register_rule(StdConv, Rule(inputs=_conv_rows, grads=_std_grads, ghost=WS_GHOST,
                            example_grads=_conv_example_grads))
def _grouped_row_grads(module, a, b):
    """A grouped or depthwise convolution's per-example kernel gradients, group by group
    (`dp.flax_rules.grouped_kernel_grads`, which Flax's own grouped `nnx.Conv` uses too)."""
    return grouped_kernel_grads(a, b, module.kernel.shape, module.groups)


def _depthwise_input_grads(module, x, b):
    """A depthwise convolution's per-example kernel gradients from its input x (n, ..., H, W,
    c_in) (views as more images) and output gradient b (n, T, c_out): for each kernel offset
    (i, j), the input's window at that offset times b, summed over positions and views. The
    patches' einsum (`_grouped_row_grads`) formed the k^2-wide patches and transposed them
    (Lite0's 3 x 3 layers at 64 px, p 64: 0.39 vs 0.15 s for the largest, 0.042 vs 0.004 s
    at 8 x 8, measured in one process)."""
    n = x.shape[0]
    kh, kw, _, out = module.kernel.shape
    images = x.reshape(-1, *x.shape[-3:])
    if out != images.shape[-1]:  # channel multiplier m: output o reads input o // m
        images = jnp.repeat(images, out // images.shape[-1], axis=-1)
    pads = layers.conv_pads(module.padding, images.shape, (kh, kw), module.stride)
    windows = padded_windows(images, (kh, kw), module.stride, pads)
    g = b.reshape(*windows[0].shape[:3], out)
    taps = [(window * g).reshape(n, -1, out).sum(axis=1) for window in windows]
    return {"kernel": jnp.stack(taps, axis=1).reshape(n, kh, kw, 1, out)}


def _grouped_rule(module):
    """Depthwise (one input channel per group): from the input's windows; else the patches."""
    if module.kernel.shape[2] == 1:
        return Rule(inputs=conv_patches, input_grads=_depthwise_input_grads)
    return Rule(inputs=conv_patches, row_grads=_grouped_row_grads)


register_rule(PatchEmbed, Rule(inputs=_patch_rows))
# timm's convolutional families (`finetune.models.layers`): one group, patches times the kernel
# (ghost norm or instantiation by cost); grouped and depthwise, each group's block exactly.
register_rule(Conv2d, Rule(inputs=conv_patches))
register_rule(GroupedConv2d, _grouped_rule)
# Layers whose own parameters train through per-example offsets by design (a frozen BatchNorm's
# scale and offset, a ViT's class token, position embedding and layer scales, a BEiT's relative
# position tables, q/v biases and layer scales, a ConvNeXt block's layer scale): no notice.
for _cls in (FrozenBatchNorm, Block, VisionTransformer, beit.Attention, beit.Beit, beit.Block,
             convnext.Block):
    register_offset_layer(_cls)
