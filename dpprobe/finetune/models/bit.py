"""timm's BiT ResNetV2 in Flax NNX, converted from a timm (torch) instance with its weights.

Kolesnikov et al. 2020, "Big Transfer (BiT)" (https://arxiv.org/abs/1912.11370), the
pre-activation ResNet of He et al. 2016 (https://arxiv.org/abs/1603.05027) with GroupNorm and
weight-standardized convolutions. The forward is timm 1.0.31's `ResNetV2.forward` in eval
mode on NHWC input:

    stem conv (7 x 7, stride 2) -> [zero pad 1] -> max pool (3 x 3, stride 2)
    -> stages of PreActBottleneck blocks -> GroupNorm + ReLU -> mean over H, W -> head

each block

    p = act(norm1(x));  shortcut = x or downsample.conv(p) (1 x 1, the block's stride)
    out = conv3(act(norm3(conv2(act(norm2(conv1(p))))))) + shortcut

with every convolution timm's `StdConv2d` (`StdConv`: each output filter standardized over its
fan-in m = kh kw c_in, W_hat = (V - mean) / sqrt(var + eps), population variance, eps additive:
1e-8 in BiT) and every norm timm's `GroupNormAct` (GroupNorm within one example, then ReLU).
The "fixed" stem (BiT's) pads the stem's output with one ring of zeros before an unpadded max
pool, so a negative border pixel is pooled against 0; the plain stem pads with -inf. No
BatchNorm: each example's logits depend on that example and the parameters only. The head is
timm's 1 x 1 convolution after the average pool, held as an `nnx.Linear` (the same map) and
written back in timm's layout by `timm_names`.

Book-keeping clipping covers every parameter: the standardized convolutions by their rule
(`finetune.models.taps`: the chain rule through the standardization, instantiated or as a
ghost norm, `finetune.models.ws_ghost`), the head by `nnx.Linear`'s, and the GroupNorm scales
and offsets by the clipper's per-example offsets (`dp.bookkeeping`).

Supported: timm's `resnetv2_*_bit` (50x1, 50x3, 101x1, 101x3, 152x2, 152x4) and any ResNetV2
built with StdConv2d, GroupNormAct, pre-activation bottlenecks and the plain or "fixed" stem.
Refused with a ValueError: BatchNorm variants (`resnetv2_18`, `_34`, `_50`, `_101`, `_152`,
their `d` forms), deep or tiered stems (`resnetv2_50d_gn`, `_50t`), EvoNorm and FRN
(`resnetv2_50d_evos`, `_frn`), TF "same" stems, average-pool downsampling, basic
(non-bottleneck) blocks, non-pre-activation blocks, grouped or dilated convolutions, pooling
other than average.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype

from dpprobe.finetune.models._conv import conv2d
from dpprobe.finetune.models.common import HeadOnFeatures
from dpprobe.finetune.models.layers import (
    ACTIVATIONS,
    activation_name,
    is_identity,
    linear_from_torch,
    timm_builder,
    timm_head,
    torch_array,
)

__all__ = ["ResNetV2", "StdConv", "resnetv2_from_timm", "standardize_std"]


def _kind(module: Any) -> str:
    return type(module).__name__


def _identity(module: Any) -> bool:
    """Absent, nn.Identity, or a dropout (identity in eval mode, trained without it)."""
    return is_identity(module) or _kind(module) in ("DropPath", "Dropout")


def standardize_std(kernel: jax.Array, eps: float) -> jax.Array:
    """timm's `StdConv2d` standardization of an HWIO kernel (statistics in at least float32).

    Args:
      kernel: (kh, kw, c_in, c_out).
      eps: added to the variance (1e-8 in BiT, timm's default 1e-6).

    Returns:
      (kernel - mean) / sqrt(var + eps), mean and population variance of each output filter
      over its fan-in axes (0, 1, 2); same dtype as `kernel`.
    """
    w = kernel.astype(jnp.promote_types(kernel.dtype, jnp.float32))
    mean = w.mean(axis=(0, 1, 2), keepdims=True)
    var = w.var(axis=(0, 1, 2), keepdims=True)
    return ((w - mean) * jax.lax.rsqrt(var + eps)).astype(kernel.dtype)


class StdConv(nnx.Module):
    """timm's `StdConv2d` on NHWC input: HWIO `kernel` standardized by `standardize_std` (no
    gain, no bias), `stride`, `padding` zeros on each side. Book-keeping rule: patches times
    the standardized kernel, through the standardization's chain rule
    (`finetune.models.taps`, `finetune.models.ws_ghost`)."""

    def __init__(self, kernel: jax.Array, *, stride: int, padding: int, eps: float):
        self.kernel = nnx.Param(kernel)
        self.stride = stride
        self.padding = padding
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = standardize_std(self.kernel[...], self.eps)
        x, kernel = promote_dtype((x, kernel))
        return conv2d(x, kernel, self.stride, self.padding)


def _std_conv(conv: Any) -> StdConv:
    """Our `StdConv` with the weights of timm's `StdConv2d`; ValueError for what it is not."""
    if _kind(conv) != "StdConv2d":
        raise ValueError(f"ResNetV2 convolutions must be timm's StdConv2d (BiT); got "
                         f"{_kind(conv)} (BatchNorm ResNetV2s such as resnetv2_50 are not "
                         f"supported)")
    if (conv.groups != 1 or conv.dilation != (1, 1) or conv.bias is not None
            or conv.stride[0] != conv.stride[1] or conv.kernel_size[0] != conv.kernel_size[1]
            or isinstance(conv.padding, str) or conv.padding[0] != conv.padding[1]
            or conv.padding_mode != "zeros"):
        raise ValueError(f"unsupported StdConv2d (groups, dilation, bias or padding): {conv}")
    return StdConv(torch_array(conv.weight.permute(2, 3, 1, 0)), stride=conv.stride[0],
                   padding=conv.padding[0], eps=float(conv.eps))


