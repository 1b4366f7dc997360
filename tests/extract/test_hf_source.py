"""`--data hf:...`: Hugging Face `datasets` folders (save_to_disk) as a data source for extract and
finetune, and torch Datasets through the Python extract API. No network: the tests write the
datasets they read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpprobe import extract
from dpprobe.pipelines import FinetuneConfig, cli, run_extract

datasets = pytest.importorskip("datasets")

CLASSES = ["zero", "one", "two"]


def _images(rng, n, side=16):
    labels = rng.integers(0, 3, n)
    images = rng.integers(0, 256, (n, side, side)).astype(np.uint8)
    return images, labels


def _dataset(images, labels, *, image=("image",), label="label", class_label=True):
    from PIL import Image

    features = {name: datasets.Image() for name in image} | {
        label: datasets.ClassLabel(names=CLASSES) if class_label else datasets.Value("int64")}
    return datasets.Dataset.from_dict(
        {name: [Image.fromarray(x) for x in images] for name in image}
        | {label: labels.tolist()}, features=datasets.Features(features))


@pytest.fixture
def hf_folder(rng, tmp_path):
    """A DatasetDict (train 30, test 12) saved with save_to_disk, and its arrays."""
    train, test = _images(rng, 30), _images(rng, 12)
    datasets.DatasetDict(train=_dataset(*train), test=_dataset(*test)).save_to_disk(
        str(tmp_path / "ds"))
    return tmp_path / "ds", train, test


def test_hf_folder_gives_both_splits_with_images_labels_and_class_names(hf_folder):
    path, train, test = hf_folder
    splits = extract.open_source(f"hf:{path}")
    assert set(splits) == {"train", "test"}
    for name, (images, labels) in (("train", train), ("test", test)):
        split = splits[name]
        assert split.class_names == CLASSES and split.spec == f"hf:{path}"
        np.testing.assert_array_equal(split.labels, labels)
        decoded = np.stack([np.asarray(im) for im in split.images(range(len(split)))])
        np.testing.assert_array_equal(decoded, images)  # PNG round trip: exact
    # The fingerprint hashes content: another image gives another fingerprint.
    assert splits["train"].fingerprint != splits["test"].fingerprint


def _rgb(images: np.ndarray) -> np.ndarray:
    """Grayscale images (N, H, W) as PIL converts them to RGB: the value in each channel."""
    return np.repeat(images[..., None], 3, axis=-1)


def test_hf_store_equals_the_npz_store_of_the_same_images(hf_folder, tmp_path):
    path, train, test = hf_folder
    assert cli.main(["extract", "--backbone", "scatternet", "--data", f"hf:{path}", "--out",
                     str(tmp_path / "hf.zarr"), "--quiet"]) == 0
    for name, (images, labels) in (("train", train), ("test", test)):
        # Rows of an image column are read as RGB (as torchvision's ImageFolder reads files);
        # an array keeps its channels: the npz holds the same images as RGB.
        np.savez(tmp_path / f"{name}.npz", images=_rgb(images), labels=labels,
                 class_names=np.array(CLASSES))
        assert cli.main(["extract", "--backbone", "scatternet", "--data",
                         f"npz:{tmp_path / f'{name}.npz'}", "--split", name, "--out",
                         str(tmp_path / "npz.zarr"), "--quiet"]) == 0
        a = extract.load_split(str(tmp_path / "hf.zarr"), name)
        b = extract.load_split(str(tmp_path / "npz.zarr"), name)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        assert a[2]["class_names"] == CLASSES


def test_hf_one_split_named_columns_and_plain_integer_labels(rng, tmp_path):
    images, labels = _images(rng, 20)
    ds = _dataset(images, labels, image=("picture", "thumbnail"), label="y", class_label=False)
    datasets.DatasetDict(validation=ds).save_to_disk(str(tmp_path / "ds"))
    spec = f"hf:{tmp_path / 'ds'}:validation"
    with pytest.raises(ValueError, match=r"cannot tell the image column \(columns \['picture', "
                                         r"'thumbnail'\].*name it: \?image=COLUMN"):
        extract.open_source(spec, split="test")
    with pytest.raises(ValueError, match=r"'y' is not a ClassLabel.*`num_classes=K`"):
        extract.open_source(spec + "?image=picture&label=y", split="test")
    splits = extract.open_source(spec + "?image=picture&label=y", split="test", num_classes=3)
    assert list(splits) == ["test"] and splits["test"].class_names == ["0", "1", "2"]
    np.testing.assert_array_equal(splits["test"].labels, labels)
    with pytest.raises(ValueError, match="has no split 'train'; it has \\['validation'\\]"):
        extract.open_source(f"hf:{tmp_path / 'ds'}:train")
    with pytest.raises(ValueError, match="none named train or test"):
        extract.open_source(f"hf:{tmp_path / 'ds'}")


def test_hf_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a folder written by save_to_disk"):
        extract.open_source(f"hf:{tmp_path / 'plain'}")
    with pytest.raises(ValueError, match="not a dataset in the local Hugging Face cache"):
        extract.open_source("hf:no-such-user/no-such-dataset-xyz")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\]"):
        extract.open_source(f"hf:{tmp_path}?colour=red")


def test_finetune_reads_hf_data(hf_folder, tmp_path, monkeypatch):
    path, _, _ = hf_folder
    monkeypatch.chdir(tmp_path)
    assert cli.main(["finetune", "--data", f"hf:{path}", "--model", "cnn", "--batch-size",
                     "10", "--steps", "2", "--physical-batch-size", "16", "--epsilon", "4",
                     "--delta", "1e-3", "--out", "run", "--quiet"]) == 2  # files: no size
    assert cli.main(["finetune", "--data", f"hf:{path}", "--model", "cnn", "--batch-size",
                     "10", "--steps", "2", "--physical-batch-size", "16", "--epsilon", "4",
                     "--delta", "1e-3", "--resize", "16", "--out", "run", "--quiet"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["data"]["class_names"] == CLASSES
    assert (results["data"]["num_train"], results["data"]["num_test"]) == (30, 12)


def test_python_extract_api_takes_a_torch_dataset(rng, tmp_path):
    import torch.utils.data

    images, labels = _images(rng, 16)

    class Pairs(torch.utils.data.Dataset):
        classes = CLASSES

        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            return images[i], int(labels[i])

    (report,) = run_extract(backbone="scatternet", data=Pairs(), out=str(tmp_path / "t.zarr"),
                            progress=False)
    assert report.complete and report.split == "train"
    # A dataset is read image by image, as RGB (`extract.image_mode_of`): the npz holds RGB.
    np.savez(tmp_path / "a.npz", images=_rgb(images), labels=labels,
             class_names=np.array(CLASSES))
    run_extract(backbone="scatternet", data=f"npz:{tmp_path / 'a.npz'}",
                out=str(tmp_path / "n.zarr"), progress=False)
    a, b = (extract.load_split(str(tmp_path / s), "train") for s in ("t.zarr", "n.zarr"))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[2]["class_names"] == CLASSES


def test_hf_one_missing_label_or_image_is_a_null_record_not_a_refusal(rng, tmp_path,
                                                                        monkeypatch):
    """The publishing rule (`extract.defects`) for hf: a None label, a None image and an image
    whose file is missing each make one null record (label -1, zero pixels); N never changes.
    `extract` (strict) still refuses."""
    import dpprobe.extract.hf  # noqa: F401 (loads the submodule)
    from dpprobe import extract
    from dpprobe.extract.defects import NULL_LABEL
    from dpprobe.finetune.data import load_images

    train, test = _images(rng, 12), _images(rng, 6)
    ds = _dataset(*train)
    rows = ds.to_list()
    ds = datasets.Dataset.from_list(
        [row | {"label": None} if i == 3 else row | {"image": None} if i == 5
         else row | {"image": {"path": str(tmp_path / "gone.png"), "bytes": None}} if i == 8
         else row for i, row in enumerate(rows)], features=ds.features)
    both = datasets.DatasetDict(train=ds, test=_dataset(*test))
    # save_to_disk embeds image files, so a missing one is read from memory (as from a cache).
    monkeypatch.setattr(extract.hf, "_load", lambda spec: both)
    config = FinetuneConfig(data=f"hf:{tmp_path / 'ds'}", resize=8)
    (images, labels), (test_images, _), names = load_images(config, rgb=False)
    assert names == CLASSES and len(labels) == 12 and len(test_images) == 6
    assert [i for i in range(12) if labels[i] == NULL_LABEL] == [3, 5, 8]
    assert not images[[3, 5, 8]].any() and images[0].any()
    keep = [i for i in range(12) if i not in (3, 5, 8)]
    np.testing.assert_array_equal(labels[keep], train[1][keep])
    with pytest.raises((ValueError, AttributeError, FileNotFoundError)):
        extract.open_source(f"hf:{tmp_path / 'ds'}")
    from dpprobe.extract.data_check import check_data

    (_, found), _ = check_data(config.data).splits.values()
    assert [defect.row for _, defect in found] == [3, 5, 8]  # for the owner, with why
    assert "label None" in found[0][1].detail


def test_hf_array_images_follow_the_pixel_rule_record_by_record(monkeypatch):
    """An image column of nested integer lists (no datasets.Image): a None or ragged image is a
    null record, a pixel of 300 is clamped; nothing raises."""
    import dpprobe.extract.hf  # noqa: F401 (loads the submodule)
    from dpprobe import extract
    from dpprobe.finetune.data import load_images

    rows = [{"image": np.full((16, 16), 5).tolist(), "label": i % 3} for i in range(10)]
    rows[2]["image"], rows[4]["image"], rows[6]["image"] = None, [[300] * 16] * 16, [[1, 2], [3]]
    features = datasets.Features({"image": datasets.Sequence(datasets.Sequence(
        datasets.Value("int64"))), "label": datasets.ClassLabel(names=CLASSES)})
    both = datasets.DatasetDict(train=datasets.Dataset.from_list(rows, features=features),
                                test=datasets.Dataset.from_list(rows[7:], features=features))
    monkeypatch.setattr(extract.hf, "_load", lambda spec: both)
    config = FinetuneConfig(data="hf:x?image=image", resize=8)
    (images, labels), _, _ = load_images(config, rgb=False)
    assert labels.tolist() == [0, 1, -1, 0, 1, 2, -1, 1, 2, 0]
    assert images[[0, 2, 4, 6]].max(axis=(1, 2, 3)).tolist() == [5, 0, 255, 0]


def test_a_failed_hf_extract_never_blocks_the_corrected_rerun(rng, tmp_path, capsys):
    """One record of another size fails ScatterNet mid-way (train chunks already written): the
    corrected command (`--resize --crop`) replaces that failed, never-completed split without
    `--overwrite`, giving the store a fresh extraction gives; the completed split then stays
    protected from yet another job. The old writer refused the rerun ("a different job")."""
    from PIL import Image

    train, test = _images(rng, 30), _images(rng, 12)
    records = [Image.fromarray(x) for x in train[0]]
    records[21] = Image.fromarray(rng.integers(0, 256, (20, 24)).astype(np.uint8))
    train_set = datasets.Dataset.from_dict(
        {"image": records, "label": train[1].tolist()},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=CLASSES)}))
    datasets.DatasetDict(train=train_set, test=_dataset(*test)).save_to_disk(
        str(tmp_path / "ds"))
    out, data = str(tmp_path / "s.zarr"), f"hf:{tmp_path / 'ds'}"
    base = ["extract", "--backbone", "scatternet", "--data", data, "--rows-per-chunk", "4",
            "--quiet"]
    assert cli.main([*base, "--out", out]) == 2
    assert not extract.split_attrs(out, "train")["complete"]
    assert int(np.asarray(extract.open_split(out, "train", require_complete=False)
                          ["chunks_done"][:]).sum()) == 5  # rows 0-19 were written
    capsys.readouterr()

    # The same command, corrected: the failed split is replaced, no --overwrite needed.
    corrected = [*base, "--resize", "16", "--crop", "16"]
    assert cli.main([*corrected, "--out", out]) == 0, capsys.readouterr().err
    assert cli.main([*corrected, "--out", str(tmp_path / "fresh.zarr")]) == 0
    for split in ("train", "test"):
        got, want = (extract.load_split(path, split)
                     for path in (out, str(tmp_path / "fresh.zarr")))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert "failed" not in extract.split_attrs(out, split)

    # A split another job completed stays protected: other options need --overwrite.
    capsys.readouterr()
    assert cli.main([*base, "--resize", "12", "--crop", "12", "--out", out]) == 2
    assert "different" in capsys.readouterr().err
    np.testing.assert_array_equal(extract.load_split(out, "train")[0],
                                  extract.load_split(str(tmp_path / "fresh.zarr"), "train")[0])


def test_a_failed_torch_dataset_extract_never_blocks_the_corrected_rerun(rng, tmp_path):
    """The same rule through the Python API with a torch Dataset: its record 21 has another
    size, so the extraction fails after 5 chunks; the corrected call replaces the failed split
    without `overwrite`. The old writer refused it."""
    import torch.utils.data

    images, labels = _images(rng, 30)
    odd = rng.integers(0, 256, (20, 24)).astype(np.uint8)

    class Pairs(torch.utils.data.Dataset):
        classes = CLASSES

        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            return (odd if i == 21 else images[i]), int(labels[i])

    out = str(tmp_path / "t.zarr")
    options = dict(backbone="scatternet", data=Pairs(), out=out, rows_per_chunk=4,
                   progress=False)
    with pytest.raises(ValueError, match="one size"):
        run_extract(**options)
    assert not extract.split_attrs(out, "train")["complete"]
    (report,) = run_extract(**options, resize=16, crop=16)
    assert report.complete and not report.resumed and report.chunks_written == 8
