"""Every family `dpprobe finetune` converts is covered by book-keeping rules or offset-layer
declarations: the "no rule for the layers ..." notice is for a user's own layers only, so a
built-in family that printed it would be a rule or a declaration missing (`dp.taps`)."""

from __future__ import annotations

import pytest
from flax import nnx

from dpprobe.dp.taps import unknown_layers
from dpprobe.finetune import models

TIMM = {
    "vit_tiny_patch16_224": {"img_size": 32},
    "beit_base_patch16_224": {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2,
                              "num_heads": 2},
    "resnet18": {},
    "tf_efficientnet_lite0": {},
    "convnext_atto": {},
    "resnetv2_50x1_bit": {},
}


def _trained(model) -> set[tuple]:
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return {tuple(path) for path, _ in nnx.to_flat_state(params)}


@pytest.mark.parametrize("name", sorted(TIMM))
def test_timm_families_need_no_notice(name):
    import timm

    model = models.model_from_timm(
        timm.create_model(name, pretrained=False, num_classes=10, **TIMM[name]), 10,
        rngs=nnx.Rngs(0))
    assert unknown_layers(model, _trained(model)) == {}


@pytest.mark.parametrize("name", sorted(models.MODEL_NAMES))
def test_our_models_need_no_notice(name):
    side, channels = (32, 3) if name == "cnn_cifar" else (28, 1)  # CIFAR's CNN takes 32 px RGB
    model = models.create_model(name, 10, image_size=side, in_channels=channels,
                                rngs=nnx.Rngs(0))
    assert unknown_layers(model, _trained(model)) == {}
