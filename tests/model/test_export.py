"""`dpprobe export` and `Model.to_torch`: every model family's PyTorch module and ONNX model
(onnxruntime) match dpprobe's own logits within 1e-4; the ViT's timm state dict is the exact
inverse of the timm-to-NNX map (both ways) and loads with `load_state_dict(strict=True)`."""

import numpy as np
import pytest
import torch
from flax import nnx

import dpprobe.finetune.models as fm
from dpprobe import model as dpmodel
from dpprobe.pipelines import cli
from tests.model_helpers import CLASSES, nchw01, network_file, perturb_nnx, uint8_images

TOLERANCE = 1e-4


def _compare(model_path, images, tmp_path, formats=("torch", "onnx")) -> tuple[dict, np.ndarray]:
    """(max |logit difference| between dpprobe's logits on `images` and each export's,
    dpprobe's logits): a caller checks more against those logits without computing them
    again (a network's `logits` pads to 256 rows: resnet18's took 12 s here)."""
    import onnxruntime

    model = dpmodel.load_model(model_path)
    ours = model.logits(images)
    assert np.abs(ours).max() > 0.1  # not a comparison of near-zeros
    x = nchw01(images)
    diffs = {}
    with torch.no_grad():
        diffs["to_torch"] = np.abs(model.to_torch()(torch.from_numpy(x)).numpy() - ours).max()
    for fmt in formats:
        out = tmp_path / f"m.{fmt}"
        assert cli.main(["export", "--model", str(model_path), "--format", fmt, str(out),
                         "--quiet"]) == 0
        if fmt == "torch":
            module = torch.export.load(str(out)).module()
            with torch.no_grad():
                theirs = module(torch.from_numpy(x)).numpy()
        else:
            session = onnxruntime.InferenceSession(str(out))
            theirs = session.run(None, {session.get_inputs()[0].name: x})[0]
        diffs[fmt] = np.abs(theirs - ours).max()
    print(f"{model_path}: max |logit difference| vs dpprobe "
          + ", ".join(f"{fmt} {diff:.2e}" for fmt, diff in diffs.items()))  # pytest -s shows it
    for fmt, diff in diffs.items():
        assert diff <= TOLERANCE, (fmt, diffs)
    return diffs, ours


@pytest.mark.slow
@pytest.mark.parametrize("family,side,channels,formats", [
    ("cnn", 28, 1, ("torch", "onnx")), ("wrn16_4", 8, 3, ("torch", "onnx")),
    ("scatternet_cnn", 16, 2, ("torch", "onnx")),
    # Its `torch` file is the ScatterNet front's torch.export program (kymatio's module: ~20 s
    # to export, save and load), which scatternet_cnn's checks; its own linear head is checked
    # through `to_torch` (the module that file exports) and through ONNX.
    ("scatternet_cnn_linear", 12, 1, ("onnx",))], ids=lambda v: "-".join(map(str, v))
    if isinstance(v, tuple) else str(v))
def test_from_scratch_networks_export_to_torch_and_onnx(family, side, channels, formats,
                                                        tmp_path):
    model = fm.create_model(family, len(CLASSES), image_size=side, in_channels=channels,
                            rngs=nnx.Rngs(0))
    perturb_nnx(model, 0.1)
    path = network_file(tmp_path / "net.safetensors", model, name=family, side=side,
                        channels=channels)
    _compare(path, uint8_images(5, side, channels), tmp_path, formats=formats)


def _tiny_timm_vit(seed=0):
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4,
                              img_size=32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape))
    return model.eval()


