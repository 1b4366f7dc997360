"""Zero records decide a publishing run (issue 28): for each defect of one record, `finetune`
on D and on D with that record nulled both finish, and what they print and write differs only
in DP outputs (and the live progress lines' rates; the owner's timing file is not published);
the record's value appears nowhere. `dpprobe verify --data` lists
the same records, with their values, for the data's owner."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
from PIL import Image

from dpprobe.extract import defects, open_source
from dpprobe.finetune import data as finetune_data
from dpprobe.finetune import job as finetune_job
from dpprobe.finetune.data import DATA_RULE
from dpprobe.model import read_model_file
from dpprobe.pipelines import cli
from tests.pipelines.test_finetune_job import ALLOWED, MODEL_ALLOWED, non_dp_leaves

CLASSES = np.array(["a", "b", "c", "d"])
BAD_ROW = 7  # the defective record (its file: b/07.*)
JOB = ["finetune", "--model", "cnn", "--batch-size", "20", "--steps", "2",
       "--physical-batch-size", "16", "--lr", "0.5", "--epsilon", "2", "--delta", "1e-3",
       "--out", "run"]


def _npz(directory, rng, defect):
    """train.npz (40 float images in [0, 1]) with row BAD_ROW defective (`defect`: "label",
    "nan", "range") or nulled (None: label -1, zero pixels); test.npz clean."""
    images = rng.random((40, 16, 16)).astype(np.float32)
    labels = rng.integers(0, 4, 40)
    if defect == "label":
        labels[BAD_ROW] = 1234567
    elif defect == "nan":
        images[BAD_ROW, 3, 5] = np.nan
    elif defect == "range":
        images[BAD_ROW, 3, 5] = 1.7
    else:
        images[BAD_ROW], labels[BAD_ROW] = 0.0, defects.NULL_LABEL
    np.savez(directory / "train.npz", images=images, labels=labels, class_names=CLASSES)
    np.savez(directory / "test.npz", images=rng.random((20, 16, 16)).astype(np.float32),
             labels=rng.integers(0, 4, 20), class_names=CLASSES)
    return ["--data", "npz:train.npz", "--test-data", "npz:test.npz"]


def _folder(directory, rng, defect):
    """imgs/{train,test}/CLASS/NN.png (16x16 RGB), train's BAD_ROW file defective (`defect`:
    "corrupt", "size": 20 x 11, "mode": grayscale), nulled (None: an empty file, which no
    reader can decode) or absent (any other `defect`)."""
    for split, count in (("train", 40), ("test", 20)):
        for row in range(count):
            folder = directory / "imgs" / split / CLASSES[row % 4]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)
            if split == "test" or row != BAD_ROW:
                Image.fromarray(pixels).save(folder / f"{row:02d}.png")
            elif defect == "corrupt":
                (folder / f"{row:02d}.png").write_bytes(b"not-an-image-31337")
            elif defect == "size":
                Image.fromarray(pixels[:11, :].repeat(2, axis=1)[:, :20]).save(
                    folder / f"{row:02d}.png")  # 20 x 11
            elif defect == "mode":
                Image.fromarray(pixels).convert("L").save(folder / f"{row:02d}.png")
            elif defect == "bytes":  # a valid image in a file over the (test's) byte cap
                Image.fromarray(pixels).save(folder / f"{row:02d}.png")
                with open(folder / f"{row:02d}.png", "ab") as f:
                    f.write(bytes(4 * BYTE_CAP))
            elif defect in HUGE:  # a small file: 1-bit pixels compress well
                Image.new("1", HUGE[defect]).save(folder / f"{row:02d}.png", compress_level=1)
            elif defect is None:
                (folder / f"{row:02d}.png").write_bytes(b"")
    return ["--data", "imagefolder:imgs/train", "--test-data", "imagefolder:imgs/test",
            "--crop", "16"]  # larger than the odd-size image's short side


# `defects.MAX_FILE_BYTES` in the "too-many-bytes" case (the real cap is 256 MiB).
BYTE_CAP = 10_000

# Images of many pixels in small files: above Pillow's decompression-bomb limit (which warns,
# quoting the size), and above the public cap only (`defects.MAX_PIXELS`).
HUGE = {"bomb": (10000, 9000), "cap": (7000, 6000)}

# (writer, defect, strings of the bad record's value or place that must appear nowhere; the
# first is in what `verify --data` says of it)
DEFECTS = {
    "label-outside-the-classes": (_npz, "label", ["1234567", "row 7"]),
    "nan-pixel": (_npz, "nan", ["NaN or Inf", "row 7"]),
    "float-pixel-above-1": (_npz, "range", ["1.7", "row 7"]),
    "corrupt-file": (_folder, "corrupt", ["not an image format", "31337", "07.png",
                                           "cannot identify"]),
    "odd-size": (_folder, "size", ["20x11", "(20, 11)", "07.png"]),
    "odd-mode": (_folder, "mode", ["16x16 L", "07.png"]),
    "decompression-bomb": (_folder, "bomb", ["90000000", "10000", "07.png"]),
    "above-the-pixel-cap": (_folder, "cap", ["7000x6000 pixels, more than", "7000x6000",
                                           "07.png"]),
    "too-many-bytes": (_folder, "bytes", [f"more than {BYTE_CAP} bytes", "07.png"]),
}


def _masked(text: str) -> str:
    """Printed text with the DP outputs (accuracies) and the live progress lines' timings (the
    operator's terminal, `dpprobe.timings`) masked."""
    text = re.sub(r"\d+(\.\d+)?%", "ACC%", text)
    text = re.sub(r"\d+(\.\d+)? s\b", "TIME s", text)
    return re.sub(r"\d+ img/s", "RATE img/s", text)


