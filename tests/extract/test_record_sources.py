"""The per-record rule for every source form: a ragged or `None` row of a CIFAR batch, an `hf:`
image over the byte cap (embedded or by path) and a float TIFF holding a NaN each make a null
record, where `finetune` used to abort or to train the record as it was (an npz object array is
refused whole: its pickle is never read). Each has its neighbour test (`test_record_rule`'s:
D and D with that record nulled print and write the same but for DP outputs, and the trainer
is given the same input) and the owner's listing; then the rule's forms one by one, and the
caps checked before anything is copied or decoded."""

from __future__ import annotations

import io
import pickle
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from dpprobe.extract import defects, open_source
from tests.extract.test_record_rule import (
    BAD_ROW,
    BYTE_CAP,
    CLASSES,
    _folder,
    assert_neighbours_agree,
    assert_owner_sees,
)


def _cifar_batches(directory, rng, defect):
    """cifar/: CIFAR-10 batches whose `data` is a list of lists of ints (the form read element
    by element), 8 rows each, data_batch_1's row BAD_ROW defective (`defect`: "short", a pixel
    short; "none") or nulled (None: label -1, zero pixels)."""
    (directory / "cifar").mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        rows = 20 if name == "test_batch" else 8
        data = [rng.integers(0, 256, 3072).tolist() for _ in range(rows)]
        labels = rng.integers(0, 4, rows).tolist()
        if name == "data_batch_1":
            if defect == "short":
                data[BAD_ROW] = data[BAD_ROW][:-1]
            elif defect == "none":
                data[BAD_ROW] = None
            else:
                data[BAD_ROW], labels[BAD_ROW] = [0] * 3072, defects.NULL_LABEL
        batch = {b"data": data, b"labels": labels}
        (directory / "cifar" / name).write_bytes(pickle.dumps(batch))
    return ["--data", "cifar10:cifar", "--crop", "16"]


def _png(pixels, extra: int = 0) -> bytes:
    """A PNG of `pixels`, with one private ancillary chunk of `extra` zero bytes after its
    header when `extra` (a valid file that many bytes longer: readers skip such a chunk)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    png = buffer.getvalue()
    if not extra:
        return png
    body = b"prVt" + bytes(extra)
    chunk = struct.pack(">I", extra) + body + struct.pack(">I", zlib.crc32(body))
    return png[:33] + chunk + png[33:]  # after the 8-byte signature and the IHDR chunk


def _hf(directory, rng, defect):
    """hf/: a save_to_disk DatasetDict of embedded PNGs (train 40, test 20), train's row
    BAD_ROW a valid PNG over `BYTE_CAP` (`defect` "bytes": embedded; "bytes-path": a file by
    its path) or nulled (None: no image)."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=list(CLASSES))})
    parts = {}
    for split, count in (("train", 40), ("test", 20)):
        images = [{"bytes": _png(rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)),
                   "path": None} for _ in range(count)]
        if split == "train":
            big = _png(rng.integers(0, 256, (16, 16, 3)).astype(np.uint8), 4 * BYTE_CAP)
            if defect == "bytes":
                images[BAD_ROW] = {"bytes": big, "path": None}
            elif defect == "bytes-path":
                (directory / "big.png").write_bytes(big)
                images[BAD_ROW] = {"bytes": None, "path": str(directory / "big.png")}
            else:
                images[BAD_ROW] = None
        parts[split] = datasets.Dataset.from_dict(
            {"image": images, "label": rng.integers(0, 4, count).tolist()}, features=features)
    datasets.DatasetDict(parts).save_to_disk(str(directory / "hf"))
    return ["--data", "hf:hf", "--crop", "16"]


def _float_tiff(directory, rng, defect):
    """The image folder of `test_record_rule`, train's BAD_ROW file a float (mode F) TIFF of
    pixels in [0.02, 4.93] holding one NaN (`defect` "nan-tiff"), or nulled (None)."""
    data = _folder(directory, rng, None if defect is None else "absent")
    if defect is not None:
        pixels = rng.uniform(0.02, 4.93, (16, 16)).astype(np.float32)
        pixels[4, 9] = np.nan
        Image.fromarray(pixels).save(directory / f"imgs/train/{CLASSES[BAD_ROW % 4]}/07.tif")
    return data