def test_vit_timm_weight_map_round_trips_both_ways():
    from dpprobe.finetune.models.timm_weights import copy_to_timm

    source = _tiny_timm_vit(0)
    ours = fm.vit_from_timm(source, None, rngs=nnx.Rngs(0))
    # NNX -> timm: a fresh timm model of the same architecture gets the source's tensors exactly.
    target = _tiny_timm_vit(1)
    copy_to_timm(ours, target)
    reference = source.state_dict()
    assert set(target.state_dict()) == set(reference)
    for name, value in target.state_dict().items():
        assert torch.equal(value, reference[name]), name
    # timm -> NNX of the round trip: the same parameters, bit for bit.
    again = fm.vit_from_timm(target, None, rngs=nnx.Rngs(0))
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ours, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(again, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))


@pytest.mark.slow
def test_finetuned_vit_exports_a_timm_state_dict_torch_and_onnx(tmp_path):
    """timm's ViT-tiny with trained-looking LoRA adapters (random A and B, rank 4; every
    parameter perturbed, B and the head included), merged into a plain ViT: the model file
    equals the adapter model, and its `to_torch` (timm's own ViT, as `--format timm` fills
    it), torch.export, ONNX and `--format timm` exports equal the model file within 1e-4.
    One ViT exported in the suite (the exports are the slow part): a plain fine-tuned ViT's
    file is this one's kind, with its adapters merged at zero."""
    import safetensors.torch
    import timm

    from dpprobe import finetune

    model = finetune.add_lora(fm.vit_from_timm(_tiny_timm_vit(0), None, rngs=nnx.Rngs(0)), 4,
                              rngs=nnx.Rngs(1))
    perturb_nnx(model, 0.02)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    images = uint8_images(3, 32, 3)
    adapters = np.concatenate(list(finetune.iter_logits(model, images, mean=mean, std=std)))
    path = network_file(tmp_path / "vit.safetensors", finetune.merge_lora(model),
                        name="vit_tiny_patch16_224", side=32, channels=3, mean=mean, std=std,
                        rgb=True, timm_architecture="vit_tiny_patch16_224")
    diffs, ours = _compare(path, images, tmp_path)
    assert np.abs(ours - adapters).max() <= TOLERANCE  # the model file's logits
    # --format timm: timm.create_model(name, num_classes=K, img_size=S) + strict load.
    out = tmp_path / "vit_timm.safetensors"
    assert cli.main(["export", "--model", path, "--format", "timm", str(out), "--quiet"]) == 0
    loaded = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4,
                               img_size=32)
    loaded.load_state_dict(safetensors.torch.load_file(out), strict=True)
    x = (torch.from_numpy(nchw01(images)) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std).view(1, 3, 1, 1)
    with torch.no_grad():
        theirs = loaded.eval()(x).numpy()
    assert np.abs(theirs - ours).max() <= TOLERANCE, diffs


@pytest.mark.slow
def test_scatternet_probe_exports_to_torch_and_onnx(digits_store, tmp_path):
    """A probe on ScatterNet features (GroupNorm 27) as one module: the ONNX file computes
    the scattering a scale at a time with matrix DFTs (`extract.scattering`)."""
    from dpprobe.extract import open_source

    assert cli.main(["probe", digits_store, "--epsilons", "8", "--seeds", "1", "--steps", "20",
                     "--optimizer", "momentum", "--lr", "1", "--normalize", "group",
                     "--groups", "27", "--save-model", str(tmp_path / "models"),
                     "--quiet"]) == 0
    images = open_source("digits")["test"].array[:6]
    # --format torch is the same module (`to_torch`, compared here) through torch.export, as
    # for the other families; ONNX is ScatterNet's own case (its batched matrix DFTs).
    _compare(tmp_path / "models" / "eps8.safetensors", images, tmp_path, formats=("onnx",))


@pytest.mark.slow
def test_timm_backbone_probe_exports_to_torch_and_onnx(timm_probe, tmp_path):
    """A probe on a timm backbone's features as one module: the backbone (its weights from the
    recorded, sha256-checked file), timm's mean/std, the normalization and the head."""
    images = np.load(timm_probe / "test.npz")["images"][:4]
    _compare(timm_probe / "m" / "eps8.safetensors", images, tmp_path)


