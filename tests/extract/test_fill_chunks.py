"""Chunks whose values all equal the fill value (issue 21): labels sorted by class, so that a
labels chunk holds only class 0, and a features chunk of zeros. Zarr 3 skips writing such a
chunk by default; the writer writes every chunk, and stores written before that (chunk files
absent) still open, read and verify, because the absent chunk's recorded sha256 is that of the
fill values Zarr reads in its place."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpprobe import extract
from dpprobe.extract import writer as writer_module
from dpprobe.pipelines import cli
from tests.store_helpers import fill, make_writer


def _chunk_files(store: Path, split: str, name: str) -> list[str]:
    base = store / split / name / "c"
    return sorted(os.path.relpath(os.path.join(root, f), base)
                  for root, _, files in os.walk(base) for f in files)


def _sorted_image_folder(root: Path, rng, per_class: int = 40) -> None:
    """Two classes of `per_class` PNGs each: read class by class, so the rows are sorted."""
    for split in ("train", "test"):
        for name in ("normal", "defect"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class if split == "train" else 8):
                pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def _sorted_npz(path: Path, rng, rows: int = 300, zero_rows: int = 0) -> None:
    """Embeddings sorted by label, optionally with the first `zero_rows` rows all zero."""
    features = rng.normal(size=(rows, 6)).astype(np.float32)
    features[:zero_rows] = 0.0
    labels = np.sort(rng.integers(0, 3, size=rows))
    labels[:70] = 0  # the first class fills the first chunk of 64 rows and more
    np.savez(path, features=features, labels=labels, class_names=np.array(["a", "b", "c"]))


def _every_command_reads(store: str, capsys, *, stream_too: bool = True) -> None:
    """verify, info, probe (in memory and streamed) and tune accept the store. Two steps: each
    reads every chunk of the store as the default recipe's many would."""
    assert cli.main(["verify", store, "--quiet"]) == 0, capsys.readouterr()
    assert cli.main(["info", store]) == 0
    probe = ["probe", store, "--epsilons", "1", "--seeds", "1", "--steps", "2", "--quiet"]
    assert cli.main(probe) == 0, capsys.readouterr()
    if stream_too:
        assert cli.main([*probe, "--stream"]) == 0, capsys.readouterr()
    assert cli.main(["tune", store, "--epsilon", "2", "--trials", "1", "--steps-choices", "2",
                     "--quiet"]) == 0, capsys.readouterr()
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.parametrize("rows_per_chunk", [32, 16], ids=["one-chunk", "several-chunks"])
def test_an_image_folder_sorted_by_class_extracts_and_is_read(tmp_path, rng, capsys,
                                                               rows_per_chunk):
    """The issue's case: 40 images of class 0 first fill one (32 rows) or two (16) chunks."""
    _sorted_image_folder(tmp_path / "if", rng)
    store = tmp_path / "i.zarr"
    for split in ("train", "test"):
        assert cli.main(["extract", "--backbone", "resnet18", "--random-init", "--crop", "32",
                         "--data", f"imagefolder:{tmp_path / 'if' / split}", "--split", split,
                         "--out", str(store), "--rows-per-chunk", str(rows_per_chunk),
                         "--device", "cpu", "--quiet"]) == 0
    labels = extract.load_split(str(store), "train")[1]
    assert (labels[:40] == 0).all() and (labels[40:] == 1).all()
    expected = [str(c) for c in range(-(-80 // rows_per_chunk))]
    assert _chunk_files(store, "train", "labels") == expected  # class-0 chunks too
    _every_command_reads(str(store), capsys)


def test_an_npz_sorted_by_label_and_a_zero_features_chunk(tmp_path, rng, capsys):
    """300 rows sorted by label with --rows-per-chunk 64 (the issue's second case); the first
    64 rows' features all zero as well."""
    _sorted_npz(tmp_path / "e.npz", rng, zero_rows=64)
    np.savez(tmp_path / "t.npz", features=rng.normal(size=(30, 6)).astype(np.float32),
             labels=np.arange(30) % 3, class_names=np.array(["a", "b", "c"]))
    store = tmp_path / "e.zarr"
    for data, split in (("e.npz", "train"), ("t.npz", "test")):
        assert cli.main(["extract", "--backbone", "none", "--data", f"npz:{tmp_path / data}",
                         "--split", split, "--out", str(store), "--rows-per-chunk", "64",
                         "--quiet"]) == 0
    for name in ("features", "labels"):
        assert _chunk_files(store, "train", name) == [f"{c}/0" if name == "features" else str(c)
                                                      for c in range(5)]
    features, labels, _ = extract.load_split(str(store), "train")
    assert (features[:64] == 0).all() and (labels[:64] == 0).all()
    _every_command_reads(str(store), capsys)


def _old_writer_store(store: str, rng, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    """A complete split written as dpprobe 0.1.0 wrote it: Zarr's default skips the chunks
    whose values all equal the fill value (here: labels chunk 0, features chunk 1)."""
    monkeypatch.setattr(writer_module, "_every_chunk_written", lambda array: array)
    features = rng.normal(size=(300, 7)).astype(np.float32)
    features[64:128] = 0.0
    labels = np.sort(rng.integers(0, 4, size=300))
    labels[:64] = 0
    split_writer = make_writer(store)
    fill(split_writer, features, labels)
    assert split_writer.finalize()
    split_writer.close()
    monkeypatch.undo()
    return features, labels


def test_a_store_written_the_old_way_opens_reads_and_verifies(tmp_path, rng, monkeypatch):
    store = tmp_path / "old.zarr"
    features, labels = _old_writer_store(str(store), rng, monkeypatch)
    assert "0" not in _chunk_files(store, "train", "labels")       # skipped by the old writer
    assert "1/0" not in _chunk_files(store, "train", "features")
    loaded, loaded_labels, _ = extract.load_split(str(store), "train")
    np.testing.assert_array_equal(loaded, features)
    np.testing.assert_array_equal(loaded_labels, labels)
    streamed = list(extract.iter_split_chunks(str(store), "train"))
    np.testing.assert_array_equal(np.concatenate([c[0] for c in streamed]), features)
    report = extract.verify_store(str(store), splits=("train",))
    assert report.ok, report.problems


def test_a_missing_chunk_that_held_data_is_still_damage(tmp_path, rng, monkeypatch):
    """The fill-chunk rule accepts exactly the chunks whose recorded sha256 is the fill's."""
    store = tmp_path / "old.zarr"
    _old_writer_store(str(store), rng, monkeypatch)
    os.remove(store / "train" / "labels" / "c" / "2")      # labels of rows 128:192, not fill
    for read in (lambda: extract.open_split(str(store), "train"),
                 lambda: extract.load_split(str(store), "train")):
        with pytest.raises(extract.DamagedStoreError,
                           match=r"train/labels: chunk 2 \(file c/2\) is missing"):
            read()
    problems = extract.verify_store(str(store), splits=("train",)).problems
    assert any("labels: chunk 2 (file c/2) is missing" in p for p in problems), problems


def test_a_fill_chunk_whose_sha256_was_not_the_fills_is_damage(tmp_path, rng, monkeypatch):
    """A missing features chunk of zeros is accepted only with the labels it was recorded with:
    the check hashes the rows Zarr reads (fill values) against the recorded sha256."""
    store = tmp_path / "old.zarr"
    _old_writer_store(str(store), rng, monkeypatch)
    import zarr

    group = zarr.open_group(str(store), mode="a")
    group["train/chunk_sha256"][1] = np.zeros(32, np.uint8) + 7  # another chunk's record
    with pytest.raises(extract.DamagedStoreError,
                       match=r"train/features: chunk 1 \(file c/1/0\) is missing"):
        extract.open_split(str(store), "train")


def test_resume_and_shards_count_chunks_by_their_done_flags(tmp_path, rng):
    """Resume reads `chunks_done`, not chunk files: a written chunk of fill values is done,
    and chunks not yet written are pending whatever their content will be."""
    store = str(tmp_path / "s.zarr")
    features = np.zeros((300, 7), np.float32)
    labels = np.zeros(300, np.int64)
    first = make_writer(store)
    fill(first, features, labels, chunks=[0, 2])
    first.close()
    again = make_writer(store)
    assert again.resumed and again.pending_chunks() == [1, 3, 4]
    fill(again, features, labels)
    assert again.finalize()
    again.close()
    assert _chunk_files(Path(store), "train", "labels") == ["0", "1", "2", "3", "4"]
    assert extract.verify_store(store, splits=("train",)).ok
