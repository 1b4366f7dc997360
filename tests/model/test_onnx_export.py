"""`model.onnx_export`: torch's TorchScript exporter writes the ONNX file; where it fails, the
dynamo exporter writes one that onnxruntime runs to the same logits (within 1e-4 of dpprobe's,
at any batch size), with the same metadata."""

import numpy as np
import pytest
import torch
from flax import nnx

import dpprobe.finetune.models as fm
from dpprobe import model as dpmodel
from dpprobe.model.onnx_export import export_onnx
from tests.model_helpers import CLASSES, nchw01, network_file, perturb_nnx, uint8_images


def _logits(data: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(data)
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _metadata(data: bytes) -> dict:
    import onnx

    return {p.key: p.value for p in onnx.load_from_string(data).metadata_props}


def test_the_dynamo_exporter_takes_over_where_torchscript_fails(tmp_path, monkeypatch):
    network = fm.create_model("cnn", len(CLASSES), image_size=16, in_channels=3,
                              rngs=nnx.Rngs(0))
    perturb_nnx(network, 0.1)
    model = dpmodel.load_model(network_file(tmp_path / "cnn.safetensors", network, name="cnn",
                                            side=16, channels=3))
    images = uint8_images(5, 16, 3)
    ours, x = model.logits(images), nchw01(images)
    torchscript, _ = export_onnx(model)

    real, calls = torch.onnx.export, []

    def refusing(*args, dynamo=True, **kwargs):
        calls.append("dynamo" if dynamo else "torchscript")
        if not dynamo:
            raise RuntimeError("an operator the TorchScript exporter cannot write")
        return real(*args, dynamo=dynamo, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", refusing)
    dynamo, _ = export_onnx(model)
    assert calls == ["torchscript", "dynamo"]
    assert torchscript != dynamo  # two exporters' files, not one file twice
    for data in (torchscript, dynamo):
        for rows in (slice(0, 5), slice(0, 2)):  # the batch axis is dynamic
            assert np.abs(_logits(data, x[rows]) - ours[rows]).max() <= 1e-4
        assert set(_metadata(data)) == {"dpprobe_export"}
    assert _metadata(torchscript) == _metadata(dynamo)

    calls.clear()
    with pytest.raises(ValueError, match="exporter must be"):
        export_onnx(model, exporter="tflite")

    def stopping(*args, dynamo=True, **kwargs):
        calls.append("dynamo" if dynamo else "torchscript")
        raise RuntimeError("stopped")

    monkeypatch.setattr(torch.onnx, "export", stopping)
    with pytest.raises(RuntimeError, match="stopped"):  # the dynamo exporter alone
        export_onnx(model, exporter="dynamo")
    assert calls == ["dynamo"]


def test_a_module_torchscript_cannot_write_is_written_quietly_by_dynamo(tmp_path, capfd):
    # torch.fft has no TorchScript-exporter rule: that exporter fails and writes the traced
    # graph to the process's stdout from C++, which the export silences.
    from dpprobe.model.onnx_export import _write

    class Spectrum(torch.nn.Module):
        def forward(self, x):
            return torch.fft.fft2(x).abs()

    module, x = Spectrum().eval(), torch.rand(2, 4, 4)
    path = _write(module, x, "images", str(tmp_path), "torchscript")
    assert path.endswith("dynamo.onnx")
    assert "graph" not in capfd.readouterr().out
    with open(path, "rb") as file:
        theirs = _logits(file.read(), x.numpy())
    np.testing.assert_allclose(theirs, module(x).numpy(), atol=1e-5)