def test_timm_format_is_refused_for_a_probe(digits_store, tmp_path, capsys):
    assert cli.main(["probe", digits_store, "--epsilons", "8", "--seeds", "1",
                     "--save-model", str(tmp_path), "--quiet"]) == 0
    capsys.readouterr()
    out = tmp_path / "x.safetensors"
    assert cli.main(["export", "--model", str(tmp_path / "eps8.safetensors"), "--format",
                     "timm", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert ("exports a fine-tuned timm ViT, BEiT, ResNet, EfficientNet, ConvNeXt or BiT "
            "ResNetV2; this is a "
            "linear probe") in err
    assert len(err.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("name", ["resnet18", "tf_efficientnet_lite0", "convnext_atto"])
def test_finetuned_timm_cnn_round_trips_through_the_model_file_and_timm(name, tmp_path):
    """A ResNet / EfficientNet (BatchNorm frozen at random statistics, every parameter
    perturbed) or ConvNeXt: the model file holds its statistics too (`stats/`) and rebuilds it;
    `--format torch` matches dpprobe's logits within 1e-4; `--format timm` loads strictly
    into `timm.create_model(name, num_classes=K)` and gives the same logits."""
    import safetensors.torch
    import timm

    from tests.family_contract import randomize_batchnorm

    torch.manual_seed(0)
    source = timm.create_model(name, pretrained=False, num_classes=len(CLASSES)).eval()
    randomize_batchnorm(source, 3)
    model = fm.model_from_timm(source, len(CLASSES), rngs=nnx.Rngs(0))
    perturb_nnx(model, 0.01)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    path = network_file(tmp_path / "m.safetensors", model, name=name, side=32, channels=3,
                        mean=mean, std=std, rgb=True, timm_architecture=name)
    stats = any(k.startswith("stats/") for k in safetensors.torch.load_file(path))
    assert stats == (name != "convnext_atto")  # ConvNeXt has LayerNorm only, no statistics
    images = uint8_images(3, 32, 3)
    diffs, ours = _compare(path, images, tmp_path, formats=("torch",))
    assert max(diffs.values()) <= TOLERANCE, diffs
    out = tmp_path / "timm.safetensors"
    assert cli.main(["export", "--model", path, "--format", "timm", str(out), "--quiet"]) == 0
    loaded = timm.create_model(name, pretrained=False, num_classes=len(CLASSES))
    loaded.load_state_dict(safetensors.torch.load_file(out), strict=True)
    x = (torch.from_numpy(nchw01(images)) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std).view(1, 3, 1, 1)
    with torch.no_grad():
        theirs = loaded.eval()(x).numpy()
    assert np.abs(theirs - ours).max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "tf_efficientnet_lite0", "resnetv2_50x1_bit"])
def test_finetuned_timm_cnn_exports_to_onnx(name, tmp_path):
    """`--format onnx` of a fine-tuned ResNet / EfficientNet-Lite (BatchNorm frozen at random
    statistics, every parameter perturbed) or BiT ResNetV2 (its weight standardization in the
    graph; its "fixed" stem's zero pad kept out of onnxruntime's fusion into the max pool)
    runs in onnxruntime and gives dpprobe's logits within 1e-4: the frozen statistics are
    constants of the exported graph."""
    import timm

    from tests.family_contract import randomize_batchnorm

    torch.manual_seed(1)
    source = timm.create_model(name, pretrained=False, num_classes=len(CLASSES)).eval()
    randomize_batchnorm(source, 4)
    model = fm.model_from_timm(source, len(CLASSES), rngs=nnx.Rngs(0))
    perturb_nnx(model, 0.01)
    path = network_file(tmp_path / "m.safetensors", model, name=name, side=32, channels=3,
                        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), rgb=True,
                        timm_architecture=name)
    _compare(path, uint8_images(3, 32, 3), tmp_path, formats=("onnx",))