# (writer, defect, strings of the record's value or place that must appear nowhere; the first
# is in what `verify --data` says of it)
SOURCES = {
    "cifar-row-a-pixel-short": (_cifar_batches, "short", ["not 3072 integer pixels", "row 7"]),
    "cifar-row-none": (_cifar_batches, "none", ["not 3072 integer pixels", "row 7"]),
    "hf-embedded-image-over-the-byte-cap": (_hf, "bytes", [f"more than {BYTE_CAP} bytes",
                                                           "row 7"]),
    "hf-image-file-over-the-byte-cap": (_hf, "bytes-path", [f"more than {BYTE_CAP} bytes",
                                                            "big.png", "row 7"]),
    "float-tiff-with-a-nan": (_float_tiff, "nan-tiff", ["NaN or Inf", "07.tif"]),
}


@pytest.fixture(params=list(SOURCES))
def source_case(request, monkeypatch):
    """(writer, defect, secrets, True: the rule nulls the record) of one `SOURCES` case, under
    `BYTE_CAP`."""
    monkeypatch.setattr(defects, "MAX_FILE_BYTES", BYTE_CAP)
    return (*SOURCES[request.param], True)


def test_one_defective_record_of_any_source_never_decides_the_run(source_case, tmp_path,
                                                                   capsys, monkeypatch):
    assert_neighbours_agree(*source_case, tmp_path, capsys, monkeypatch)


def test_verify_data_lists_it_for_the_owner(source_case, tmp_path, capsys, monkeypatch):
    assert_owner_sees(*source_case[:3], tmp_path, capsys, monkeypatch)


# ----------------------------------------------------------------------------------------------
# The rule's forms, one by one


def test_integer_pixels_reads_each_record_on_its_own():
    """CIFAR's `data` as a list or an object array: a record of 12 integers, flat or nested, is
    kept (clipped for `pixel_rule`); one a value short or long, None, a string, ragged, holding
    a float or a bool, or an array of floats or of another length is a null record. Only the
    form of the whole (not a sequence, an array of another shape) raises."""
    shape, row = (3, 2, 2), list(range(12))
    records = [row, row[:-1], row + [1], None, "x" * 12, row[:5] + [2.0] + row[6:],
               row[:5] + [True] + row[6:], np.arange(12).reshape(shape).tolist(), [[1, 2], [3]],
               np.arange(12, dtype=np.uint8), np.arange(12.0), np.arange(11, dtype=np.int16),
               (300,) * 12, [-5] * 12, np.array(row, object), [2**70] * 12,
               np.full(12, 2**63, np.uint64)]
    objects = np.empty(len(records), object)
    for i, record in enumerate(records):
        objects[i] = record
    for values in (records, objects):
        pixels, null = defects.integer_pixels(values, shape)
        assert null.tolist() == [1, 2, 3, 4, 5, 6, 8, 10, 11]
        assert pixels.shape == (len(records), *shape) and not pixels[null].any()
        for kept in (0, 7, 9, 14):
            np.testing.assert_array_equal(pixels[kept].reshape(-1), row)
        assert pixels[12].max() == pixels[15].max() == pixels[16].max() == 256
        assert pixels[13].min() == -1  # clipped for pixel_rule, which clamps to [0, 255]
    flat, null = defects.integer_pixels(np.arange(24, dtype=np.uint8).reshape(2, 12), shape)
    assert flat.shape == (2, *shape) and null.size == 0
    for whole in (np.zeros((2, 11), np.uint8), None, 5, np.array(3)):
        with pytest.raises(ValueError):
            defects.integer_pixels(whole, shape)


def test_a_cifar_object_array_row_is_a_null_record_and_extract_refuses_it(tmp_path):
    rows = np.empty(9, object)
    for i in range(9):
        rows[i] = np.full(3072, i, np.uint8)
    rows[4] = np.full(3071, 4, np.uint8)
    clean = {b"labels": [0, 1], b"data": np.full((2, 3072), 9, np.uint8)}
    (tmp_path / "c").mkdir()
    for name in [f"data_batch_{i}" for i in range(2, 6)] + ["test_batch"]:
        (tmp_path / "c" / name).write_bytes(pickle.dumps(clean))
    (tmp_path / "c/data_batch_1").write_bytes(pickle.dumps({b"labels": [1] * 9, b"data": rows}))
    split = open_source(f"cifar10:{tmp_path / 'c'}", strict=False)["train"]
    assert [d.row for d in split.defects] == [4] and split.labels[:9].tolist() == [1] * 4 + [
        -1] + [1] * 4
    assert split.array[3].max() == 3 and not split.array[4].any()
    with pytest.raises(ValueError, match="data_batch_1: not a CIFAR batch"):
        open_source(f"cifar10:{tmp_path / 'c'}")


