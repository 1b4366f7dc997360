"""Flax NNX image classifiers for DP-SGD fine-tuning of every weight.

Every model maps float32 NHWC images (already normalized) to float32 logits, is a pure function
of (params, x) with no cross-example coupling (no batch statistics: BatchNorm only frozen at its
running statistics; no dropout: per-example gradients are well defined), keeps all trained
weights as `nnx.Param`, and has a zero-initialized head (`finetune.models.common` states the
contract).

  * `create_model(name, ...)`: "cnn", "cnn_cifar" (Tramer & Boneh 2021), "wrn16_4" (De et al.
    2022, GroupNorm + weight standardization), "scatternet_cnn" (Tramer & Boneh's CNN on a
    fixed ScatterNet), "scatternet_cnn_linear" (that CNN and a linear model on the ScatterNet,
    one head), or a timm ViT, BEiT, ResNet, EfficientNet, ConvNeXt or BiT ResNetV2 name at
    random init;
  * `model_from_timm(timm_model, ...)`: a timm VisionTransformer (`vit_from_timm`), Beit
    (`beit_from_timm`), ResNet (`resnet_from_timm`), EfficientNet (`efficientnet_from_timm`)
    ConvNeXt (`convnext_from_timm`) or BiT ResNetV2 (`resnetv2_from_timm`), pretrained or
    not, as NNX, BatchNorm frozen
    (`FrozenBatchNorm`);
  * `check_no_batchnorm(module)`: the refusal every constructor applies.
"""

from dpprobe.finetune.models import taps as _taps  # noqa: F401 - registers the book-keeping rules
from dpprobe.finetune.models.beit import Beit, BeitConfig
from dpprobe.finetune.models.beit_weights import beit_from_timm
from dpprobe.finetune.models.bit import ResNetV2, resnetv2_from_timm
from dpprobe.finetune.models.cnn import CifarCNN, TemperedCNN
from dpprobe.finetune.models.common import BATCHNORM_MESSAGE, check_no_batchnorm
from dpprobe.finetune.models.convnext import ConvNeXt, convnext_from_timm
from dpprobe.finetune.models.efficientnet import EfficientNet, efficientnet_from_timm
from dpprobe.finetune.models.factory import (
    MODEL_NAMES,
    TIMM_FAMILIES,
    create_model,
    input_mean_std,
    model_from_timm,
)
from dpprobe.finetune.models.layers import FrozenBatchNorm
from dpprobe.finetune.models.resnet import ResNet, resnet_from_timm
from dpprobe.finetune.models.timm_weights import vit_from_timm
from dpprobe.finetune.models.vit import VisionTransformer, ViTConfig, vit_config_from_timm
from dpprobe.finetune.models.wrn import WideResNet, WSConv, standardize_weight

__all__ = [
    "BATCHNORM_MESSAGE",
    "Beit",
    "BeitConfig",
    "beit_from_timm",
    "MODEL_NAMES",
    "TIMM_FAMILIES",
    "CifarCNN",
    "ConvNeXt",
    "EfficientNet",
    "FrozenBatchNorm",
    "ResNet",
    "ResNetV2",
    "TemperedCNN",
    "ViTConfig",
    "VisionTransformer",
    "WSConv",
    "WideResNet",
    "check_no_batchnorm",
    "convnext_from_timm",
    "create_model",
    "efficientnet_from_timm",
    "input_mean_std",
    "model_from_timm",
    "resnet_from_timm",
    "resnetv2_from_timm",
    "standardize_weight",
    "vit_config_from_timm",
    "vit_from_timm",
]