def _run(directory, writer, defect, capsys, monkeypatch):
    """`finetune` on the data `writer` writes: (stdout, stderr, the run's text files, the model
    file's description, the trainer's input (train images, labels))."""
    directory.mkdir()
    monkeypatch.chdir(directory)
    data = writer(directory, np.random.default_rng(0), defect)
    capsys.readouterr()
    given = []  # what the trainer is given: the data after the rule

    def load_images(config, **options):
        given.append(finetune_data.load_images(config, **options))
        return given[-1]

    monkeypatch.setattr(finetune_job, "load_images", load_images)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = cli.main([*JOB, *data])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    # Python prints a warning on stderr: none may come from decoding a record.
    pillow = [str(w.message) for w in caught if "PIL" in w.filename
              or w.category.__module__.startswith("PIL")]
    assert not pillow, pillow
    written = {f.relative_to(directory / "run").as_posix(): f
               for f in sorted((directory / "run").rglob("*")) if f.is_file()}
    texts = {name: f.read_text() for name, f in written.items() if f.suffix != ".safetensors"}
    model = read_model_file(directory / "run" / "model.safetensors")[1]
    return printed.out, printed.err, texts, model, given[0][0]


# The cases whose record the rule changes but keeps (clamped, resized, converted).
KEPT = {"float-pixel-above-1", "odd-size", "odd-mode"}


@pytest.fixture(params=list(DEFECTS))
def defect_case(request, monkeypatch):
    """(writer, defect, secrets, whether the rule nulls the record) of one `DEFECTS` case; the
    "bytes" case under `BYTE_CAP`."""
    writer, defect, secrets = DEFECTS[request.param]
    if defect == "bytes":
        monkeypatch.setattr(defects, "MAX_FILE_BYTES", BYTE_CAP)
    return writer, defect, secrets, request.param not in KEPT


def test_one_defective_record_never_decides_the_finetune_run(defect_case, tmp_path, capsys,
                                                             monkeypatch):
    assert_neighbours_agree(*defect_case, tmp_path, capsys, monkeypatch)


