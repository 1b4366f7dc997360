"""`dpprobe finetune` end to end: results, the neighbour test, SIGKILL and resume, timm
weights (a ViT, a ResNet), unconverted families refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dpprobe.pipelines import cli
from tests.test_privacy import _differing_leaves

CLASSES = np.array(["a", "b", "c", "d"])


def _images(rng, n, side=16, channels=1):
    shape = (n, side, side) if channels == 1 else (n, side, side, channels)
    labels = rng.integers(0, 4, n)
    images = rng.integers(0, 60, shape).astype(np.uint8)
    images[labels == 1, : side // 2] += 150  # something to learn
    return images, labels


def _write(directory, train, test):
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "train.npz", images=train[0], labels=train[1], class_names=CLASSES)
    np.savez(directory / "test.npz", images=test[0], labels=test[1], class_names=CLASSES)


FAST = ["--model", "cnn", "--batch-size", "40", "--steps", "4", "--augmult", "2",
        "--physical-batch-size", "32", "--lr", "0.5", "--quiet"]


# One DP step of timm's test_vit (a VisionTransformer of 6 blocks of width 64: the weights file
# takes the path of every timm ViT, at half vit_tiny's XLA compile time) at 32 px on 24 images
# (40 test images). A tiny learning rate and no EMA: the released parameters are the step's,
# within 1e-3 of the initial ones.
VIT = "test_vit"
VIT_STEP = ["--model", VIT, "--steps", "1", "--batch-size", "8",
            "--physical-batch-size", "8", "--augmult", "1", "--lr", "1e-5", "--ema-decay", "0"]


def _finetune(*options):
    return cli.main(["finetune", "--data", "npz:train.npz", "--test-data", "npz:test.npz",
                     *options])


def test_finetune_writes_dp_results_and_the_model(rng, tmp_path, monkeypatch):
    _write(tmp_path, _images(rng, 120), _images(rng, 40))
    monkeypatch.chdir(tmp_path)
    assert _finetune(*FAST, "--epsilon", "2", "--delta", "1e-4", "--out", "run") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    privacy = results["privacy"]
    assert privacy["epsilon"] <= 2.0 and privacy["neighboring_relation"] == "zero_out"
    assert privacy["plan"]["sampling_probability"] == pytest.approx(40 / 120)
    assert privacy["plan"]["steps"] == 4 and privacy["noise_keys"] == "os-entropy"
    assert 0 <= results["test_accuracy"] <= 1 and 0 <= results["test_accuracy_ema"] <= 1
    assert results["ledger"]["epsilon"] == pytest.approx(privacy["epsilon"])
    from dpprobe import model as dpmodel

    model = dpmodel.load_model(tmp_path / "run" / "model.safetensors")
    assert model.document["parameters"]["released"] == "EMA"
    assert results["model"]["released_parameters"] == "EMA"
    assert results["model"]["audit_artefact"] is False  # no canaries: the production model
    assert model.document["backbone"]["model"]["audit_artefact"] is False
    assert model.document["training"]["reported"]["test_accuracy"] == results["test_accuracy_ema"]
    assert model.privacy.epsilon == privacy["epsilon"] and model.class_names == list(CLASSES)
    assert not (tmp_path / "run" / "checkpoint").exists()  # it held the noise key
    timings = json.loads((tmp_path / "run" / "results.timings.json").read_text())  # the owner's
    assert timings["compile_seconds"] > 0 and timings["images_per_second"] > 0
    assert privacy["private"] is True and "claim" not in privacy
    assert results["trained"]["mode"] == "all"
    assert results["trained"]["parameters"] == results["trained"]["of"]
    assert results["recipe"]["ema_decay"] == 0.999  # the recipe's, De et al.'s
    assert results["recipe"]["batches_per_call"] == 1  # the number used, on a CPU
    # FAST asks for 2 views without crops or flips: the same image twice, said once.
    assert [w for w in results["warnings"] if "augmult" in w] == [
        "augmult 2 without crop padding or flips: the 2 views of an example are the same "
        "image, so the run costs 2x for the same model"]


def test_microbatches_are_refused_for_they_change_nothing(capsys):
    """Book-keeping clipping forms no per-example kernel gradients, so a microbatch size would
    be recorded without effect: refused in the API, not an option of the CLI."""
    from dpprobe.checks import ConfigError
    from dpprobe.pipelines import FinetuneConfig

    with pytest.raises(ConfigError, match="physical_batch_size"):
        FinetuneConfig(data="digits", microbatch_size=4)
    assert cli.main(["finetune", "--data", "digits", "--microbatch-size", "4"]) == 2
    assert "--microbatch-size" in capsys.readouterr().err


# Leaves that may differ between D and D minus one row: DP outputs and what follows from the
# dataset size N alone (public under zero-out neighbours: q = B/N, its sigma, epsilon). No
# time: the run's depend on the records (the owner's timing file has them).
ALLOWED = [
    r"test_accuracy(_ema)?",
    r"data\.num_train",
    r"privacy\.(epsilon|sampling|plan\.(sampling_probability|noise_multiplier))",
    r"privacy\.dp_event\..*",
    r"ledger\.(.*\.)?(\w*epsilon\w*|sampling_probability|noise_multiplier|mu|event.*)",
    r"ledger\.epsilon_by_role\.\w+",
]


MODEL_ALLOWED = [r"training\.reported\.test_accuracy", r"training\.data\.num_train",
                 *[a.replace("ledger", r"privacy\.ledger") for a in ALLOWED if "ledger" in a],
                 r"privacy\.(epsilon|plan\.(sampling_probability|noise_multiplier))"]


def test_finetune_on_neighbouring_datasets_differs_only_in_dp_outputs(rng, tmp_path,
                                                                     monkeypatch):
    from dpprobe.model import read_model_file

    (images, labels), test = _images(rng, 120), _images(rng, 40)
    images[17] = 255
    labels[17] = 3
    outputs, models = [], []
    for name, keep in (("D", slice(None)), ("D_minus_one_row", np.arange(120) != 17)):
        _write(tmp_path / name, (images[keep], labels[keep]), test)
        monkeypatch.chdir(tmp_path / name)
        assert _finetune(*FAST, "--epsilon", "2", "--out", "run") == 0
        outputs.append(json.loads((tmp_path / name / "run" / "results.json").read_text()))
        models.append(read_model_file(tmp_path / name / "run" / "model.safetensors")[1])
    leaked = non_dp_leaves(*outputs, ALLOWED)
    assert not leaked, f"non-DP leaves differ between D and D minus one row: {leaked}"
    # The model file's description: the same public inputs and DP outputs.
    leaked = non_dp_leaves(*models, MODEL_ALLOWED)
    assert not leaked, f"model file: non-DP leaves differ between D and D minus one row: {leaked}"
    assert "fingerprint" not in json.dumps(models[0])


def non_dp_leaves(a: dict, b: dict, allowed) -> list[str]:
    """The leaves where two job outputs differ that no pattern of `allowed` (the DP outputs and
    the public inputs a neighbour pair changes) accounts for."""
    return [p for p in sorted(set(_differing_leaves(a, b)))
            if not any(re.fullmatch(a, p) for a in allowed)]


def test_unconverted_timm_families_are_refused(rng, tmp_path, monkeypatch, capsys):
    """A timm family with no NNX converter (MobileNetV3), and a ResNet variant the converter
    does not reproduce (resnet10t's deep stem), are refused in one line before training."""
    _write(tmp_path, _images(rng, 40, 32, 3), _images(rng, 20, 32, 3))
    monkeypatch.chdir(tmp_path)
    assert _finetune("--model", "mobilenetv3_small_050", "--random-init", "--steps", "1") == 2
    err = capsys.readouterr().err  # the refusal lists every family converted
    assert "got MobileNetV3" in err and all(
        family in err for family in ("VisionTransformer", "Beit", "ResNet", "EfficientNet",
                                     "ConvNeXt"))
    assert _finetune("--model", "resnet10t", "--random-init", "--steps", "1") == 2
    assert "deep-stem ResNets" in capsys.readouterr().err


def test_a_resnet_finetunes_from_a_local_weights_file(rng, tmp_path, monkeypatch):
    """--model resnet18 --weights FILE: timm's state dict is loaded strictly and converted
    (BatchNorm frozen at the file's statistics), a DP step trains, and the released model file
    holds those statistics unchanged and loads back."""
    import timm
    import torch

    from tests.family_contract import randomize_batchnorm

    torch.manual_seed(0)
    source = timm.create_model("resnet18", pretrained=False)
    randomize_batchnorm(source, 0)
    torch.save(source.state_dict(), tmp_path / "resnet.pth")
    _write(tmp_path, _images(rng, 24, 32, 3), _images(rng, 12, 32, 3))
    monkeypatch.chdir(tmp_path)
    assert _finetune("--model", "resnet18", "--weights", "resnet.pth", "--steps", "1",
                     "--batch-size", "8", "--physical-batch-size", "8", "--augmult", "1",
                     "--lr", "1e-5", "--out", "run", "--quiet") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["model"]["weights_source"] == "file"
    from dpprobe.model import load_model, read_model_file

    saved, _ = read_model_file(tmp_path / "run" / "model.safetensors")
    np.testing.assert_array_equal(saved["stats/layer2/0/bn1/var"],
                                  source.layer2[0].bn1.running_var.numpy())
    np.testing.assert_allclose(saved["params/layer2/0/bn1/scale"],
                               source.layer2[0].bn1.weight.detach().numpy(), atol=1e-3)
    assert load_model(tmp_path / "run" / "model.safetensors").logits(
        _images(rng, 2, 32, 3)[0]).shape == (2, 4)


def test_a_convnext_finetunes_from_a_local_weights_file(rng, tmp_path, monkeypatch):
    """--model convnext_atto --weights FILE: timm's state dict loaded strictly, one DP step,
    and the released model file holds the file's layer scales (moved by at most the step)."""
    import timm
    import torch

    torch.manual_seed(0)
    source = timm.create_model("convnext_atto", pretrained=False)
    with torch.no_grad():  # layer scales far from timm's 1e-6 init, so the check can fail
        for name, p in source.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
    torch.save(source.state_dict(), tmp_path / "atto.pth")
    _write(tmp_path, _images(rng, 24, 32, 3), _images(rng, 12, 32, 3))
    monkeypatch.chdir(tmp_path)
    assert _finetune("--model", "convnext_atto", "--weights", "atto.pth", "--steps", "1",
                     "--batch-size", "8", "--physical-batch-size", "8", "--augmult", "1",
                     "--lr", "1e-5", "--out", "run", "--quiet") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["model"]["weights_source"] == "file"
    from dpprobe.model import read_model_file

    saved, _ = read_model_file(tmp_path / "run" / "model.safetensors")
    np.testing.assert_allclose(saved["params/stages/1/blocks/0/gamma"],
                               source.stages[1].blocks[0].gamma.detach().numpy(), atol=1e-3)


def test_a_timm_vit_finetunes_from_a_local_weights_file(rng, tmp_path, monkeypatch):
    """--weights: the timm checkpoint is loaded (by timm) and converted, head replaced by a
    zero head for the new classes; a ViT at 32 px trains a step. Its model file's predictions
    on the test split reproduce the job's reported accuracy (`dpprobe predict`; checked on
    this run rather than on a second ViT job of its own: one ViT finetune fewer in the suite)."""
    import timm
    import torch

    from dpprobe import model as dpmodel
    from tests.model.test_predict import _accuracy, _predict

    torch.manual_seed(0)
    source = timm.create_model(VIT, pretrained=False)  # at 160 px: pos_embed resampled
    torch.save(source.state_dict(), tmp_path / "vit.pth")
    _write(tmp_path, _images(rng, 24, 32, 3), _images(rng, 40, 32, 3))
    monkeypatch.chdir(tmp_path)
    assert _finetune(*VIT_STEP, "--weights", "vit.pth", "--out", "run", "--quiet") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["model"]["weights_source"] == "file"
    from dpprobe.model import read_model_file

    saved, _ = read_model_file(tmp_path / "run" / "model.safetensors")
    patch = [k for k in saved if k.startswith("params/") and "patch" in k and "kernel" in k]
    assert patch, sorted(saved)[:10]
    # One DP step at a tiny learning rate: the patch embedding is still the file's (HWIO).
    kernel = source.patch_embed.proj.weight.detach().numpy().transpose(2, 3, 1, 0)
    np.testing.assert_allclose(saved[patch[0]], kernel, atol=1e-3)
    rows = _predict("run/model.safetensors", "npz:test.npz", out=tmp_path / "p.csv")
    assert len(rows) == 40 and _accuracy(rows) == results["test_accuracy"]
    model = dpmodel.load_model("run/model.safetensors")
    assert model.document["parameters"]["released"] == "final iterate"
    assert model.document["architecture"]["timm_architecture"] == VIT
