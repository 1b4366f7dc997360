"""A model file's backbone record rebuilds the preprocessing its store was extracted with."""

import numpy as np
import torch
from PIL import Image

from dpprobe import extract
from dpprobe.model.backbone import load_backbone


def test_a_record_from_before_resize_kept_small_images_rebuilds_its_model_side_transform():
    """Stores written before `--resize R` alone (R below the model's side) kept R px images
    recorded resize R, no crop, and the model's side as input size: their images were resized
    back to that side. The rebuilt backbone must preprocess to that side, not to R."""
    same = extract.create_backbone("test_resnet", random_init=True, seed=3, resize=160,
                                   crop=160, device="cpu")
    old_prep = same.preprocessing | {"resize": 24, "crop": None}
    assert old_prep["input_size"] == [3, 160, 160] and old_prep["crop_pct"] == 1.0
    rebuilt = load_backbone({"backbone": same.provenance, "preprocessing": old_prep}, "m.json",
                            device="cpu")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 52, 3), np.uint8))
    torch.testing.assert_close(rebuilt.transform(image), same.transform(image), rtol=0, atol=0)
    assert rebuilt.transform(image).shape[-1] == 160
    # Today's record of resize 24 alone is the 24 px image, and rebuilds as such.
    today = extract.create_backbone("test_resnet", random_init=True, seed=3, resize=24,
                                    device="cpu")
    record = {"backbone": today.provenance, "preprocessing": today.preprocessing}
    assert load_backbone(record, "m.json", device="cpu").transform(image).shape[-1] == 24
