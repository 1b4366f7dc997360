"""Images to a model's input: each image's short side resized, a centered square cropped, the
channels made what the model takes, as uint8 NHWC. A function of each image alone (no privacy
cost); the finetune job prepares its data with it and a released model (`dpmodel`) the images
it is given, so both see the same pixels."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["as_channels", "images_to_array", "resize_and_crop"]


def resize_and_crop(image, resize: int | None, crop: int | None):
    """A PIL image with its short side resized to `resize` (bicubic), then center-cropped to
    `crop` x `crop` (default: a square of the short side)."""
    from PIL import Image

    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    width, height = image.size
    if resize:
        scale = resize / min(width, height)
        width, height = max(1, round(width * scale)), max(1, round(height * scale))
        image = image.resize((width, height), Image.BICUBIC)
    side = crop or min(width, height)
    if side > min(width, height):
        raise ValueError(f"`crop={side}` exceeds the image's short side {min(width, height)}")
    left, top = (width - side) // 2, (height - side) // 2
    return image.crop((left, top, left + side, top + side))


def images_to_array(images: Iterable, resize: int | None, crop: int | None,
                    rgb: bool) -> np.ndarray:
    """PIL images as uint8 (N, S, S, C), each through `resize_and_crop`; grayscale repeated to
    3 channels when `rgb`."""
    array = np.stack([np.asarray(resize_and_crop(image, resize, crop)) for image in images])
    return as_channels(array, rgb)


def as_channels(array: np.ndarray, rgb: bool) -> np.ndarray:
    """uint8 (N, H, W[, C]) as (N, H, W, C): a channel axis added, grayscale repeated to 3
    channels when `rgb`."""
    if array.ndim == 3:
        array = array[..., None]
    if rgb and array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return np.ascontiguousarray(array, dtype=np.uint8)
