"""A released model exported to ONNX (`dpprobe export --format onnx`).

The module `torch_export.to_torch` builds (a ScatterNet a scale at a time, its Fourier
transforms as products with the DFT's matrices) is exported by torch's TorchScript exporter:
on this project's 2-core CPU it exported an EfficientNet-Lite0 at 224 px in 1.9-2.8 s where
torch's dynamo exporter (torch.export, then onnxscript's decompositions) took 18.6-22.9 s, a
ScatterNet model in 1.7-2.5 s against 16.5-29.0 s, their logits within 2e-6 of each other
(`benchmarks/export.py`). torch 2.9 made the dynamo exporter its default
and marks the TorchScript one deprecated; where the TorchScript exporter is gone or refuses a
module, the dynamo exporter (its graph optimizer off: it took 170 s of a 230 s ScatterNet
export) writes the file instead. Both write opset 20 (`OPSET`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings

import torch

from dpprobe.model.torch_export import _export_note, _input_text, example_input, to_torch

__all__ = ["OPSET", "export_onnx"]

# The ONNX opset of an export: what torch 2.14's exporters write by default, either of them.
OPSET = 20


class _ConcatPad(torch.nn.Module):
    """A `ConstantPad2d` as concatenation: the same values, but onnxruntime's graph optimizer
    cannot fuse it into the next MaxPool (it fused a Pad of zeros into MaxPool's own padding,
    which is -inf: BiT's "fixed" stem then gave a resnetv2_50x1_bit's logits 0.12 off)."""

    def __init__(self, pad: torch.nn.ConstantPad2d):
        super().__init__()
        self.left, self.right, self.top, self.bottom = pad.padding
        self.value = float(pad.value)

    def forward(self, x):
        n, c, h, w = x.shape
        rows = [x.new_full((n, c, k, w), self.value) for k in (self.top, self.bottom)]
        x = torch.cat([rows[0], x, rows[1]], dim=2)
        cols = [x.new_full((n, c, x.shape[2], k), self.value) for k in (self.left, self.right)]
        return torch.cat([cols[0], x, cols[1]], dim=3)


def _unfused_pads(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with each `ConstantPad2d` replaced by `_ConcatPad` (for the ONNX export)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.ConstantPad2d:
                setattr(parent, name, _ConcatPad(child))
    return module


def export_onnx(model, *, exporter: str = "torchscript") -> tuple[bytes, str]:
    """(bytes of an ONNX model, its input): input "images" (or "features"), output "logits",
    a dynamic batch axis; the privacy claim and class names in its metadata. A ScatterNet is
    exported a scale at a time, its Fourier transforms as products with the DFT's matrices
    (`extract.scattering.batch_scatterings`; kymatio's loop of FFTs became ONNX DFT
    operators, which onnxruntime ran 15x slower, in an 8x larger file:
    `benchmarks/export.py`).

    Args:
      model: the loaded model file (`dpmodel.load_model`).
      exporter: "torchscript" (torch's TorchScript exporter, the dynamo one where it fails:
        the module docstring) or "dynamo" (the dynamo exporter only).

    Returns:
      (the ONNX file's bytes, a description of its input).
    """
    if exporter not in ("torchscript", "dynamo"):
        raise ValueError(f"exporter must be 'torchscript' or 'dynamo', got {exporter!r}")
    import onnx

    from dpprobe.extract.scattering import batch_scatterings

    module = _unfused_pads(batch_scatterings(to_torch(model), dft="matrix"))
    example = example_input(model)
    name = "features" if model.kind == "linear" and not model.takes_images else "images"
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = _write(module, example, name, folder, exporter)
        except OSError as err:  # a full temporary disk: named, with the way around it
            raise OSError(err.errno, f"{err.strerror} (the ONNX export's temporary file; set "
                          "TMPDIR to a folder with room)", folder) from err
        proto = onnx.load(path)
    entry = proto.metadata_props.add()
    entry.key, entry.value = "dpprobe_export", _export_note(model)
    return proto.SerializeToString(), _input_text(model)


def _write(module: torch.nn.Module, example: torch.Tensor, name: str, folder: str,
           exporter: str) -> str:
    """The ONNX file of `module` in `folder`, its path: the TorchScript exporter's, unless
    `exporter` is "dynamo" or it fails (the module docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation, tracer notes
        if exporter == "torchscript":
            path = os.path.join(folder, "torchscript.onnx")
            try:
                with _no_stdout():
                    torch.onnx.export(module, (example,), path, dynamo=False,
                                      input_names=[name], output_names=["logits"],
                                      dynamic_axes={name: {0: "batch"}}, opset_version=OPSET,
                                      verbose=False)
                return path
            except OSError:
                raise
            except Exception:  # noqa: BLE001 - gone from torch, or an operator it cannot write
                pass
        path = os.path.join(folder, "dynamo.onnx")
        torch.onnx.export(module, (example,), path, dynamo=True, external_data=False,
                          input_names=[name], output_names=["logits"], opset_version=OPSET,
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
                          optimize=False, verbose=False)
        return path


@contextlib.contextmanager
def _no_stdout():
    """The process's stdout (file descriptor 1) sent to the null device: where the TorchScript
    exporter fails, it writes the whole traced graph there from C++ (thousands of lines for
    kymatio's module; torch 2.14 leaves its ONNX log on), and the dynamo exporter then writes
    the file anyway."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to silence
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
