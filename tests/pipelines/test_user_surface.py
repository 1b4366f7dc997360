"""A new user's folder of images, end to end (issue 49): each stumble, fixed.

Every test here failed on the code before the fix (checked against that code)."""

from __future__ import annotations

import csv

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
    assert err.startswith(f"predict: reading {model} and imgs/test\n"), err  # at once
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
