"""Fine-tuned networks (`finetune.models`: cnn, cnn_cifar, wrn16_4, the ScatterNet models, timm
ViTs, BEiTs, ResNets and EfficientNets) in a model file: their parameters keyed by module path
(and a frozen BatchNorm's running statistics, the pretrained public constants, under `stats/`), the
architecture to rebuild them, and the image transforms training used (resize, crop, channels,
[0, 1] scaling, per-channel mean and std). A user's own NNX module (`finetune.own_model`) is
recorded by its class name (family "own_module"): its class is the user's code, so it is
rebuilt only from an instance given back (`load_model(path, module=...)`).

A loaded network computes its logits with `finetune.iter_logits`, the function the finetune
job's evaluation uses, so that it predicts the classes its job scored.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["OWN_MODULE", "PARAMS_PREFIX", "SCATTERNET_FAMILIES", "STATS_PREFIX", "TIMM_CNN",
           "network_arrays", "network_document", "rebuild_network"]

PARAMS_PREFIX = "params/"
STATS_PREFIX = "stats/"  # frozen BatchNorm statistics (`finetune.models.FrozenBatchNorm`)
TIMM_CNN = "timm_cnn"  # the family of timm's ResNets and EfficientNets, rebuilt through timm
SCATTERNET_FAMILIES = ("scatternet_cnn", "scatternet_cnn_linear")  # a fixed kymatio front
OWN_MODULE = "own_module"  # a user's own NNX module (`finetune.own_model`)


def network_arrays(model) -> dict[str, np.ndarray]:
    """The model's `nnx.Param`s as float32 arrays keyed `params/<module path>`, and its frozen
    BatchNorm statistics (`nnx.BatchStat`) keyed `stats/<module path>`."""
    from flax import nnx

    return {prefix + "/".join(map(str, keys)): np.asarray(value[...], np.float32)
            for prefix, kind in ((PARAMS_PREFIX, nnx.Param), (STATS_PREFIX, nnx.BatchStat))
            for keys, value in nnx.to_flat_state(nnx.state(model, kind))}


def network_document(model, *, name: str, num_classes: int, image_size: int, channels: int,
                     resize: int | None, crop: int | None, rgb: bool, mean, std,
                     timm_architecture: str | None) -> dict:
    """The architecture and transforms of a fine-tuned model (public inputs only)."""
    from dpprobe.finetune.models import (
        MODEL_NAMES,
        Beit,
        ConvNeXt,
        EfficientNet,
        ResNet,
        ResNetV2,
        VisionTransformer,
    )

    architecture = {"name": name, "num_classes": num_classes, "image_size": image_size,
                    "in_channels": channels}
    if isinstance(model, VisionTransformer):
        architecture |= {"family": "vit", "vit_config": dataclasses.asdict(model.config),
                         "timm_architecture": timm_architecture}
    elif isinstance(model, Beit):
        architecture |= {"family": "beit", "beit_config": dataclasses.asdict(model.config),
                         "timm_architecture": timm_architecture}
    elif isinstance(model, ResNet | EfficientNet | ConvNeXt | ResNetV2):
        architecture |= {"family": TIMM_CNN, "timm_architecture": timm_architecture}
    elif name in MODEL_NAMES:
        architecture["family"] = name
    else:  # the user's class, by its qualified name
        architecture |= {"family": OWN_MODULE, "module_class": name}
    if name in SCATTERNET_FAMILIES:
        architecture["scatternet"] = _scatternet()
    return {
        "kind": "network",
        "architecture": architecture,
        "input": {"kind": "images", "image_size": image_size, "channels": channels},
        "transforms": [
            {"op": "resize_crop", "resize": resize, "crop": crop, "interpolation": "bicubic",
             "note": "short side resized to `resize` (if set), then a centered square of "
                     "`crop` (default: the short side) pixels; the result must be image_size"},
            {"op": "channels", "channels": channels, "grayscale_to_rgb": rgb},
            {"op": "scale", "divide_by": 255.0},
            {"op": "normalize_channels", "mean": list(mean), "std": list(std)},
        ],
    }


def _scatternet() -> dict:
    """The fixed front of a ScatterNet model (`finetune.models.scatter`), recorded in its file."""
    from dpprobe.finetune.models import scatter

    return {"library": "kymatio", "J": scatter.SCATTER_J, "L": scatter.SCATTER_L,
            "groupnorm_groups": scatter.GROUPS}


def rebuild_network(arrays: dict[str, np.ndarray], document: dict, path: str, module=None):
    """The `nnx.Module` of a model file, every parameter set from its arrays; `module`: an
    instance of the class an own-module file names (copied, never changed), else unused."""
    import jax.numpy as jnp
    from flax import nnx

    from dpprobe.finetune import models
    from dpprobe.finetune.models.common import unset_params
    from dpprobe.model.format import ModelFileError

    arch = document["architecture"]
    classes, side, channels = arch["num_classes"], arch["image_size"], arch["in_channels"]
    if arch["family"] == "vit":
        config = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in arch["vit_config"].items()}
        config = models.ViTConfig(**config)
        model = nnx.eval_shape(lambda: models.VisionTransformer(config, classes,
                                                                rngs=nnx.Rngs(0)))
    elif arch["family"] == "beit":
        beit = models.BeitConfig(**{k: tuple(v) if isinstance(v, list) else v
                                    for k, v in arch["beit_config"].items()})
        model = nnx.eval_shape(lambda: models.Beit(beit, classes, rngs=nnx.Rngs(0)))
    elif arch["family"] == TIMM_CNN:  # timm's module tree at random init, every value then set
        model = _timm_cnn(arch["timm_architecture"], classes, channels)
    elif arch["family"] in SCATTERNET_FAMILIES and arch.get("scatternet") != _scatternet():
        raise ModelFileError(f"{path}: its ScatterNet {arch.get('scatternet')} is not this "
                             f"version's {_scatternet()}")
    elif arch["family"] == OWN_MODULE:
        model = _own_module(arch["module_class"], module, path)
    elif arch["family"] in models.MODEL_NAMES:
        model = nnx.eval_shape(lambda: models.create_model(
            arch["family"], classes, image_size=side, in_channels=channels, rngs=nnx.Rngs(0)))
    else:
        raise ModelFileError(f"{path}: unknown network family {arch['family']!r}")
    expected = set()
    for keys, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param | nnx.BatchStat):
            continue
        prefix = PARAMS_PREFIX if isinstance(param, nnx.Param) else STATS_PREFIX
        name = prefix + "/".join(map(str, keys))
        expected.add(name)
        if name not in arrays:
            raise ModelFileError(f"{path} lacks the parameter {name}")
        value = arrays[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ModelFileError(f"{path}: parameter {name} is {value.shape}, the architecture "
                                 f"needs {tuple(param.shape)}")
        param.set_value(jnp.asarray(value))
    extra = sorted(k for k in arrays if k.startswith((PARAMS_PREFIX, STATS_PREFIX))
                   and k not in expected)
    if extra:
        raise ModelFileError(f"{path} holds parameters the architecture lacks: {extra[:3]}")
    unset = unset_params(model)
    if unset:
        raise ModelFileError(f"{path}: parameters left unset: {unset[:3]}")
    return model


def _own_module(class_name: str, module, path: str):
    """A copy of `module`, the instance of `class_name` given back for an own-module file."""
    from flax import nnx

    from dpprobe.model.format import ModelFileError

    if module is None:
        raise ModelFileError(f"{path} holds the parameters of your own Flax module "
                             f"{class_name}: load it with dpprobe.load_model(path, "
                             f"module=<an instance of {class_name}>)")
    given = f"{type(module).__module__}.{type(module).__qualname__}"
    if given != class_name:
        raise ModelFileError(f"{path} holds a {class_name}, not a {given}")
    return nnx.clone(module)


def _timm_cnn(architecture: str, num_classes: int, channels: int):
    """Our ResNet / EfficientNet of timm's `architecture` (values to be overwritten)."""
    import timm
    from flax import nnx

    from dpprobe.finetune.models import model_from_timm

    timm_model = timm.create_model(architecture, pretrained=False, num_classes=num_classes,
                                   in_chans=channels)
    return model_from_timm(timm_model.eval(), None, rngs=nnx.Rngs(0))
