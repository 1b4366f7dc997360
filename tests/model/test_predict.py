"""`dpprobe predict` and `dpmodel.load_model`: predictions on the test split a job scored
reproduce its reported accuracy exactly (probe, tune, finetune CNN; the ViT's in
`tests/pipelines/test_finetune_job.py`); the model file format refuses damaged, cut and newer
files; bad input gets one line and nothing written."""

import csv
import json

import numpy as np
import pytest

from dpprobe import model as dpmodel
from dpprobe import probe
from dpprobe.pipelines import cli
from tests.pipelines.test_finetune_job import _finetune, _images, _write

# ----------------------------------------------------------------------------------------------
# Agreement: the saved model predicts, row by row, what its job scored.


def _predict(model, *data, out, extra=()):
    assert cli.main(["predict", "--model", str(model), "--data", *map(str, data), "--out",
                     str(out), "--quiet", *extra]) == 0
    with open(out, newline="") as f:
        return list(csv.DictReader(f))


def _accuracy(rows):
    return sum(r["prediction"] == r["label"] for r in rows) / len(rows)


def test_stacked_evaluation_equals_each_run_alone_bitwise(rng):
    """A run's logits do not depend on the runs stacked with it, nor on how rows are chunked:
    the released model (one run) computes its job's logits bit for bit."""
    x = rng.normal(size=(2500, 300)).astype(np.float16)
    params = {"w": rng.normal(size=(7, 300, 10)).astype(np.float32) * 0.05,
              "b": rng.normal(size=(7, 10)).astype(np.float32)}
    stacked = np.concatenate([np.asarray(probe.block_logits(params, b, normalization="group",
                                                            groups=3))
                              for b, _, _ in probe.fixed_blocks([(x, np.zeros(2500))])])
    chunks = [(x[i:i + 333], np.zeros(len(x[i:i + 333]))) for i in range(0, 2500, 333)]
    for run in (0, 4):
        alone = {"w": params["w"][run:run + 1], "b": params["b"][run:run + 1]}
        single = np.concatenate([np.asarray(probe.block_logits(alone, b, normalization="group",
                                                               groups=3))
                                 for b, _, _ in probe.fixed_blocks(chunks)])
        np.testing.assert_array_equal(single[:2500, 0], stacked[:2500, run])


@pytest.mark.slow
def test_probe_models_reproduce_the_reported_test_accuracy(digits_store, tmp_path):
    assert cli.main(["probe", digits_store, "--epsilons", "0.5,4,inf", "--seeds", "3",
                     "--optimizer", "momentum", "--steps", "10", "--lr", "1", "--normalize",
                     "group", "--groups", "27", "--save-model", str(tmp_path / "models"),
                     "--out", str(tmp_path / "r.json"), "--quiet"]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    # One model per private epsilon, the first seed's; the non-private reference is not saved.
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        "eps0.5.safetensors", "eps4.safetensors"]
    for epsilon in (0.5, 4.0):
        run = next(r for r in results["runs"] if r["epsilon"] == epsilon and r["replicate"] == 0)
        path = tmp_path / "models" / f"eps{epsilon:g}.safetensors"
        rows = _predict(path, digits_store, out=tmp_path / "p.csv")
        assert len(rows) == results["num_test"]
        assert _accuracy(rows) == run["test_accuracy"]  # exactly: the same argmax on every row
        model = dpmodel.load_model(path)
        assert model.privacy.epsilon == run["epsilon_spent"]
        assert model.document["privacy"]["sweep_epsilon"] == results["ledger"][
            "epsilon_by_role"]["private"]  # the private runs together (the reference has none)


