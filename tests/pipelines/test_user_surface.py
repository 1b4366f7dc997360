"""A new user's folder of images, end to end (issue 49): each stumble, fixed.

Every test here failed on the code before the fix (checked against that code)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PIL import Image

from dpprobe.pipelines import cli

CLASSES = ("ant", "bee", "cat")


def _image(rng, label: int, size=(20, 20), mode="RGB") -> Image.Image:
    pixels = rng.integers(0, 80, (size[1], size[0], 3), dtype=np.uint8)
    pixels[: size[1] // 2, :, label] += 170  # something to learn: the class's colour on top
    image = Image.fromarray(pixels)
    return image.convert(mode) if mode != "RGB" else image


@pytest.fixture
def mixed_folder(rng, tmp_path, monkeypatch):
    """imgs/{train,test}/CLASS/*.png, RGB 20x20 but for one grayscale image and one 80x50
    image in each split: a user's own folder."""
    monkeypatch.chdir(tmp_path)
    for split, count in (("train", 8), ("test", 3)):
        for label, name in enumerate(CLASSES):
            folder = tmp_path / "imgs" / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                _image(rng, label).save(folder / f"{i}.png")
        _image(rng, 0, mode="L").save(tmp_path / "imgs" / split / "ant" / "gray.png")
        _image(rng, 1, size=(80, 50)).save(tmp_path / "imgs" / split / "bee" / "wide.png")
    return tmp_path


def _extract(split: str, *extra: str) -> list[str]:
    return ["extract", "--backbone", "scatternet", "--data", f"imagefolder:imgs/{split}",
            "--split", split, "--out", "img.zarr", "--quiet", *extra]


def test_a_grayscale_image_among_rgb_goes_through_scatternet_extract_and_predict(
        mixed_folder, capsys):
    for split in ("train", "test"):
        assert cli.main(_extract(split, "--resize", "16", "--crop", "16")) == 0, \
            capsys.readouterr().err
    from dpprobe.extract import open_split

    # Every image as RGB: 3 channels x 81 coefficients x 4 x 4.
    assert open_split("img.zarr", "train")["features"].shape == (26, 3 * 81 * 16)
    assert cli.main(["probe", "img.zarr", "--epsilons", "8", "--delta", "1e-3", "--seeds", "1",
                     "--save-model", "models", "--quiet"]) == 0
    capsys.readouterr()
    model = next(iter((mixed_folder / "models").glob("*.safetensors")))
    assert cli.main(["predict", "--model", str(model), "--data", "imgs/test",
                     "--out", "p.csv"]) == 0
    err = capsys.readouterr().err
    # Said before torch and the backbone load (seconds), then the bar.
    assert err.startswith(f"predict: 11 input(s) of 11 image file(s) through {model}'s "
                          "backbone\n"), err
    rows = list(csv.DictReader((mixed_folder / "p.csv").open()))
    assert len(rows) == 11 and {r["prediction"] for r in rows} <= set(CLASSES)
    assert any(r["id"].endswith("gray.png") for r in rows)


def test_images_of_different_sizes_get_advice_about_sizes_not_channels(mixed_folder, capsys):
    assert cli.main(_extract("train")) == 2
    err = capsys.readouterr().err
    assert "pass --resize R --crop S" in err and "channel" not in err, err


def test_a_channel_mismatch_is_named_as_such():
    from dpprobe.extract.backbones import input_mismatch

    text = input_mismatch((3, 16, 16), (1, 16, 16), "image gray.png")
    assert "1 channel(s), the first image to 3" in text and "resize" not in text
    assert "`resize=R` `crop=S`" in input_mismatch((3, 16, 16), (3, 16, 20), "image wide.png")


def _wrote(err: str) -> set[str]:
    return {line.split(" ", 2)[1] for line in err.splitlines() if line.startswith("wrote ")}


def test_probe_names_every_file_it_wrote(digits_store, tmp_path, capsys):
    out = {name: str(tmp_path / name) for name in ("r.json", "r.csv", "r.png", "d.npz")}
    assert cli.main(["probe", digits_store, "--epsilons", "2,inf", "--seeds", "1", "--steps",
                     "20", "--out", out["r.json"], "--csv", out["r.csv"], "--plot",
                     out["r.png"], "--diagnostics", out["d.npz"], "--save-model",
                     str(tmp_path / "models")]) == 0
    models = {str(p) for p in (tmp_path / "models").iterdir()}
    timing = str(tmp_path / "r.timings.json")
    assert _wrote(capsys.readouterr().err) == set(out.values()) | models | {timing}
    assert set(map(str, tmp_path.iterdir())) == set(out.values()) | {timing,
                                                                      str(tmp_path / "models")}


def test_tune_names_its_model_file_and_results(digits_store, tmp_path, capsys):
    model, out = str(tmp_path / "tuned.safetensors"), str(tmp_path / "t.json")
    assert cli.main(["tune", digits_store, "--epsilon", "4", "--final-steps", "3",
                     "--save-model", model, "--out", out]) == 0
    assert _wrote(capsys.readouterr().err) == {model, out, str(tmp_path / "t.timings.json")}


def test_finetune_names_the_files_of_its_out_folder(rng, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, count in (("train", 60), ("test", 20)):
        images = rng.integers(0, 255, (count, 16, 16)).astype(np.uint8)
        np.savez(f"{name}.npz", images=images, labels=rng.integers(0, 3, count),
                 class_names=np.array(CLASSES))
    assert cli.main(["finetune", "--data", "npz:train.npz", "--test-data", "npz:test.npz",
                     "--model", "cnn", "--batch-size", "20", "--steps", "2",
                     "--physical-batch-size", "16", "--lr", "0.5", "--epsilon", "2",
                     "--delta", "1e-3", "--out", "run"]) == 0
    # (its lock file, empty, marks the folder as a run's while one runs: not an output)
    files = {f"run/{p.name}" for p in (tmp_path / "run").iterdir() if p.suffix != ".lock"}
    assert len(files) == 4
    assert _wrote(capsys.readouterr().err) == files


def test_verify_prints_a_readable_report_and_json(digits_store, capsys):
    assert cli.main(["verify", digits_store, "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "train: 1438 examples, complete; 1 chunk checked, none bad"
    assert lines[-1] == "OK" and not any("{" in line for line in lines)
    assert cli.main(["verify", digits_store, "--quiet", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["problems"] == []
    assert report["splits"]["test"]["num_examples"] == 359


def test_the_non_private_line_lies_inside_the_plot_with_its_label():
    from dpprobe.plots import accuracy_figure

    summary = [{"epsilon": e, "steps": 10, "learning_rate": 0.1, "test_accuracy_mean": a,
                "test_accuracy_std": 0.0} for e, a in ((1.0, 0.80), (8.0, 0.90))]
    summary.append({"epsilon": float("inf"), "steps": 10, "learning_rate": 0.1,
                    "test_accuracy_mean": 0.905, "test_accuracy_std": 0.0})
    axes = accuracy_figure(summary).axes[0]
    low, high = axes.get_ylim()
    assert low < 90.5 < high - 0.05 * (high - low)  # not on the frame's top edge
    assert any(text.get_text() == "non-private 90.50%" for text in axes.texts)


def test_a_failed_extract_leaves_nothing_that_blocks_the_corrected_rerun(mixed_folder, capsys):
    """The odd-sized image comes after two chunks' worth of rows: it is found from the headers
    before anything is written, so the rerun with --resize/--crop needs no --overwrite."""
    assert cli.main(_extract("train", "--rows-per-chunk", "4")) == 2
    err = capsys.readouterr().err
    assert "imgs/train/bee/wide.png (80x50 RGB) comes to 80x50" in err
    assert "--resize R --crop S" in err
    assert "nothing was written" in err
    assert not (mixed_folder / "img.zarr" / "train").exists()
    assert cli.main(_extract("train", "--rows-per-chunk", "4", "--resize", "16",
                             "--crop", "16")) == 0, capsys.readouterr().err
    # A truncated JPEG is refused from the reader's first pass, before anything is written;
    # the rerun with the file replaced extracts the split, again without --overwrite.
    jpeg = mixed_folder / "imgs" / "test" / "cat" / "0.jpg"
    _image(np.random.default_rng(1), 2).save(jpeg, quality=90)
    whole = jpeg.read_bytes()
    jpeg.write_bytes(whole[: len(whole) // 2])
    assert cli.main(_extract("test", "--resize", "16", "--crop", "16")) == 2
    assert "0.jpg is not a readable image" in capsys.readouterr().err
    jpeg.write_bytes(whole)
    assert cli.main(_extract("test", "--resize", "16", "--crop", "16")) == 0