def _folder_of(directory, arrays: dict) -> str:
    """imgs/{a,b}/: two PNGs a class, and `arrays` ({relative path: pixels saved there})."""
    rng = np.random.default_rng(1)
    for name in ("a", "b"):
        (directory / "imgs" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3)).astype(np.uint8)).save(
                directory / "imgs" / name / f"{i}.png")
    for path, pixels in arrays.items():
        Image.fromarray(pixels).save(directory / "imgs" / path)
    return f"imagefolder:{directory / 'imgs'}"


def test_float_and_integer_images_follow_the_pixel_rule_from_any_source(tmp_path):
    """A mode-F TIFF: clamped to [0, 1] and scaled (not Pillow's 0-255 reading), its NaN a null
    record; a mode-I TIFF clamped to [0, 255]; the same bytes embedded in an `hf:` dataset give
    the same pixels (one helper). `extract` refuses a float image outside [0, 1] by name and
    scales one inside."""
    floats = np.random.default_rng(2).uniform(0.02, 4.93, (8, 8)).astype(np.float32)
    unit = floats / 5
    with_nan = floats.copy()
    with_nan[1, 2] = np.nan
    ints = np.arange(-100, 1180, 20, dtype=np.int32).reshape(8, 8)
    arrays = {"a/float.tif": floats, "a/nan.tif": with_nan, "b/int.tif": ints, "b/unit.tif": unit}
    spec = _folder_of(tmp_path, arrays)
    split = open_source(spec, strict=False)["train"]
    loaded = {str(path.relative_to(tmp_path / "imgs")): i for i, path in enumerate(split.files)}
    with defects.decoding():
        rgb = {path: np.asarray(split.load(loaded[path])) for path in arrays if "nan" not in path}
        with pytest.raises(ValueError, match="NaN or Inf"):
            split.load(loaded["a/nan.tif"])
    assert all(pixels.shape == (8, 8, 3) for pixels in rgb.values())  # RGB, as any other mode
    got = {path: pixels[..., 0] for path, pixels in rgb.items()}
    assert all((pixels == got[path][..., None]).all() for path, pixels in rgb.items())
    np.testing.assert_array_equal(got["a/float.tif"],
                                  np.round(np.clip(floats, 0, 1).astype(np.float64) * 255))
    np.testing.assert_array_equal(got["b/int.tif"], np.clip(ints, 0, 255))
    strict = open_source(spec)["train"]
    with pytest.raises(ValueError, match=r"float.tif: float pixels must lie in \[0, 1\]"):
        strict.images([loaded["a/float.tif"]])
    (image,) = strict.images([loaded["b/unit.tif"]])
    np.testing.assert_array_equal(np.asarray(image), rgb["b/unit.tif"])
    np.testing.assert_array_equal(got["b/unit.tif"], np.round(unit.astype(np.float64) * 255))
    datasets = pytest.importorskip("datasets")
    tiff = (tmp_path / "imgs/a/float.tif").read_bytes()
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"image": [{"bytes": tiff, "path": None}] * 2, "label": [0, 1]}, features=features)
    ).save_to_disk(str(tmp_path / "hf"))
    (hf_split,) = open_source(f"hf:{tmp_path / 'hf'}:train", strict=False).values()
    np.testing.assert_array_equal(np.asarray(hf_split.load(1)), rgb["a/float.tif"])