def test_probe_defaults_save_one_model_per_epsilon_named_by_epsilon(digits_store, tmp_path):
    """With no recipe flag the learning rate differs per epsilon (the linear scaling rule):
    the files are still named by epsilon alone, as the preflight checked them."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "eps8.safetensors").write_text("not ours")  # refused before training
    args = ["probe", digits_store, "--epsilons", "1,8", "--seeds", "1", "--steps", "3",
            "--save-model", str(models), "--quiet"]
    assert cli.main(args) == 2
    (models / "eps8.safetensors").unlink()
    assert cli.main(args) == 0
    assert sorted(p.name for p in models.iterdir()) == ["eps1.safetensors", "eps8.safetensors"]


@pytest.mark.slow
def test_tune_model_reproduces_its_test_accuracy_and_holds_its_transforms(digits_store,
                                                                          tmp_path):
    """The saved probe carries GroupNorm and the folded private standardization: applied to the
    store's features it scores what the job reported (before, (w, b) alone scored ~10%)."""
    from dpprobe import extract

    model = tmp_path / "tuned.safetensors"
    assert cli.main(["tune", digits_store, "--epsilon", "2", "--trials", "2", "--steps-choices",
                     "5", "--r-max", "50", "--model", str(model), "--out",
                     str(tmp_path / "t.json"), "--quiet"]) == 0
    reported = json.loads((tmp_path / "t.json").read_text())["final"]["test_accuracy"]
    rows = _predict(model, digits_store, out=tmp_path / "p.csv", extra=["--top-k", "3"])
    assert _accuracy(rows) == reported
    assert list(rows[0]) == ["id", "prediction", "probability", "label", "top2",
                             "top2_probability", "top3", "top3_probability"]
    loaded = dpmodel.load_model(model)
    x, y, _ = extract.load_split(digits_store, "test", dtype=None)
    names = np.asarray(loaded.class_names)
    assert np.mean(loaded.predict(x) == names[y]) == reported
    np.testing.assert_allclose(loaded.predict_proba(x).sum(axis=1), 1.0, rtol=1e-6)
    # Without the transforms, (w, b) on the raw features is the old file's 10%-class model.
    raw = x.astype(np.float32) @ loaded.arrays["head/w"] + loaded.arrays["head/b"]
    assert np.mean(np.argmax(raw, 1) == y) < reported - 0.2


@pytest.mark.slow
def test_finetuned_cnn_model_reproduces_its_test_accuracy(rng, tmp_path, monkeypatch):
    _write(tmp_path, _images(rng, 120), _images(rng, 300))
    monkeypatch.chdir(tmp_path)
    assert _finetune("--model", "cnn", "--batch-size", "40", "--steps", "6", "--lr", "2",
                     "--physical-batch-size", "32", "--epsilon", "8", "--out", "run",
                     "--quiet") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    rows = _predict("run/model.safetensors", "npz:test.npz", out=tmp_path / "p.csv")
    assert len(rows) == 300 and _accuracy(rows) == results["test_accuracy_ema"]
    assert dpmodel.load_model("run/model.safetensors").document["parameters"][
        "released"] == "EMA"


# The finetuned ViT's model file reproduces its accuracy: checked on the ViT job of
# tests/pipelines/test_finetune_job.py::test_a_timm_vit_finetunes_from_a_local_weights_file
# (one ViT finetune in the suite instead of two).


# ----------------------------------------------------------------------------------------------
# Images into a probe on features: the recorded timm backbone runs, its weights checked.


@pytest.mark.slow
def test_images_run_through_the_recorded_backbone(timm_probe, tmp_path, capsys):
    model = timm_probe / "m" / "eps8.safetensors"
    on_store = _predict(model, timm_probe / "s.zarr", out=tmp_path / "a.csv")
    on_images = _predict(model, f"npz:{timm_probe / 'test.npz'}", out=tmp_path / "b.csv")
    same = np.mean([a["prediction"] == b["prediction"] for a, b in zip(on_store, on_images,
                                                                     strict=True)])
    assert same >= 0.95  # the store's features came from other batches (float rounding)
    # The recorded weights file moved away: refused in one line, unless a copy is given.
    (timm_probe / "vit.pth").rename(timm_probe / "moved.pth")
    try:
        capsys.readouterr()
        assert cli.main(["predict", "--model", str(model), "--data",
                         f"npz:{timm_probe / 'test.npz'}", "--quiet"]) == 2
        assert "is not on this machine; pass --weights" in capsys.readouterr().err
        _predict(model, f"npz:{timm_probe / 'test.npz'}", out=tmp_path / "c.csv",
                 extra=["--weights", str(timm_probe / "moved.pth")])
        other = timm_probe / "other.pth"
        other.write_bytes((timm_probe / "moved.pth").read_bytes()[:-8] + b"\0" * 8)
        assert cli.main(["predict", "--model", str(model), "--data",
                         f"npz:{timm_probe / 'test.npz'}", "--weights", str(other),
                         "--quiet"]) == 2
        assert "refusing other weights" in capsys.readouterr().err
    finally:
        (timm_probe / "moved.pth").rename(timm_probe / "vit.pth")


# ----------------------------------------------------------------------------------------------
# The file format and bad input: one line, exit 2, nothing written.


