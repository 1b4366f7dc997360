"""The finetune job's images: the train and test splits of a data spec (the same specs as
`dpprobe extract`, `hf:` included) as uint8 arrays at the model's input size.

The job publishes, so no single record may decide what it publishes: the data is read with the
public per-record rule (`extract.defects`, `open_source(strict=False)`), never refused for one
record's content, and nothing here prints a record's value or counts the records the rule
changed. Resizing, cropping and channel conversion are functions of each image alone (no
privacy cost); the model's input size and channels are public: the arrays' own shape (one for
every record), or `--resize` / `--crop` for sources of images each of its own size (image files,
`hf:` images and array rows: no record's size may decide the model's).
"""

from __future__ import annotations

import numpy as np

__all__ = ["DATA_RULE", "load_images"]

# The one line the job prints about its data, the same whatever the data holds.
DATA_RULE = ("data: a record with a missing label or one outside the class list, a NaN/Inf "
             "pixel, or a missing, malformed, unreadable or too large image (over 40M pixels "
             "or 256 MiB) trains as a null record, pixels are clamped to their range, images "
             "are resized and converted to the model's input (`dpprobe verify --data SPEC` "
             "lists such records, for the data's owner)")


def load_images(config, *, rgb: bool):
    """(train images, labels), (test images, labels), class names: uint8 NHWC at the model's
    input size, a train record the rule makes null labelled `extract.defects.NULL_LABEL`.

    Args:
      config: the job's config (`data`, `test_data`, `data_dir`, `resize`, `crop`).
      rgb: the model takes RGB (grayscale is repeated to 3 channels). Image files are always
        read as RGB: their modes are each file's own.

    Returns:
      the train split (a null record's label is `NULL_LABEL`), the test split (public: a
      record of it that the rule would make null is refused by name), the class names.

    Raises:
      ValueError: for structural faults only (no such file, no rows, no class list or one of
        fewer than 2 classes, an unknown format, splits that disagree, image files without
        `--resize` or `--crop`).
    """
    from dpprobe import extract

    sources = {"data_dir": config.data_dir, "num_classes": config.num_classes, "strict": False}
    if config.test_data is None:
        splits = extract.open_source(config.data, **sources)
    else:
        splits = (extract.open_source(config.data, split="train", **sources)
                  | extract.open_source(config.test_data, split="test", **sources))
    missing = {"train", "test"} - set(splits)
    if missing:
        raise ValueError(f"{config.data} has no {' or '.join(sorted(missing))} split; give the "
                         "test split of a one-split source (npz:, imagefolder:) with `test_data`")
    if splits["train"].class_names != splits["test"].class_names:
        raise ValueError("the train and test data declare different classes")
    if len(splits["train"].class_names) < 2:  # as probe, tune and audit (a public count)
        raise ValueError(f"a classifier needs at least 2 classes, {config.data} declares "
                         f"{len(splits['train'].class_names)}")
    for split in splits.values():
        if split.array is None and not (config.resize or config.crop):
            raise ValueError(f"{split.spec or split.dataset} holds images each of its own "
                             "size (files, or rows of an array column): give the model's input "
                             "size with `resize` or `crop`")
    out = [(_as_array(splits[name], config.resize, config.crop, rgb),
            splits[name].labels.astype(np.int32)) for name in ("train", "test")]
    _refuse_null_test_records(splits["test"])
    return out[0], out[1], list(splits["train"].class_names)


def _as_array(split, resize: int | None, crop: int | None, rgb: bool) -> np.ndarray:
    """The split as uint8 (N, S, S, C): as stored when no resize or crop is asked and the
    images are square arrays; else each image resized (short side to `resize`, bicubic) and
    center-cropped (to `crop`, or to a square) by `finetune.images`, which a released model
    (`dpmodel`) applies to the images it is given too."""
    from dpprobe.finetune.images import as_channels, images_to_array

    array = split.array
    if array is None:
        return _files_as_array(split, resize, crop)
    if resize or crop or array.shape[1] != array.shape[2]:
        array = np.concatenate([
            images_to_array(split.images(range(start, min(start + 1024, len(split)))), resize,
                            crop, rgb)
            for start in range(0, len(split), 1024)])
    return as_channels(array, rgb)


def _files_as_array(split, resize: int | None, crop: int | None) -> np.ndarray:
    """Images of their own sizes as uint8 (N, S, S, 3), S = `crop` or `resize`: each loaded
    by the split's rule (`extract.defects`: the caps, the pixel rule), read as RGB, resized and
    cropped; one the rule refuses is a null record (zero pixels, label `NULL_LABEL`), as is a
    record already null (it is not read)."""
    from dpprobe.extract.defects import NULL_LABEL, decoding, unreadable
    from dpprobe.finetune.images import resize_and_crop

    side = crop or resize
    out = np.zeros((len(split), side, side, 3), np.uint8)
    for row in range(len(split)):
        if split.labels[row] == NULL_LABEL:
            continue
        try:
            with decoding():
                image = split.load(row)
                out[row] = np.asarray(resize_and_crop(image.convert("RGB"), resize, crop))
        except Exception as err:  # noqa: BLE001 - PIL raises many kinds for bad files
            split.defects.append(unreadable(row, err))
            split.null_rows([row])
    return out


def _refuse_null_test_records(split) -> None:
    """The test split is public (its accuracy is published): a record of it that the rule
    would make null is refused, naming it, rather than scored as a miss."""
    from dpprobe.extract.defects import NULL

    null = [d for d in split.defects or () if d.kind == NULL]
    if null:
        raise ValueError(f"the test split (public) holds records the training rule would make "
                         f"null, e.g. {split.describe(null[0].row)}: {null[0].detail}; list "
                         f"them with `dpprobe verify --data {split.spec}`")
