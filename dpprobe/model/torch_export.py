"""A released model as one PyTorch module, and its export to PyTorch (`torch.export`), timm (a
state dict) and ONNX.

Every exported module takes float32 NCHW images in [0, 1] at the model's input size (what the
model's resize, crop and channel transforms give; `dpprobe predict` applies those itself) and
returns the logits: a probe on features is its backbone (timm's module or ScatterNet), timm's
mean/std normalization, the per-example normalization and the linear head; a fine-tuned network
is its mean/std normalization and the network (`dpmodel.torch_models` for cnn, cnn_cifar,
wrn16_4 and the ScatterNet models; timm's own VisionTransformer, filled by
`finetune.models.timm_weights.copy_to_timm`, or Beit, filled by
`finetune.models.beit_weights.load_beit_into_timm`; timm's own ResNet, EfficientNet, ConvNeXt
or BiT ResNetV2, filled by
`finetune.models.timm_names.load_into_timm`, in eval mode: its BatchNorm frozen as trained).
A probe on precomputed embeddings (backbone none) takes the features (n, d).

Features computed from images are float32 here; the store held them as float16 (rounding
below float16 precision, the one step of training not reproduced).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

__all__ = ["FeatureHead", "Normalize", "example_input", "export_model", "export_torch",
           "export_timm", "timm_state_dict", "to_torch"]


class Normalize(torch.nn.Module):
    """(x - mean) / std per channel of NCHW images."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


class FeatureHead(torch.nn.Module):
    """A probe's per-example normalization (`probe.normalize_features`) and linear head."""

    def __init__(self, w: np.ndarray, b: np.ndarray, normalization: str, groups: int,
                 eps: float = 1e-5):
        super().__init__()
        self.normalization, self.groups, self.eps = normalization, int(groups), eps
        self.register_buffer("w", torch.from_numpy(np.asarray(w, np.float32)))
        self.register_buffer("b", torch.from_numpy(np.asarray(b, np.float32)))

    def forward(self, features):
        x = features.float().flatten(1)
        if self.normalization == "l2":
            x = x / torch.clamp(torch.linalg.vector_norm(x, dim=-1, keepdim=True), min=self.eps)
        elif self.normalization == "group":
            grouped = x.reshape(x.shape[0], self.groups, -1)
            mean = grouped.mean(dim=-1, keepdim=True)
            var = ((grouped - mean) ** 2).mean(dim=-1, keepdim=True)
            x = ((grouped - mean) / torch.sqrt(var + self.eps)).reshape(x.shape)
        return x @ self.w + self.b


class _Flatten(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x).flatten(1)


def to_torch(model) -> torch.nn.Module:
    """`Model.to_torch`: the module (eval mode, no gradients needed)."""
    if model.kind == "linear":
        module = _linear_to_torch(model)
    else:
        module = _network_to_torch(model)
    return module.eval()


def _linear_to_torch(model) -> torch.nn.Module:
    from dpprobe.model.backbone import backbone_input_shape, load_backbone

    normalize = model.document["transforms"][0]
    head = FeatureHead(model.arrays["head/w"], model.arrays["head/b"], normalize["method"],
                       normalize["groups"])
    if not model.takes_images:
        return head
    record = model.document["backbone"]
    backbone = load_backbone(record, model.path, weights=model.weights, device="cpu")
    if backbone.name == "scatternet":
        from dpprobe.extract.backbones import Scattering

        _, height, width = backbone_input_shape(record, model.feature_dim)
        provenance = record["backbone"]
        body = Scattering((height, width), J=int(provenance["J"]), L=int(provenance["L"]))
        return torch.nn.Sequential(_Flatten(body), head)
    prep = backbone.preprocessing
    return torch.nn.Sequential(Normalize(prep["mean"], prep["std"]), _Flatten(backbone.module),
                               head)


def _network_to_torch(model) -> torch.nn.Module:
    arch = model.document["architecture"]
    normalize = model.document["transforms"][3]
    if arch["family"] in ("vit", "beit"):
        net = _timm_vit(model)
    elif arch["family"] == "timm_cnn":
        net = _timm_cnn(model)
    else:
        net = _torch_cnn(model)
    return torch.nn.Sequential(Normalize(normalize["mean"], normalize["std"]), net)


