"""timm's ConvNeXt in Flax NNX, converted from a timm (torch) instance with its weights.

Liu et al. 2022 (https://arxiv.org/abs/2201.03545). The forward is timm 1.0.31's
`ConvNeXt.forward` in eval mode on NHWC input:

    stem (conv 4 x 4 stride 4 -> LayerNorm) -> stages -> [norm_pre] -> mean over H, W
    -> [LayerNorm] -> head

each stage  [LayerNorm -> conv 2 x 2 stride 2] -> blocks, each block

    x + gamma * fc2(GELU(fc1(LayerNorm(conv_dw(x)))))

with conv_dw a depthwise 7 x 7 convolution and fc1, fc2 dense layers on the channels (timm's
`Mlp`, or its `conv_mlp` variant's 1 x 1 convolutions: the same map on NHWC input, held here as
`nnx.Linear` either way and written back in timm's layout by `timm_names`). In NHWC every
LayerNorm (timm's channels-last LayerNorm and its NCHW LayerNorm2d alike) normalizes the last
axis, within one pixel of one example. No BatchNorm: each example's logits depend on that
example and the parameters only.

Book-keeping clipping covers every parameter: the convolutions by their rules
(`finetune.models.taps`: one group, and the depthwise one each group's block), the dense layers
by `nnx.Linear`'s, and the LayerNorm scales and offsets, the biases and the layer scale `gamma`
(a per-channel multiply, C numbers per block) by the clipper's per-example offsets
(`dp.bookkeeping`: exact per-example gradients of every parameter without a rule, from the same
backward pass); no rule is needed for them.

Supported: timm's `convnext_*` with the patch stem (atto, femto, pico, nano, tiny, small, base,
large, xlarge, tiny_hnf). Refused with a ValueError: overlapping stems (`*_ols`), RMSNorm
(`*_rms`), ConvNeXt-V2's global response norm, an MLP head (`convnext_large_mlp`), pooling
other than average, activations other than exact GELU.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from dpprobe.finetune.models.common import float32_logits
from dpprobe.finetune.models.layers import (
    ACTIVATIONS,
    activation_name,
    conv_from_torch,
    is_identity,
    linear_from_torch,
    timm_builder,
)

__all__ = ["ConvNeXt", "convnext_from_timm"]


def _kind(module: Any) -> str:
    return type(module).__name__


def _layer_norm(norm: Any) -> nnx.LayerNorm:
    """An `nnx.LayerNorm` over the last axis with the weights of timm's LayerNorm or
    LayerNorm2d (two-pass float32 statistics, as torch computes them)."""
    if _kind(norm) not in ("LayerNorm", "LayerNorm2d") or norm.weight is None \
            or norm.bias is None:
        raise ValueError(f"ConvNeXt norms must be affine LayerNorm with bias, got {norm}")
    dim = norm.weight.shape[0]
    layer = nnx.eval_shape(lambda: nnx.LayerNorm(dim, epsilon=float(norm.eps),
                                                 use_fast_variance=False, rngs=nnx.Rngs(0)))
    layer.scale.set_value(jax.numpy.asarray(norm.weight.detach().float().numpy()))
    layer.bias.set_value(jax.numpy.asarray(norm.bias.detach().float().numpy()))
    return layer


def _dense(layer: Any) -> nnx.Linear:
    """A torch Linear, or a 1 x 1 Conv2d of one group without padding, as an `nnx.Linear`."""
    if _kind(layer) == "Conv2d":
        if (layer.kernel_size != (1, 1) or layer.stride != (1, 1) or layer.groups != 1
                or layer.padding != (0, 0)):
            raise ValueError(f"unsupported ConvNeXt MLP convolution: {layer}")
        flat = type("Flat", (), {"weight": layer.weight[:, :, 0, 0], "bias": layer.bias})
        return linear_from_torch(flat)
    if _kind(layer) != "Linear":
        raise ValueError(f"unsupported ConvNeXt MLP layer: {layer}")
    return linear_from_torch(layer)


def _identity(module: Any) -> bool:
    return is_identity(module) or _kind(module) == "Dropout"


class Block(nnx.Module):
    """One ConvNeXt block (module docstring), from timm's `ConvNeXtBlock`."""

    def __init__(self, block: Any):
        if _kind(block) != "ConvNeXtBlock":
            raise ValueError(f"unsupported ConvNeXt block {_kind(block)}")
        mlp = block.mlp
        if _kind(mlp) not in ("Mlp", "ConvMlp") or not _identity(mlp.norm):
            raise ValueError(f"unsupported ConvNeXt MLP (global response norm?): {_kind(mlp)}")
        if not (_identity(block.shortcut) and _identity(block.drop_path)
                and _identity(mlp.drop1 if hasattr(mlp, "drop1") else mlp.drop)):
            raise ValueError("ConvNeXt blocks must have an identity shortcut")
        if _kind(block.conv_dw) not in ("Conv2d", "Conv2dSame"):
            raise ValueError(f"unsupported ConvNeXt depthwise convolution: {block.conv_dw}")
        self.conv_dw = conv_from_torch(block.conv_dw)
        self.norm = _layer_norm(block.norm)
        self.mlp_fc1 = _dense(mlp.fc1)
        self.mlp_fc2 = _dense(mlp.fc2)
        self.act = activation_name(mlp.act)
        self.gamma = None if block.gamma is None else nnx.Param(
            jax.numpy.asarray(block.gamma.detach().float().numpy()))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.mlp_fc2(ACTIVATIONS[self.act](self.mlp_fc1(self.norm(self.conv_dw(x)))))
        return x + (y if self.gamma is None else y * self.gamma[...].astype(y.dtype))