def test_hf_caps_are_checked_before_any_copy_or_decoding(tmp_path, monkeypatch):
    """An embedded image of 32 MiB over a 1 MiB cap: opening the split and loading that row
    copy nothing of it (Python's and Arrow's allocations stay under 2 MiB: its length is read
    from the column's offsets) and never hand it to the decoder."""
    import tracemalloc

    import pyarrow as pa

    import dpprobe.extract.hf  # noqa: F401 (loads the submodule)
    from dpprobe import extract

    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(defects, "MAX_FILE_BYTES", 2**20)
    small = _png(np.zeros((8, 8, 3), np.uint8))
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"image": [{"bytes": small, "path": None}, {"bytes": _png(np.zeros((8, 8, 3), np.uint8),
                                                                   32 * 2**20), "path": None}],
         "label": [0, 1]}, features=features)).save_to_disk(str(tmp_path / "hf"))
    decoded = []
    load_image = getattr(extract.hf, "load_image", None)
    monkeypatch.setattr(extract.hf, "load_image",
                        lambda content: decoded.append(len(content)) or load_image(content),
                        raising=False)
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        (split,) = open_source(f"hf:{tmp_path / 'hf'}:train", strict=False).values()
        with pytest.raises(ValueError, match=f"more than {2**20} bytes"):
            split.load(1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**21 and pa.total_allocated_bytes() - arrow_before < 2**21, peak
    assert decoded == []
    split.load(0)
    assert decoded == [len(small)]


def test_an_npz_object_array_is_refused_whole_and_its_pickle_never_runs(tmp_path):
    """An npz whose images are an object array (rows of their own shapes) is a structural
    fault for every reader, strict or not: its pickle is never read, so nothing of the file's
    choosing runs (a crafted dtype state in an allow-listed pickle corrupted memory)."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (marker.write_text, ("the file's code ran",))

    hostile = np.empty(2, object)
    hostile[:] = [np.zeros((8, 8), np.uint8), Payload()]
    np.savez(tmp_path / "h.npz", images=hostile, labels=np.array([0, 1]),
             class_names=np.array(["a", "b"]))
    for strict in (True, False):
        with pytest.raises(ValueError, match="an array cannot be read"):
            open_source(f"npz:{tmp_path / 'h.npz'}", strict=strict)
    assert not marker.exists()


def test_hf_array_rows_are_capped_before_they_are_converted(monkeypatch):
    """An array column's row over the byte cap as stored, or over the pixel cap, is a null
    record, told before it is turned into an image."""
    import dpprobe.extract.hf  # noqa: F401 (loads the submodule)
    from dpprobe import extract

    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(defects, "MAX_FILE_BYTES", 2000)
    monkeypatch.setattr(defects, "MAX_PIXELS", 1000)
    rows = [np.full((8, 8), 5).tolist(), np.full((60, 60), 5).tolist(),  # 3600 bytes
            np.full((8, 200), 5).tolist()]  # 1600 bytes and 1600 pixels
    features = datasets.Features({"image": datasets.Sequence(datasets.Sequence(
        datasets.Value("uint8"))), "label": datasets.ClassLabel(names=["a", "b"])})
    both = datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"image": rows, "label": [0, 1, 0]}, features=features))
    monkeypatch.setattr(extract.hf, "_load", lambda spec: both)
    (split,) = open_source("hf:x:train?image=image", strict=False).values()
    assert np.asarray(split.load(0)).max() == 5
    with pytest.raises(ValueError, match="more than 2000 bytes"):
        split.load(1)
    with pytest.raises(ValueError, match="200x8 pixels, more than the 1000"):
        split.load(2)


def test_hf_rows_read_by_the_rule_are_each_their_own(tmp_path, monkeypatch):
    """The rule's Arrow views give row i's own image, from a saved folder (several shards) and
    from a selection of rows (an indices mapping), and its fingerprint pass reads each row."""
    import dpprobe.extract.hf  # noqa: F401 (loads the submodule)
    from dpprobe import extract

    datasets = pytest.importorskip("datasets")
    pixels = np.random.default_rng(3).integers(0, 256, (12, 8, 8, 3)).astype(np.uint8)
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": _png(p), "path": None} for p in pixels],
                                     "label": [i % 2 for i in range(12)]}, features=features)
    datasets.DatasetDict(train=ds).save_to_disk(str(tmp_path / "hf"), num_shards={"train": 3})
    (split,) = open_source(f"hf:{tmp_path / 'hf'}:train", strict=False).values()
    for i in range(12):
        np.testing.assert_array_equal(np.asarray(split.load(i)), pixels[i])
    order = [5, 0, 11, 3]
    monkeypatch.setattr(extract.hf, "_load",
                        lambda spec: datasets.DatasetDict(train=ds.select(order)))
    (chosen,) = open_source("hf:x:train", strict=False).values()
    for i, row in enumerate(order):
        np.testing.assert_array_equal(np.asarray(chosen.load(i)), pixels[row])
    assert chosen.fingerprint != split.fingerprint