def _group_norm(norm: Any) -> tuple[nnx.GroupNorm, str]:
    """(`nnx.GroupNorm` with the weights of timm's `GroupNormAct`, its activation's name);
    two-pass float32 statistics within one example, as torch computes them."""
    if _kind(norm) != "GroupNormAct" or not norm.affine:
        raise ValueError(f"ResNetV2 norms must be timm's affine GroupNormAct (BiT); got "
                         f"{_kind(norm)} (BatchNorm, EvoNorm and FRN variants are not supported)")
    if not _identity(norm.drop):
        raise ValueError(f"unsupported GroupNormAct drop layer: {norm.drop}")
    channels = norm.weight.shape[0]
    layer = nnx.eval_shape(lambda: nnx.GroupNorm(channels, num_groups=norm.num_groups,
                                                 epsilon=float(norm.eps),
                                                 use_fast_variance=False, rngs=nnx.Rngs(0)))
    layer.scale.set_value(torch_array(norm.weight))
    layer.bias.set_value(torch_array(norm.bias))
    return layer, activation_name(norm.act)


class Block(nnx.Module):
    """One pre-activation bottleneck (module docstring), from timm's `PreActBottleneck`."""

    def __init__(self, block: Any):
        if _kind(block) != "PreActBottleneck":
            raise ValueError(f"ResNetV2 blocks must be pre-activation bottlenecks; got "
                             f"{_kind(block)}")
        if not _identity(block.drop_path):  # identity in eval mode; trained without it
            raise ValueError(f"unsupported ResNetV2 drop path: {block.drop_path}")
        down = block.downsample
        if down is None:
            self.downsample_conv = None
        elif _kind(down) == "DownsampleConv" and _identity(down.norm):
            self.downsample_conv = _std_conv(down.conv)
        else:
            raise ValueError(f"unsupported ResNetV2 downsample (average-pool or normed "
                             f"shortcuts are not supported): {_kind(down)}")
        acts = []
        for i in (1, 2, 3):
            norm, act = _group_norm(getattr(block, f"norm{i}"))
            setattr(self, f"norm{i}", norm)
            setattr(self, f"conv{i}", _std_conv(getattr(block, f"conv{i}")))
            acts.append(act)
        self.acts = tuple(acts)

    def __call__(self, x: jax.Array) -> jax.Array:
        act1, act2, act3 = (ACTIVATIONS[a] for a in self.acts)
        pre = act1(self.norm1(x))
        shortcut = x if self.downsample_conv is None else self.downsample_conv(pre)
        y = self.conv2(act2(self.norm2(self.conv1(pre))))
        return self.conv3(act3(self.norm3(y))) + shortcut


