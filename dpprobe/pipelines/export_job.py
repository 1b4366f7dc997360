"""The export job: a released model (`dpmodel`) written where models are served.

  * `torch`: a `torch.export` program (`torch.export.load(OUT).module()`), any model;
  * `timm`: a fine-tuned timm ViT, BEiT, ResNet, EfficientNet, ConvNeXt or BiT ResNetV2 as
    timm's state dict (safetensors), loaded by
    `timm.create_model(name, num_classes=K[, img_size=S])` and `load_state_dict(strict=True)`;
  * `onnx`: an ONNX model (opset 20, torch's TorchScript exporter: `model.onnx_export`), any
    model.

The exported modules take float32 NCHW images in [0, 1] at the model's input size (a probe on
precomputed embeddings: its features) and return the logits (`dpmodel.torch_export`).
"""

from __future__ import annotations

import dataclasses
import os

from dpprobe import checks, preflight
from dpprobe import model as dpmodel
from dpprobe.files import atomic_write_bytes
from dpprobe.messages import log
from dpprobe.options import option

__all__ = ["FORMATS", "ExportConfig", "run_export"]

FORMATS = ("torch", "timm", "onnx")


# `dpprobe export`'s parser texts (help, description, epilog).
TEXTS = dict(
    help="export a model file to PyTorch (torch.export), timm or ONNX",
    description="The exported module takes float32 NCHW images in [0, 1] at the model's "
    "input size (a probe on precomputed embeddings: its features) and returns logits.",
)


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What `run_export` does.

    Attributes:
      model: a model file.
      format: one of `FORMATS`.
      out: the file to write.
      weights: a copy of the backbone's weights file (sha256 checked), where the recorded path
        is not on this machine.
    """

    model: str = option(help="a dpprobe model file")
    format: str = option(choices=FORMATS, help="torch: a torch.export program (any model); "
                         "timm: a fine-tuned timm ViT's, ResNet's or EfficientNet's state "
                         "dict; onnx: an ONNX model (any model)")
    out: str = option(positional=True, metavar="OUT", help="the file to write")
    weights: str | None = option(
        None, help="a copy of the backbone's weights file (sha256 checked)")
    quiet: bool = option(False, action="store_true")

    def __post_init__(self):
        if self.format not in FORMATS:
            raise checks.ConfigError("format", f"must be one of {FORMATS}, got {self.format!r}")
        checks.freeze(self, model=os.fspath(self.model), out=os.fspath(self.out))


def run_export(config: ExportConfig | str, /, **options) -> dict:
    """Export a model file: `run_export(ExportConfig(...))` or `run_export(model, format=...,
    out=...)`. Returns {"out", "format", "input", "load"} (how to load it)."""
    config = checks.make_config(ExportConfig, config, "model", **options)
    preflight.check_output_paths(**{"OUT": config.out})
    if os.path.realpath(config.out) == os.path.realpath(config.model):
        raise ValueError(f"OUT {config.out} is the model file itself; choose another path")
    if config.format == "onnx":
        preflight.require_module("onnxscript", "`format=onnx`",
                                 "pip install 'dpprobe[onnx]' (onnx, onnxruntime, onnxscript)")
    model = dpmodel.load_model(config.model)
    model.weights = config.weights
    if config.format != "timm":  # loading torch and the backbone, tracing: seconds to a minute
        log(f"export: tracing {config.model} as {config.format} (seconds to a minute on a "
            "CPU)", config.quiet)
    from dpprobe.model import torch_export  # torch: imported when a model is exported

    data, inputs, load = torch_export.export_model(model, config.format, config.out)
    atomic_write_bytes(config.out, data)
    log(f"wrote {config.out} ({config.format}); input: {inputs}", config.quiet)
    return {"out": config.out, "format": config.format, "input": inputs, "load": load,
            "class_names": model.class_names, "privacy": dataclasses.asdict(model.privacy)}