def _timm_vit(model):
    """timm's VisionTransformer (or Beit) holding the fine-tuned weights."""
    import timm

    from dpprobe.finetune.models.beit_weights import load_beit_into_timm
    from dpprobe.finetune.models.timm_weights import copy_to_timm

    arch = model.document["architecture"]
    if not arch.get("timm_architecture"):
        raise ValueError(f"{model.path}: the timm architecture of this ViT is not recorded")
    timm_model = timm.create_model(arch["timm_architecture"], pretrained=False,
                                   num_classes=arch["num_classes"], img_size=arch["image_size"],
                                   in_chans=arch["in_channels"])
    if arch["family"] == "beit":
        load_beit_into_timm(model._network, timm_model)
        # The same attention without torch's fused kernel: the ONNX exporter cannot decompose
        # the fused one's output reshape (torch 2.x: "Cannot view a tensor with shape").
        for block in timm_model.blocks:
            block.attn.fused_attn = False
    else:
        copy_to_timm(model._network, timm_model)
    return timm_model.eval()


def _timm_cnn(model):
    """timm's ResNet or EfficientNet holding the fine-tuned weights and frozen statistics."""
    import timm

    from dpprobe.finetune.models.timm_names import load_into_timm

    arch = model.document["architecture"]
    timm_model = timm.create_model(arch["timm_architecture"], pretrained=False,
                                   num_classes=arch["num_classes"], in_chans=arch["in_channels"])
    load_into_timm(model._network, timm_model)
    return timm_model.eval()