class Stage(nnx.Module):
    """A stage's blocks (timm's `ResNetStage.blocks`)."""

    def __init__(self, stage: Any):
        self.blocks = nnx.List([Block(b) for b in stage.blocks])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def _max_pool(x: jax.Array, fixed: bool) -> jax.Array:
    """MaxPool2d(3, stride 2) on NHWC after one ring of zeros ("fixed" stem) or with
    torch's padding 1 (-inf: padding never wins)."""
    lead = (1,) * (x.ndim - 3)
    pads = ((0, 0),) * (x.ndim - 3) + ((1, 1), (1, 1), (0, 0))
    if fixed:
        x = jnp.pad(x, pads)
        pads = ((0, 0),) * x.ndim
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, lead + (3, 3, 1), lead + (2, 2, 1),
                                 pads)


def _check_stem(stem: Any) -> bool:
    """Whether the stem is BiT's "fixed" one (zero pad, unpadded pool); ValueError for a stem
    other than conv -> [pad] -> MaxPool2d(3, 2)."""
    names = [n for n, _ in stem.named_children()]
    if names not in (["conv", "pool"], ["conv", "pad", "pool"]):
        raise ValueError(f"ResNetV2 needs the single-convolution pre-activation stem; deep, "
                         f"tiered and normed stems are not supported (got {names})")
    fixed = names[1] == "pad"
    if fixed and (_kind(stem.pad) != "ConstantPad2d" or tuple(stem.pad.padding) != (1,) * 4
                  or stem.pad.value != 0.0):
        raise ValueError(f"unsupported ResNetV2 stem padding: {stem.pad}")
    pool = stem.pool
    if (_kind(pool) != "MaxPool2d" or pool.kernel_size != 3 or pool.stride != 2
            or pool.padding != (0 if fixed else 1) or pool.ceil_mode or pool.dilation != 1):
        raise ValueError(f"unsupported ResNetV2 stem pool (TF 'same' stems are not "
                         f"supported): {pool}")
    return fixed


class ResNetV2(HeadOnFeatures):
    """timm's BiT ResNetV2 in NNX (module docstring); built by `resnetv2_from_timm`. timm holds
    its head as a 1 x 1 convolution (`timm_names.timm_arrays` reshapes it on the way back)."""

    def __init__(self, timm_model: Any, head: nnx.Linear):
        self.fixed_stem = _check_stem(timm_model.stem)
        self.stem_conv = _std_conv(timm_model.stem.conv)
        self.stages = nnx.List([Stage(s) for s in timm_model.stages])
        self.norm, self.act = _group_norm(timm_model.norm)
        self.head = head

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (timm's `forward_head(..., pre_logits=True)`): (N, H, W, C) -> (N, D)."""
        x = _max_pool(self.stem_conv(x), self.fixed_stem)
        for stage in self.stages:
            x = stage(x)
        return ACTIVATIONS[self.act](self.norm(x)).mean(axis=(-3, -2))


def _head(fc: Any, features: int, num_classes: int | None, rngs: nnx.Rngs,
          head_bias_init: float) -> nnx.Linear:
    """timm's 1 x 1 convolution head as an `nnx.Linear` (num_classes None) or a new zero head."""
    if num_classes is None and _kind(fc) == "Conv2d":
        if fc.kernel_size != (1, 1) or fc.stride != (1, 1) or fc.groups != 1 or fc.bias is None:
            raise ValueError(f"unsupported ResNetV2 head: {fc}")
        return linear_from_torch(type("Flat", (), {"weight": fc.weight[:, :, 0, 0],
                                                   "bias": fc.bias}))
    return timm_head(fc, features, num_classes, rngs, head_bias_init)


def _check_head(timm_model: Any) -> None:
    """Raises ValueError for a head other than average pooling and fc."""
    head = timm_model.head
    if _kind(head) != "ClassifierHead" or getattr(head.global_pool, "pool_type", "") != "avg":
        raise ValueError("ResNetV2's head must be average pooling and fc")


# Raises ValueError (the constructor) for a stem, block, convolution, norm, head or pooling this
# module does not reproduce.
resnetv2_from_timm = timm_builder(ResNetV2, "head.fc", _check_head, make_head=_head)
