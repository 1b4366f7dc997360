"""The PyTorch counterparts of `finetune.models`, now released with the package
(`dpmodel.torch_models`, the targets of `dpprobe export`); the golden tests import them here."""

from dpprobe.model.torch_models import TorchCifarCNN, TorchTemperedCNN, TorchWRN, TorchWSConv

__all__ = ["TorchCifarCNN", "TorchTemperedCNN", "TorchWRN", "TorchWSConv"]