def timm_state_dict(model) -> tuple[dict[str, torch.Tensor], dict]:
    """A fine-tuned timm ViT, BEiT, ResNet, EfficientNet, ConvNeXt or BiT ResNetV2 as timm's
    state dict, and the `timm.create_model` arguments that load it with
    `load_state_dict(strict=True)`."""
    family = model.document["architecture"]["family"] if model.kind == "network" else None
    if family not in ("vit", "beit", "timm_cnn"):
        raise ValueError(f"{model.path}: `format=timm` exports a fine-tuned timm ViT, BEiT, "
                         f"ResNet, EfficientNet, ConvNeXt or BiT ResNetV2; this is a "
                         f"{_describe(model)} (use "
                         f"`format=torch` or `format=onnx`)")
    arch = model.document["architecture"]
    kwargs = {"model_name": arch["timm_architecture"], "num_classes": arch["num_classes"],
              "in_chans": arch["in_channels"]}
    if family in ("vit", "beit"):
        kwargs["img_size"] = arch["image_size"]
    net = _timm_vit(model) if family in ("vit", "beit") else _timm_cnn(model)
    state = {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    return state, kwargs


def _describe(model) -> str:
    if model.kind == "linear":
        return "linear probe"
    return f"fine-tuned {model.document['architecture']['family']}"


def _torch_cnn(model) -> torch.nn.Module:
    """A from-scratch model as its `dpmodel.torch_models` counterpart, weights converted."""
    from dpprobe.model import torch_models
    from dpprobe.model.network import SCATTERNET_FAMILIES

    arch = model.document["architecture"]
    classes, side, channels = arch["num_classes"], arch["image_size"], arch["in_channels"]
    flat = {}
    if arch["family"] == "cnn":
        flat_side = (((side + 4 - 8) // 2 + 1 - 1) - 4) // 2 + 1 - 1
        net = torch_models.TorchTemperedCNN(classes, channels, flat_side)
        flat["fc1"] = (32, flat_side, flat_side)
    elif arch["family"] == "cnn_cifar":
        net = torch_models.TorchCifarCNN(classes, channels, side // 8)
        flat["fc1"] = (128, side // 8, side // 8)
    elif arch["family"] == "wrn16_4":
        net = torch_models.TorchWRN(classes, depth=16, width=4, in_channels=channels)
    elif arch["family"] in SCATTERNET_FAMILIES:
        net = torch_models.TorchScatterCNN(classes, channels, side,
                                           linear=arch["family"] == "scatternet_cnn_linear")
        flat["fc1"] = (32, (side // 4 + 1) // 2, (side // 4 + 1) // 2)
    else:
        raise ValueError(f"{model.path}: no PyTorch counterpart for {arch['family']!r}")
    names = {"kernel": "weight", "scale": "weight", "bias": "bias", "gain": "gain"}
    state = {}
    for key, value in model.arrays.items():
        if not key.startswith("params/"):
            continue
        parts = key[len("params/"):].split("/")
        module = ".".join(parts[:-1])
        tensor = np.asarray(value, np.float32)
        if tensor.ndim == 4:  # HWIO -> OIHW
            tensor = tensor.transpose(3, 2, 0, 1)
        elif tensor.ndim == 2:  # (in, out) -> (out, in); NHWC flattening -> NCHW
            if module in flat:
                c, h, w = flat[module]
                tensor = tensor.reshape(h, w, c, -1).transpose(3, 2, 0, 1).reshape(-1, c * h * w)
            else:
                tensor = tensor.T
        state[f"{module}.{names[parts[-1]]}"] = torch.from_numpy(np.ascontiguousarray(tensor))
    if arch["family"] not in SCATTERNET_FAMILIES:
        net.load_state_dict(state, strict=True)
        return net
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("scattering.")]  # ScatterNet's filters
    if missing or unexpected:
        raise ValueError(f"{model.path}: the PyTorch {arch['family']} lacks {unexpected[:3]} or "
                         f"needs {missing[:3]}")
    return net


def example_input(model, batch: int = 2) -> torch.Tensor:
    """A random input of the module's shape (for tracing and tests)."""
    from dpprobe.model.backbone import backbone_input_shape

    generator = torch.Generator().manual_seed(0)
    if model.kind == "network":
        arch = model.document["architecture"]
        shape = (arch["in_channels"], arch["image_size"], arch["image_size"])
    elif not model.takes_images:
        return torch.randn(batch, model.feature_dim, generator=generator)
    else:
        shape = backbone_input_shape(model.document["backbone"], model.feature_dim)
    return torch.rand(batch, *shape, generator=generator)


def _export_note(model) -> str:
    return json.dumps({"source": model.path, "class_names": model.class_names,
                       "privacy": {"epsilon": model.privacy.epsilon,
                                   "delta": model.privacy.delta,
                                   "accountant": model.privacy.accountant,
                                   "neighboring_relation": model.privacy.neighboring_relation},
                       "input": _input_text(model)})


def _input_text(model) -> str:
    if model.kind == "linear" and not model.takes_images:
        return f"float32 features (n, {model.feature_dim})"
    shape = tuple(example_input(model, 1).shape[1:])
    return f"float32 NCHW images in [0, 1], (n, {shape[0]}, {shape[1]}, {shape[2]})"


def export_torch(model) -> tuple[bytes, str]:
    """(bytes of a `torch.export` program, its input) : `torch.export.load(f).module()`.

    A ScatterNet is exported a scale at a time with batched FFTs
    (`extract.scattering.batch_scatterings`, dft "fft": kymatio's arithmetic in 229 graph
    operations, where kymatio's filter-by-filter module traces 3,039; the same logits, 1.8e-6
    from dpprobe's either way): at 28 px, 7-13x faster to export and 9-11x faster to
    `torch.export.load`, faster on small batches and slower on large ones
    (`extract.scattering`, `benchmarks/export.py`). `to_torch` keeps kymatio's module."""
    import io

    from dpprobe.extract.scattering import batch_scatterings

    module = batch_scatterings(to_torch(model), dft="fft")
    example = example_input(model)
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={"dpprobe_export.json": _export_note(model)})
    return buffer.getvalue(), _input_text(model)


def export_timm(model) -> tuple[bytes, str, dict]:
    """(bytes of timm's state dict as safetensors, its input, the `timm.create_model`
    arguments that load it); the source, class names and privacy claim in its metadata."""
    from safetensors.torch import save  # torch, as this module

    state, kwargs = timm_state_dict(model)
    note = json.dumps({"create_model": kwargs, "source": model.path,
                       "class_names": model.class_names,
                       "privacy": dataclasses.asdict(model.privacy) | {"ledger": None}})
    inputs = (f"timm's preprocessing: NCHW images normalized by mean "
              f"{model.document['transforms'][3]['mean']} and std "
              f"{model.document['transforms'][3]['std']}")
    return save(state, metadata={"dpprobe_export": note}), inputs, kwargs


def export_model(model, format: str, out: str) -> tuple[bytes, str, str]:
    """A model file exported to one format (`dpprobe export`).

    Args:
      model: the loaded model file (`dpmodel.load_model`).
      format: "torch" (`export_torch`), "onnx" (`onnx_export.export_onnx`) or "timm"
        (`export_timm`).
      out: where the bytes will be written (named in the loading code).

    Returns:
      (the file's bytes, its input, the Python code that loads it).
    """
    if format == "torch":
        data, inputs = export_torch(model)
        return data, inputs, f"torch.export.load({out!r}).module()"
    if format == "onnx":
        from dpprobe.model.onnx_export import export_onnx  # it builds on this module

        data, inputs = export_onnx(model)
        return data, inputs, f"onnxruntime.InferenceSession({out!r})"
    data, inputs, kwargs = export_timm(model)
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "model_name")
    return data, inputs, (f"timm.create_model({kwargs['model_name']!r}, {args})"
                          f".load_state_dict(safetensors.torch.load_file({out!r}), strict=True)")
