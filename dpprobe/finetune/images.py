"""Images to a model's input: each image's short side resized, a centered square cropped, the
channels made what the model takes, as uint8 NHWC. A function of each image alone (no privacy
cost); the finetune job prepares its data with it and a released model (`dpmodel`) the images
it is given, so both see the same pixels."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["as_channels", "images_to_array", "resize_and_crop"]


# Resized images whose long side would exceed this many output sides are resampled only in the
# window the crop keeps: a 200,000 x 1 image resized to 32 would otherwise be built at
# 6,400,000 x 32 first (seconds and hundreds of MB decided by one record's shape).
MAX_ELONGATION = 8


def resize_and_crop(image, resize: int | None, crop: int | None):
    """A PIL image with its short side resized to `resize` (bicubic), then center-cropped to
    `crop` x `crop` (default: a square of the short side). An image whose short side is then
    smaller than `crop` is resized (its short side to `crop`) first: the rule never depends on
    refusing an image. Cost is bounded by the output: an image more elongated than
    `MAX_ELONGATION` is resampled in the kept window alone (the same scale and centre; the
    window's edge pixels may differ by the bicubic kernel's reach)."""
    from PIL import Image

    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    width, height = image.size
    short = resize or min(width, height)  # the short side after --resize
    target = crop if crop and crop > short else resize
    if not target:
        side = crop or short
        left, top = (width - side) // 2, (height - side) // 2
        return image.crop((left, top, left + side, top + side))
    scale = target / min(width, height)
    new_width, new_height = max(1, round(width * scale)), max(1, round(height * scale))
    side = crop or min(new_width, new_height)
    left, top = (new_width - side) // 2, (new_height - side) // 2
    if max(new_width, new_height) <= MAX_ELONGATION * side:
        image = image.resize((new_width, new_height), Image.BICUBIC)
        return image.crop((left, top, left + side, top + side))
    x_scale, y_scale = width / new_width, height / new_height
    return image.resize((side, side), Image.BICUBIC, box=(
        left * x_scale, top * y_scale, (left + side) * x_scale, (top + side) * y_scale))


def images_to_array(images: Iterable, resize: int | None, crop: int | None,
                    rgb: bool) -> np.ndarray:
    """PIL images as uint8 (N, S, S, C), each through `resize_and_crop`; each converted to RGB
    when `rgb` (grayscale repeated to 3 channels)."""
    array = np.stack([np.asarray(resize_and_crop(image.convert("RGB") if rgb else image,
                                                 resize, crop)) for image in images])
    return as_channels(array, rgb)


def as_channels(array: np.ndarray, rgb: bool) -> np.ndarray:
    """uint8 (N, H, W[, C]) as (N, H, W, C): a channel axis added, grayscale repeated to 3
    channels when `rgb`."""
    if array.ndim == 3:
        array = array[..., None]
    if rgb and array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return np.ascontiguousarray(array, dtype=np.uint8)