@pytest.fixture(scope="module")
def digits_model(digits_store, tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits_model")
    assert cli.main(["probe", digits_store, "--epsilons", "8", "--seeds", "1", "--normalize",
                     "group", "--groups", "27", "--save-model", str(folder), "--quiet"]) == 0
    return folder / "eps8.safetensors"


def _refused(capsys, argv, match, out=None):
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    if out is not None:
        assert not out.exists()


def test_damaged_truncated_and_newer_model_files_are_refused(digits_model, digits_store,
                                                             tmp_path, capsys):
    import struct

    data = digits_model.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    out = tmp_path / "p.csv"
    _refused(capsys, ["predict", "--model", str(cut), "--data", digits_store, "--out", str(out)],
             f"{cut} is cut short or damaged", out)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01" * 50)
    _refused(capsys, ["predict", "--model", str(junk), "--data", digits_store],
             f"{junk} is not a dpprobe model file")
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    document = json.loads(header["__metadata__"]["dpprobe_model"])
    document["format_version"] = 99
    header["__metadata__"]["dpprobe_model"] = json.dumps(document)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    newer = tmp_path / "newer.safetensors"
    newer.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    _refused(capsys, ["export", "--model", str(newer), "--format", "torch",
                      str(tmp_path / "x.pt2")], "newer than this dpprobe reads")
    with pytest.raises(dpmodel.ModelFileError, match="model format version 99"):
        dpmodel.load_model(newer)
    flipped = bytearray(data)
    flipped[-40:-36] = b"\xff\xff\xff\x7f"  # a NaN inside the head
    bad = tmp_path / "nan.safetensors"
    bad.write_bytes(bytes(flipped))
    _refused(capsys, ["predict", "--model", str(bad), "--data", digits_store],
             "holds NaN or Inf; the file is damaged")


def test_bad_inputs_are_refused_before_anything_is_written(digits_model, digits_store,
                                                          tmp_path, capsys, rng):
    out = tmp_path / "p.csv"
    model = str(digits_model)
    np.savez(tmp_path / "wide.npz", features=rng.normal(size=(5, 325)).astype(np.float32),
             labels=np.zeros(5, int), class_names=np.arange(10).astype(str))
    _refused(capsys, ["predict", "--model", model, "--data", f"npz:{tmp_path / 'wide.npz'}",
                      "--out", str(out)], "features of shape (5, 325)", out)
    np.savez(tmp_path / "three.npz", images=np.zeros((4, 8, 8), np.uint8),
             labels=np.zeros(4, int), class_names=np.array(["x", "y", "z"]))
    _refused(capsys, ["predict", "--model", model, "--data", f"npz:{tmp_path / 'three.npz'}",
                      "--out", str(out)], "declares 3 classes", out)
    _refused(capsys, ["predict", "--model", model, "--data", digits_store, "--out", model],
             f"would overwrite {model}")
    _refused(capsys, ["predict", "--model", model, "--data", digits_store, "--out",
                      f"{digits_store}/preds.csv"], "would overwrite")
    # A store of another backbone's features.
    np.savez(tmp_path / "emb.npz", features=rng.normal(size=(20, 324)).astype(np.float32),
             labels=np.arange(20) % 10, class_names=np.arange(10).astype(str))
    assert cli.main(["extract", "--backbone", "none", "--data", f"npz:{tmp_path / 'emb.npz'}",
                     "--split", "test", "--out", str(tmp_path / "emb.zarr"), "--quiet"]) == 0
    _refused(capsys, ["predict", "--model", model, "--data", str(tmp_path / "emb.zarr"), "--out",
                      str(out)], "was extracted with another backbone", out)
    # Images of the wrong channel count for a network (RGB to a grayscale CNN).
    from flax import nnx

    import dpprobe.finetune.models as fm
    from tests.model_helpers import network_file

    net = network_file(tmp_path / "cnn.safetensors",
                       fm.create_model("cnn", 4, image_size=16, in_channels=1, rngs=nnx.Rngs(0)),
                       name="cnn", side=16, channels=1)
    np.savez(tmp_path / "rgb.npz", images=np.zeros((3, 16, 16, 3), np.uint8),
             labels=np.zeros(3, int), class_names=np.array(["a", "b", "c", "d"]))
    _refused(capsys, ["predict", "--model", net, "--data", f"npz:{tmp_path / 'rgb.npz'}",
                      "--out", str(out)], "images with 3 channel(s)", out)
    _refused(capsys, ["predict", "--model", net, "--data", digits_store, "--out", str(out)],
             "it takes images, not the features", out)