class Stage(nnx.Module):
    """A stage: its downsample (LayerNorm, then a strided convolution) or none, then blocks."""

    def __init__(self, stage: Any):
        down = stage.downsample
        if _identity(down):
            self.downsample = None
        elif _kind(down) == "Sequential" and len(down) == 2 and _kind(down[1]) == "Conv2d":
            self.downsample = nnx.List([_layer_norm(down[0]), conv_from_torch(down[1])])
        else:
            raise ValueError(f"unsupported ConvNeXt downsample: {down}")
        self.blocks = nnx.List([Block(b) for b in stage.blocks])

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.downsample is not None:
            x = self.downsample[1](self.downsample[0](x))
        for block in self.blocks:
            x = block(x)
        return x


class ConvNeXt(nnx.Module):
    """timm's ConvNeXt in NNX (module docstring); built by `convnext_from_timm`. `conv_mlp`
    records whether timm holds the MLP as 1 x 1 convolutions (for the way back to timm)."""

    def __init__(self, timm_model: Any, head: nnx.Linear):
        stem = timm_model.stem
        if not (_kind(stem) == "Sequential" and len(stem) == 2 and _kind(stem[0]) == "Conv2d"):
            raise ValueError("ConvNeXt needs the patch stem (conv, LayerNorm); overlapping "
                             "stems (*_ols) are not supported")
        self.stem = nnx.List([conv_from_torch(stem[0]), _layer_norm(stem[1])])
        self.stages = nnx.List([Stage(s) for s in timm_model.stages])
        self.norm_pre = None if _identity(timm_model.norm_pre) else _layer_norm(
            timm_model.norm_pre)
        norm = getattr(timm_model.head, "norm", None)  # none after norm_pre (tiny_hnf)
        self.head_norm = None if _identity(norm) else _layer_norm(norm)
        self.conv_mlp = _kind(timm_model.stages[0].blocks[0].mlp.fc1) == "Conv2d"
        self.head = head

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (timm's `forward_head(..., pre_logits=True)`): (N, H, W, C) -> (N, D)."""
        x = self.stem[1](self.stem[0](x))
        for stage in self.stages:
            x = stage(x)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        x = x.mean(axis=(-3, -2))
        return x if self.head_norm is None else self.head_norm(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))


def _check_head(timm_model: Any) -> None:
    """Raises ValueError for a head other than norm + fc with average pooling."""
    head = timm_model.head
    if _kind(head) not in ("NormMlpClassifierHead", "ClassifierHead") or not _identity(
            getattr(head, "pre_logits", None)):
        raise ValueError("ConvNeXt's head must be norm + fc (no MLP head: convnext_large_mlp)")
    if getattr(head.global_pool, "pool_type", "avg") != "avg":
        raise ValueError("ConvNeXt pooling must be 'avg'")


# Raises ValueError (the constructor) for a stem, block, norm, head or pooling this module does
# not reproduce.
convnext_from_timm = timm_builder(ConvNeXt, "head.fc", _check_head)
