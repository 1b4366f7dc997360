"""The weight map between timm's (torch) VisionTransformer and ours (`finetune.models.vit`),
both ways: `copy_from_timm` builds a model from timm's weights (what fine-tuning starts from),
`copy_to_timm` writes a fine-tuned model back into a timm model of the same architecture (what
`dpprobe export --format timm` releases). Both go through one list of pairs (`weight_pairs`),
so one is the exact inverse of the other (tested both ways).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpprobe.finetune.models.common import check_no_batchnorm, zero_head
from dpprobe.finetune.models.vit import VisionTransformer, vit_config_from_timm

__all__ = ["abstract_with_head", "copy_from_timm", "copy_to_timm", "vit_from_timm", "weight_pairs"]


def weight_pairs(model, timm_model: Any, *, include_head: bool) -> list:
    """(our `nnx.Param`, the timm tensor in our layout) for every weight: a torch view
    (OIHW -> HWIO permuted, Linear (out, in) transposed), so that copying into it writes the
    timm parameter itself."""
    pairs = [(model.patch_embed.kernel, timm_model.patch_embed.proj.weight.permute(2, 3, 1, 0)),
             (model.pos_embed, timm_model.pos_embed)]
    if model.patch_embed.bias is not None:
        pairs.append((model.patch_embed.bias, timm_model.patch_embed.proj.bias))
    if model.cls_token is not None:
        pairs.append((model.cls_token, timm_model.cls_token))
    for ours, theirs in [(model.norm_pre, timm_model.norm_pre), (model.norm, timm_model.norm),
                         (model.fc_norm, timm_model.fc_norm)]:
        if ours is not None:
            pairs += _norm_pairs(ours, theirs)
    for ours, theirs in zip(model.blocks, timm_model.blocks, strict=True):
        pairs += _norm_pairs(ours.norm1, theirs.norm1) + _norm_pairs(ours.norm2, theirs.norm2)
        for attn_or_mlp, layer in [("attn", "qkv"), ("attn", "proj"), ("mlp", "fc1"),
                                   ("mlp", "fc2")]:
            pairs += _linear_pairs(getattr(getattr(ours, attn_or_mlp), layer),
                                   getattr(getattr(theirs, attn_or_mlp), layer))
        if ours.ls1 is not None:
            pairs += [(ours.ls1, theirs.ls1.gamma), (ours.ls2, theirs.ls2.gamma)]
    if include_head:
        pairs += _linear_pairs(model.head, timm_model.head)
    return pairs


def copy_from_timm(model, timm_model: Any, *, include_head: bool) -> None:
    """Set every `nnx.Param` of `model` (all but a new head) from the matching timm tensor."""
    for param, tensor in weight_pairs(model, timm_model, include_head=include_head):
        value = jnp.asarray(tensor.detach().cpu().float().numpy())
        if value.shape != param.shape:
            raise ValueError(f"shape mismatch copying timm weights: {value.shape} into "
                             f"{param.shape}")
        param.set_value(value)
    unset = [path for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Param) and isinstance(node.get_value(), jax.ShapeDtypeStruct)]
    if unset:
        raise ValueError(f"timm weights left these parameters unset: {unset}")


def copy_to_timm(model, timm_model: Any) -> None:
    """The inverse of `copy_from_timm`: every timm parameter, head included, set from `model`
    (through the same pairs, written into timm's layout). The timm model must have the same
    architecture (`vit_config_from_timm(timm_model)` equal to `model.config`) and as many
    classes."""
    import torch


    if vit_config_from_timm(timm_model) != model.config:
        raise ValueError("the timm model's architecture differs from the NNX model's")
    pairs = weight_pairs(model, timm_model, include_head=True)
    if len({id(p) for p, _ in pairs}) != sum(1 for _, n in nnx.iter_graph(model)
                                             if isinstance(n, nnx.Param)):
        raise ValueError("not every parameter of the NNX model has a timm counterpart")
    with torch.no_grad():
        for param, tensor in pairs:
            value = torch.from_numpy(np.array(param[...], np.float32))
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch copying into timm: {tuple(value.shape)} into "
                                 f"{tuple(tensor.shape)}")
            tensor.copy_(value)


def _norm_pairs(norm: nnx.LayerNorm, torch_norm: Any) -> list:
    """(scale, weight), (bias, bias)."""
    return [(norm.scale, torch_norm.weight), (norm.bias, torch_norm.bias)]


def _linear_pairs(linear: nnx.Linear, torch_linear: Any) -> list:
    """(kernel, weight^T), and the bias when there is one."""
    pairs = [(linear.kernel, torch_linear.weight.T)]
    if linear.bias is not None:
        pairs.append((linear.bias, torch_linear.bias))
    return pairs


def abstract_with_head(build, timm_model: Any, embed_dim: int, num_classes: int | None, *,
                       rngs: nnx.Rngs, head_bias_init: float) -> tuple[nnx.Module, bool]:
    """A transformer's abstract body (no random init to overwrite: every Param is then set
    from timm) with its head: timm's kept (`num_classes` None: its Linear's classes) or a new
    zero head. Returns (the model, whether timm's head is kept).

    Args:
      build: `build(num_classes)` constructs the NNX model.
      timm_model: the timm model it converts.
      embed_dim: the head's input width.
      num_classes: None keeps timm's head; an int a new zero head of that many classes.
      rngs, head_bias_init: the new head's construction and bias.
    """
    keep_head = num_classes is None
    if keep_head:
        import torch.nn as tnn

        if not isinstance(timm_model.head, tnn.Linear):
            raise ValueError("num_classes=None keeps timm's head, but this model has none "
                             "(num_classes=0); pass the number of classes")
        num_classes = timm_model.head.out_features
    model = nnx.eval_shape(lambda: build(num_classes))
    model.head = zero_head(embed_dim, num_classes, head_bias_init=head_bias_init, rngs=rngs)
    return model, keep_head


def vit_from_timm(timm_model: Any, num_classes: int | None, *, rngs: nnx.Rngs,
                  head_bias_init: float = 0.0) -> VisionTransformer:
    """Our NNX `VisionTransformer` with the weights of a timm (torch) `VisionTransformer`.

    The caller builds the timm model (`timm.create_model(name, pretrained=..., img_size=...,
    in_chans=...)`), so timm does the weight loading and resamples the position embedding to
    the image size; this copies the tensors (NCHW/OIHW to NHWC/HWIO, Linear (out, in) to
    (in, out)). For an NCHW batch `b`, `model(b.transpose(0, 2, 3, 1))` equals
    `timm_model.eval()(b)` up to float rounding.

    Args:
      timm_model: a timm `VisionTransformer` instance (see the module docstring for which).
      num_classes: None keeps timm's head (its Linear weights); an int replaces it with a new
        zero-initialized head of that many classes with bias `head_bias_init`.
      rngs: for the head's construction (its values are constants: zero kernel, constant bias).
      head_bias_init: bias of a new head.

    Returns:
      A `VisionTransformer`.

    Raises:
      ValueError: for a BatchNorm anywhere in `timm_model` (`check_no_batchnorm`) or an
        architecture this module does not reproduce.
    """
    check_no_batchnorm(timm_model)
    config = vit_config_from_timm(timm_model)
    model, keep_head = abstract_with_head(
        lambda classes: VisionTransformer(config, classes, rngs=nnx.Rngs(0)), timm_model,
        config.embed_dim, num_classes, rngs=rngs, head_bias_init=head_bias_init)
    copy_from_timm(model, timm_model, include_head=keep_head)
    check_no_batchnorm(model)
    return model
