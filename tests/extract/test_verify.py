"""Verifying a store: every problem found and named, and the sha256 check every read makes."""

import numpy as np
import pytest
import zarr

from dpprobe import extract, pipelines
from dpprobe.extract.verify import check_chunk_sums
from dpprobe.pipelines import cli


def test_verify_catches_a_corrupted_chunk_and_a_missing_split(tmp_path, capsys):
    import shutil

    store = tmp_path / "small-chunks.zarr"
    pipelines.run_extract(backbone="scatternet", data="digits", out=str(store), rows_per_chunk=256,
                     progress=False)
    assert cli.main(["verify", str(store), "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out
    # Overwrite one chunk's values through Zarr (its recorded checksum no longer matches).
    group = zarr.open_group(str(store), mode="a")
    rows = group["train"].attrs["rows_per_chunk"]
    group["train/features"][rows:rows + 3] = 0.0
    report = extract.verify_store(str(store))
    assert not report.ok
    assert any("chunk 1" in p and "sha256" in p for p in report.problems)
    # A chunk file with garbage bytes is unreadable.
    chunk_file = store / "train" / "features" / "c" / "0" / "0"
    chunk_file.write_bytes(b"garbage")
    report = extract.verify_store(str(store))
    assert any("chunk 0" in p and "unreadable" in p for p in report.problems)
    # A missing split.
    shutil.rmtree(store / "test")
    assert cli.main(["verify", str(store), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "test: missing split" in out


def test_verify_compares_the_dataset_fingerprint(digits_store, capsys):
    assert cli.main(["verify", digits_store, "--data", "digits", "--quiet"]) == 0
    assert pipelines.verify(digits_store, data="digits", progress=False).ok
    assert cli.main(["info", digits_store]) == 0
    out = capsys.readouterr().out
    assert "scatternet" in out and "fingerprint" in out


def test_check_chunk_sums_names_the_chunk_at_its_place_in_the_split(rng):
    features = rng.normal(size=(150, 3)).astype(np.float32)
    labels = rng.integers(0, 4, size=150).astype(np.int32)
    sums = np.stack([np.frombuffer(extract.chunk_checksum(features[s:s + 64], labels[s:s + 64]),
                                   np.uint8) for s in range(0, 150, 64)])
    check_chunk_sums("s/train", sums, features, labels, 64)
    check_chunk_sums("s/train", sums, features[128:], labels[128:], 64, start=128)
    changed = features.copy()
    changed[140, 1] += 1
    with pytest.raises(extract.DamagedStoreError,
                       match=r"s/train/features: chunk 2 \(rows 128:150\) differs"):
        check_chunk_sums("s/train", sums, changed, labels, 64)
    with pytest.raises(extract.DamagedStoreError, match=r"chunk 2 \(rows 128:150\)"):
        check_chunk_sums("s/train", sums, changed[128:], labels[128:], 64, start=128)
    relabelled = labels.copy()
    relabelled[70] = (relabelled[70] + 1) % 4
    with pytest.raises(extract.DamagedStoreError, match=r"chunk 1 \(rows 64:128\)"):
        check_chunk_sums("s/train", sums, features, relabelled, 64)


def test_verify_report_text_and_json_say_each_split_and_problem():
    report = extract.VerifyReport(
        ["test: missing"],
        {"train": {"num_examples": 1438, "complete": True, "chunks_checked": 1, "bad_chunks": 0,
                   "nan_rows": 2},
         "valid": {"num_examples": 10, "complete": False, "chunks_checked": 3, "bad_chunks": 2}})
    assert report.text().splitlines() == [
        "train: 1438 examples, complete; 1 chunk checked, none bad; nan rows 2",
        "valid: 10 examples, INCOMPLETE; 3 chunks checked, 2 bad",
        "PROBLEM test: missing",
        "1 problem(s)",
    ]
    assert report.to_dict() == {"ok": False, "problems": ["test: missing"],
                                "splits": report.splits}
    assert extract.VerifyReport([], {}).text() == "OK"
    data = extract.DataReport("npz:x.npz", {"train": (3, [("row 1", extract.Defect(
        1, "null", "NaN"))])})
    assert data.to_dict() == {"ok": False, "spec": "npz:x.npz", "for": "the data's owner only",
                              "splits": {"train": {"records": 3, "changed": [
                                  {"record": "row 1", "kind": "null", "detail": "NaN"}]}}}
