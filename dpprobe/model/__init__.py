"""Released models: one self-describing file per trained model, loaded, applied and exported.

  * `dpmodel.format`: the file (safetensors: arrays + one JSON description), its checks;
  * `dpmodel.linear`, `dpmodel.network`: what a probe on features and a fine-tuned network
    store, and how their logits are computed (the jobs' own evaluation functions);
  * `dpmodel.backbone`: the recorded backbone rebuilt by `extract`, weights sha256-checked;
  * `dpmodel.model`: `load_model` and `Model` (predict, predict_proba, to_torch);
  * `dpmodel.torch_export`, `dpmodel.torch_models`: PyTorch modules, torch.export, timm and
    ONNX exports.

Arrows: `dpmodel -> {probe, finetune, extract}`; `pipelines` (the jobs that write model files,
predict, export) and `dpprobe` import it.
"""

from dpprobe.model.format import (
    FORMAT,
    FORMAT_VERSION,
    ModelFileError,
    encode_model,
    file_document,
    is_model_file,
    read_model_file,
)
from dpprobe.model.linear import linear_arrays, linear_document
from dpprobe.model.model import Model, Privacy, load_model
from dpprobe.model.network import network_arrays, network_document

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Model",
    "ModelFileError",
    "Privacy",
    "encode_model",
    "file_document",
    "is_model_file",
    "linear_arrays",
    "linear_document",
    "load_model",
    "network_arrays",
    "network_document",
    "read_model_file",
]