def assert_neighbours_agree(writer, defect, secrets, nulled, tmp_path, capsys, monkeypatch):
    """`finetune` on D (`writer`'s data with `defect`) and on D with that record nulled: both
    exit 0 and print and write the same but for DP outputs and timings, none of `secrets`
    appears; when the rule nulls the record (`nulled`), the trainer is given the same input."""
    runs = [_run(tmp_path / name, writer, kind, capsys, monkeypatch)
            for name, kind in (("D", defect), ("D_nulled", None))]
    (out, err, texts, model, given), (out_n, err_n, texts_n, model_n, given_n) = runs
    assert _masked(out) == _masked(out_n)
    assert _masked(err) == _masked(err_n)
    assert "dpprobe verify --data" in err  # the one fixed line, the same whatever the data
    assert texts.keys() == texts_n.keys()
    results, results_n = (json.loads(t["results.json"]) for t in (texts, texts_n))
    leaked = non_dp_leaves(results, results_n, ALLOWED)
    assert not leaked, f"results.json: non-DP leaves differ: {leaked}"
    for name in set(texts) - {"results.json", "results.timings.json"}:  # not the owner's
        assert texts[name] == texts_n[name], name
    leaked = non_dp_leaves(model, model_n, MODEL_ALLOWED)
    assert not leaked, f"model file: non-DP leaves differ: {leaked}"
    published = {name: text for name, text in texts.items() if name != "results.timings.json"}
    everything = out + err + json.dumps(published) + json.dumps(model)
    for secret in secrets:  # a number as a number: not the digits inside a longer one
        pattern = rf"(?<![\d.]){secret}(?!\d)" if secret.isdigit() else re.escape(secret)
        assert not re.search(pattern, everything), f"{secret!r} published"
    if nulled:  # the record became exactly the null record, and nothing else changed
        np.testing.assert_array_equal(given[1], given_n[1])
        np.testing.assert_array_equal(given[0], given_n[0])


def test_verify_data_lists_the_record_with_its_value_for_the_owner(defect_case, tmp_path,
                                                                   capsys, monkeypatch):
    assert_owner_sees(*defect_case[:3], tmp_path, capsys, monkeypatch)


def assert_owner_sees(writer, defect, secrets, tmp_path, capsys, monkeypatch):
    """`dpprobe verify --data` on `writer`'s data with `defect` lists that one record, by file
    or row, with `secrets[0]` (its value or why)."""
    monkeypatch.chdir(tmp_path)
    spec = writer(tmp_path, np.random.default_rng(0), defect)[1]
    capsys.readouterr()
    assert cli.main(["verify", "--data", spec]) == 1
    out = capsys.readouterr().out
    assert out.startswith("for the data's owner only, not a DP output")
    (line,) = [line for line in out.splitlines() if line.startswith("  ")]
    assert ("row 7" in line or "07." in line) and secrets[0] in line


def test_the_rule_is_per_record_and_extract_still_refuses_by_value(tmp_path):
    images = np.linspace(-0.5, 1.5, 2 * 4).reshape(2, 2, 2).astype(np.float32)
    images[1, 0, 0] = np.inf
    out, found = defects.pixel_rule(images)
    assert out.dtype == np.uint8 and out[1].max() == 0  # the null record: zero pixels
    np.testing.assert_array_equal(out[0], np.round(np.clip(images[0], 0, 1) * 255))
    assert [(d.row, d.kind) for d in found] == [(0, defects.CLAMPED), (1, defects.NULL)]
    ints, found = defects.pixel_rule(np.array([[[-3, 300]]], np.int64))
    np.testing.assert_array_equal(ints, [[[0, 255]]])
    np.savez(tmp_path / "t.npz", images=images[:1], labels=[9], class_names=CLASSES)
    with pytest.raises(ValueError, match=r"float images must lie in \[0, 1\]"):
        open_source(f"npz:{tmp_path / 't.npz'}")  # extract, the owner's tool: by value
    (split,) = open_source(f"npz:{tmp_path / 't.npz'}", strict=False).values()
    assert split.labels.tolist() == [defects.NULL_LABEL]
    assert not split.array.any()  # a null record by its label alone: zero pixels too
    assert (f"over {defects.MAX_PIXELS // 10**6}M pixels or {defects.MAX_FILE_BYTES // 2**20} MiB"
            in DATA_RULE)  # the job's line says so


