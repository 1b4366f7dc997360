"""The finetune job's images: the train and test splits of a data spec (the same specs as
`dpprobe extract`, `hf:` included) as uint8 arrays at the model's input size. Resizing and
cropping are functions of each image alone (no privacy cost)."""

from __future__ import annotations

import numpy as np

__all__ = ["load_images"]


def load_images(config, *, rgb: bool):
    """(train images, labels), (test images, labels), class names: uint8 NHWC at the model's
    input size. Resizing is a function of each image alone (no privacy cost)."""
    import extract

    if config.test_data is None:
        splits = extract.open_source(config.data, data_dir=config.data_dir)
    else:
        splits = (extract.open_source(config.data, split="train", data_dir=config.data_dir)
                  | extract.open_source(config.test_data, split="test",
                                        data_dir=config.data_dir))
    missing = {"train", "test"} - set(splits)
    if missing:
        raise ValueError(f"{config.data} has no {' or '.join(sorted(missing))} split; give the "
                         "test split of a one-split source (npz:, imagefolder:) with `test_data`")
    if splits["train"].class_names != splits["test"].class_names:
        raise ValueError("the train and test data declare different classes")
    out = []
    for name in ("train", "test"):
        split = splits[name]
        out.append((_as_array(split, config.resize, config.crop, rgb),
                    split.labels.astype(np.int32)))
    return out[0], out[1], list(splits["train"].class_names)


def _as_array(split, resize: int | None, crop: int | None, rgb: bool) -> np.ndarray:
    """The split as uint8 (N, S, S, C): as stored when no resize or crop is asked and the
    images are square arrays; else each image resized (short side to `resize`, bicubic) and
    center-cropped (to `crop`, or to a square) by `finetune.images`, which a released model
    (`dpmodel`) applies to the images it is given too."""
    from finetune.images import as_channels, images_to_array

    array = split.array
    if array is None or resize or crop or array.shape[1] != array.shape[2]:
        array = np.concatenate([
            images_to_array(split.images(range(start, min(start + 1024, len(split)))), resize,
                            crop, rgb)
            for start in range(0, len(split), 1024)])
    return as_channels(array, rgb)
