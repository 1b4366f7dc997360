"""`finetune.images.resize_and_crop`, the public per-image rule a finetune job and a released
model apply: its output shape and cost are set by the requested size, not by an image's shape."""

import numpy as np
import pytest
from PIL import Image

from dpprobe.finetune.images import MAX_ELONGATION, resize_and_crop


@pytest.mark.parametrize(("size", "resize", "crop"), [((40, 30), 16, None), ((30, 40), None, 16),
                                                      ((50, 20), 24, 16), ((9, 5), None, 12)])
def test_short_side_resized_then_center_square(size, resize, crop, rng):
    image = Image.fromarray(rng.integers(0, 256, size=size[::-1], dtype=np.uint8))
    side = crop or resize
    assert resize_and_crop(image, resize, crop).size == (side, side)


def test_center_crop_of_an_ordinary_image_is_the_resized_image_cropped(rng):
    """Below MAX_ELONGATION: exactly resize, then crop the center (no other resampling)."""
    image = Image.fromarray(rng.integers(0, 256, size=(30, 70, 3), dtype=np.uint8))
    resized = np.asarray(image.resize((37, 16), Image.BICUBIC))
    np.testing.assert_array_equal(np.asarray(resize_and_crop(image, 16, None)),
                                  resized[:, 10:26])


@pytest.mark.parametrize("size", [(400_000, 1), (1, 400_000), (3, 2_000_000)])
def test_an_extremely_elongated_image_costs_what_its_output_costs(size, monkeypatch):
    """One record's shape must not decide the job's time or memory: a 400,000 x 1 image resized
    to 32 would be built at 12.8M x 32 pixels before the crop; the window alone is resampled."""
    built = []
    resize = Image.Image.resize
    monkeypatch.setattr(Image.Image, "resize",
                        lambda self, out_size, *a, **k: built.append(out_size) or
                        resize(self, out_size, *a, **k))
    image = Image.new("L", size, color=200)
    assert max(size) / min(size) > MAX_ELONGATION
    out = resize_and_crop(image, 32, None)
    assert out.size == (32, 32)
    assert built and all(w * h <= MAX_ELONGATION * 32 * 32 for w, h in built), built
    np.testing.assert_array_equal(np.asarray(out), 200)  # a constant image stays constant