def test_image_files_need_a_public_input_size(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = _folder(tmp_path, np.random.default_rng(0), None)[:4]
    assert cli.main([*JOB, *data]) == 2
    assert "give the model's input size with --resize or --crop" in capsys.readouterr().err


def test_verify_data_passes_clean_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = _folder(tmp_path, np.random.default_rng(0), "absent")[1]
    assert cli.main(["verify", "--data", spec]) == 0
    out = capsys.readouterr().out
    assert "train: 39 records, none changed by the rule" in out and out.endswith("OK\n")


def test_a_bad_record_of_the_public_test_split_is_refused_by_name(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    data = _npz(tmp_path, np.random.default_rng(0), None)
    np.savez("test.npz", images=np.zeros((4, 16, 16), np.uint8), labels=[0, 1, 9, 2],
             class_names=CLASSES)
    assert cli.main([*JOB, *data]) == 2
    assert "the test split (public)" in capsys.readouterr().err


def _cifar(directory, labels, data):
    """A fake CIFAR-10 folder: data_batch_1 with `labels` and `data` (a list of rows of 3072
    pixels), batches 2..5 and test_batch with 2 clean images each."""
    import pickle

    clean = {b"labels": [0, 1], b"data": np.full((2, 3072), 9, np.uint8)}
    directory.mkdir()
    for name in [f"data_batch_{i}" for i in range(2, 6)] + ["test_batch"]:
        (directory / name).write_bytes(pickle.dumps(clean))
    (directory / "data_batch_1").write_bytes(pickle.dumps({b"labels": labels, b"data": data}))


def test_cifar_one_record_label_or_pixel_is_a_null_record_not_a_refusal(tmp_path):
    """Each label and pixel on its own: a label that is None, a string, beyond int64 or a float
    makes a null record (zero pixels), a pixel of 300 is clamped, a pixel None makes a null
    record; nothing raises; `extract` (strict) still refuses by value."""
    row = [7] * 3072
    labels = [0, 1, None, "x", 2**70, 2.5, 12, 3]
    data = [row, row[:-1] + [300], *[row] * 6, row[:5] + [None] + row[6:]]
    _cifar(tmp_path / "c", labels + [4], data)
    split = open_source(f"cifar10:{tmp_path / 'c'}", strict=False)["train"]
    assert len(split) == 9 + 8
    assert split.labels[:9].tolist() == [0, 1, -1, -1, -1, -1, -1, 3, -1]
    assert split.array[1].max() == 255 and split.array[0].max() == 7
    assert not split.array[[2, 3, 4, 5, 6, 8]].any()  # null records: zero pixels
    assert sorted({d.row for d in split.defects if d.kind == defects.NULL}) == [2, 3, 4, 5, 6, 8]
    with pytest.raises((ValueError, TypeError, OverflowError)):
        open_source(f"cifar10:{tmp_path / 'c'}")


def test_decoding_silences_pillow_and_makes_a_bomb_an_error():
    """`defects.decoding`: a warning while a record is decoded (EXIF, palette) is never shown;
    Pillow's decompression-bomb warning is raised, so the record becomes a null record."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with defects.decoding():
            warnings.warn("Corrupt EXIF data of record 7", UserWarning, stacklevel=1)
        with pytest.raises(Image.DecompressionBombWarning), defects.decoding():
            warnings.warn("Image size (90000000 pixels)", Image.DecompressionBombWarning,
                          stacklevel=1)
    assert not caught
