"""Flax NNX image classifiers for DP-SGD fine-tuning of every weight.

Every model maps float32 NHWC images (already normalized) to float32 logits, is a pure function
of (params, x) with no cross-example coupling (no BatchNorm, no dropout: per-example gradients
are well defined), keeps all weights as `nnx.Param`, and has a zero-initialized head
(`finetune.models.common` states the contract).

  * `create_model(name, ...)`: "cnn", "cnn_cifar" (Tramer & Boneh 2021), "wrn16_4" (De et al.
    2022, GroupNorm + weight standardization), "scatternet_cnn" (Tramer & Boneh's CNN on a
    fixed ScatterNet), "scatternet_cnn_linear" (that CNN and a linear model on the ScatterNet,
    one head), or a timm ViT name at random init;
  * `vit_from_timm(timm_model, ...)`: a timm VisionTransformer (pretrained or not) as NNX;
  * `check_no_batchnorm(module)`: the refusal every constructor applies.
"""

from dpprobe.finetune.models import taps as _taps  # noqa: F401 - registers the book-keeping rules
from dpprobe.finetune.models.cnn import CifarCNN, TemperedCNN
from dpprobe.finetune.models.common import BATCHNORM_MESSAGE, check_no_batchnorm
from dpprobe.finetune.models.factory import MODEL_NAMES, create_model, input_mean_std
from dpprobe.finetune.models.timm_weights import vit_from_timm
from dpprobe.finetune.models.vit import VisionTransformer, ViTConfig, vit_config_from_timm
from dpprobe.finetune.models.wrn import WideResNet, WSConv, standardize_weight

__all__ = [
    "BATCHNORM_MESSAGE",
    "MODEL_NAMES",
    "CifarCNN",
    "TemperedCNN",
    "ViTConfig",
    "VisionTransformer",
    "WSConv",
    "WideResNet",
    "check_no_batchnorm",
    "create_model",
    "input_mean_std",
    "standardize_weight",
    "vit_config_from_timm",
    "vit_from_timm",
]
