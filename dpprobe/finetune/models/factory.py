"""`create_model`: a fine-tuning model by name, at random init."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from dpprobe.finetune.models.beit_weights import beit_from_timm
from dpprobe.finetune.models.bit import resnetv2_from_timm
from dpprobe.finetune.models.cnn import CifarCNN, TemperedCNN
from dpprobe.finetune.models.common import check_no_batchnorm
from dpprobe.finetune.models.convnext import convnext_from_timm
from dpprobe.finetune.models.efficientnet import efficientnet_from_timm
from dpprobe.finetune.models.resnet import resnet_from_timm
from dpprobe.finetune.models.scatter import ScatterCNN
from dpprobe.finetune.models.timm_weights import vit_from_timm
from dpprobe.finetune.models.wrn import WideResNet

__all__ = ["MODEL_NAMES", "TIMM_FAMILIES", "create_model", "input_mean_std", "model_from_timm"]

_CONSTRUCTORS = {
    "cnn": TemperedCNN,
    "cnn_cifar": CifarCNN,
    "wrn16_4": functools.partial(WideResNet, depth=16, width=4),
    "scatternet_cnn": ScatterCNN,
    "scatternet_cnn_linear": functools.partial(ScatterCNN, linear=True),
}
MODEL_NAMES: tuple[str, ...] = tuple(_CONSTRUCTORS)
# The input's per-channel (mean, std) after scaling to [0, 1]: [-1, 1] for the models trained
# from scratch, [0, 1] (Tramer & Boneh's ScatterNet input) for the ScatterNet models.
_MEAN_STD = {"scatternet_cnn": (0.0, 1.0), "scatternet_cnn_linear": (0.0, 1.0)}


# timm's model classes this package converts (class name -> converter), the families
# `dpprobe finetune --model <timm name>` accepts.
_FROM_TIMM = {"VisionTransformer": vit_from_timm, "ResNet": resnet_from_timm,
              "EfficientNet": efficientnet_from_timm,
              "ConvNeXt": convnext_from_timm}
_FROM_TIMM["Beit"] = beit_from_timm  # BEiT (`finetune.models.beit`)
_FROM_TIMM["ResNetV2"] = resnetv2_from_timm  # BiT (`finetune.models.bit`)
TIMM_FAMILIES: tuple[str, ...] = tuple(_FROM_TIMM)


def model_from_timm(timm_model, num_classes: int | None, *, rngs: nnx.Rngs,
                    head_bias_init: float = 0.0) -> nnx.Module:
    """Our NNX model of a timm (torch) model, its weights copied: a VisionTransformer
    (`vit_from_timm`), ResNet (`resnet_from_timm`) or EfficientNet (`efficientnet_from_timm`,
    Lite included), BatchNorm frozen at its running statistics.

    Args:
      timm_model: the timm model (pretrained or not; its weights are what the result holds).
      num_classes: None keeps timm's classifier; an int makes a new zero head of that many
        classes with bias `head_bias_init`.
      rngs: for a new head's construction.
      head_bias_init: bias of a new head.

    Returns:
      An `nnx.Module` meeting the contract of `finetune.models.common`.

    Raises:
      ValueError: for a timm class outside `TIMM_FAMILIES` or a variant its converter refuses.
    """
    import timm.models

    for name, convert in _FROM_TIMM.items():
        if type(timm_model) is getattr(timm.models, name):
            return convert(timm_model, num_classes, rngs=rngs, head_bias_init=head_bias_init)
    raise ValueError(f"finetuning converts timm's {', '.join(TIMM_FAMILIES)}; got "
                     f"{type(timm_model).__name__}")


def input_mean_std(name: str) -> tuple[float, float]:
    """The (mean, std) of every channel a from-scratch model `name` reads its images with
    (public constants, never data statistics)."""
    return _MEAN_STD.get(name, (0.5, 0.5))


def create_model(name: str, num_classes: int, *, image_size: int, in_channels: int,
                 rngs: nnx.Rngs, head_bias_init: float = 0.0) -> nnx.Module:
    """A randomly initialized model whose head is zero (bias `head_bias_init`).

    Args:
      name: one of `MODEL_NAMES` ("cnn": Tramer & Boneh's MNIST CNN, "cnn_cifar": their CIFAR-10
        CNN, "wrn16_4": De et al.'s WRN-16-4 with GroupNorm and weight standardization,
        "scatternet_cnn": their CNN on a fixed ScatterNet, "scatternet_cnn_linear": that CNN
        and a linear model on the ScatterNet, one head over both), or a
        timm name of a VisionTransformer (vit_*_patch*_*, deit_*, deit3_*), ResNet (resnet*,
        resnext*), EfficientNet (efficientnet_*, tf_efficientnet_lite*), ConvNeXt
        (convnext_*), BEiT (beit_*) or BiT ResNetV2 (resnetv2_*_bit): its architecture
        (at `image_size` for a ViT) built by timm at random init (timm's init, seeded from
        `rngs`), then converted by `model_from_timm`.
      num_classes: classes of the head.
      image_size: side of the square NHWC input images.
      in_channels: channels of the input images.
      rngs: randomness for the initialization.
      head_bias_init: the head's bias (its kernel is zero).

    Returns:
      An `nnx.Module` meeting the contract of `finetune.models.common`.

    Raises:
      ValueError: for an unknown name, a timm model of no supported family, or a model with
        (unfrozen) BatchNorm.
    """
    if name in _CONSTRUCTORS:
        model = _CONSTRUCTORS[name](num_classes, image_size=image_size, in_channels=in_channels,
                                    rngs=rngs, head_bias_init=head_bias_init)
    else:
        model = model_from_timm(_timm_model(name, num_classes, image_size, in_channels, rngs),
                                num_classes, rngs=rngs, head_bias_init=head_bias_init)
    check_no_batchnorm(model)
    return model


def _timm_model(name: str, num_classes: int, image_size: int, in_channels: int,
                rngs: nnx.Rngs):
    """timm's random-init model, its torch RNG seeded from `rngs` (global torch RNG untouched)."""
    import timm
    import torch

    choices = f"one of {MODEL_NAMES} or a timm name of a {', '.join(TIMM_FAMILIES)}"
    if not timm.is_model(name):
        raise ValueError(f"unknown model {name!r}: choose {choices}")
    seed = int(jax.random.randint(rngs.params(), (), 0, 2**31 - 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return timm.create_model(name, pretrained=False, num_classes=num_classes,
                                     img_size=image_size, in_chans=in_channels)
        except TypeError as err:  # a convolutional net: it takes any input size
            if "img_size" not in str(err):
                raise
            return timm.create_model(name, pretrained=False, num_classes=num_classes,
                                     in_chans=in_channels)
