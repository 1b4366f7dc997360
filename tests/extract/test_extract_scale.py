"""Extraction at scale: resumable under SIGKILL, sharded, Ray, augmented views."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import zarr

from dpprobe import extract
from dpprobe.pipelines import cli

# A timm ViT at 32 px over digits' first 480 training images (an npz this module writes):
# ~2 s of extraction in 30 chunks.
ROWS, ROWS_PER_CHUNK = 480, 16
CHUNKS = ROWS // ROWS_PER_CHUNK
VIT = ["--backbone", "test_vit", "--random-init", "--crop", "32", "--split", "train",
       "--rows-per-chunk", str(ROWS_PER_CHUNK), "--batch-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """The extract command's options, its data included."""
    split = extract.open_source("digits")["train"]
    path = tmp_path_factory.mktemp("data") / "digits480.npz"
    np.savez(path, images=split.array[:ROWS], labels=split.labels[:ROWS],
             class_names=np.array(split.class_names))
    return [*VIT, "--data", f"npz:{path}"]


def _extract_cmd(vit, store, *extra):
    return [sys.executable, "-m", "dpprobe.pipelines.cli", "extract", *vit, "--out", str(store),
            *extra]


def _arrays(store, split="train"):
    features, labels, _ = extract.load_split(str(store), split, dtype=None)
    return features, labels


@pytest.fixture(scope="module")
def reference(tmp_path_factory, vit):
    """One uninterrupted run, in this process: the killed, sharded and Ray runs (the processes
    under test) must equal it bit for bit."""
    store = tmp_path_factory.mktemp("ref") / "ref.zarr"
    assert cli.main(["extract", *vit, "--out", str(store)]) == 0
    return _arrays(store)


def _done(store) -> int:
    try:
        return int(np.asarray(zarr.open_group(str(store), mode="r")["train/chunks_done"][:]).sum())
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def test_sigkill_at_random_points_then_resume_gives_identical_arrays(tmp_path, reference, vit):
    store = tmp_path / "killed.zarr"
    rng = random.Random(0)
    kills = 0
    for target in sorted(rng.sample(range(1, 21), 3)):
        child = subprocess.Popen(_extract_cmd(vit, store), start_new_session=True)
        deadline = time.time() + 300
        while _done(store) < target and child.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside a chunk, or between writes
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            kills += 1
        child.wait()
        if kills and _done(store) < CHUNKS:
            assert extract.split_attrs(str(store), "train")["complete"] is False
    assert kills >= 2
    assert cli.main(["extract", *vit, "--out", str(store)]) == 0  # the resume, in this process
    features, labels = _arrays(store)
    np.testing.assert_array_equal(features, reference[0])
    np.testing.assert_array_equal(labels, reference[1])
    assert extract.verify_store(str(store), splits=("train",)).ok


def test_three_shards_in_separate_processes_equal_one_run(tmp_path, reference, vit):
    store = tmp_path / "sharded.zarr"
    children = [subprocess.Popen(_extract_cmd(vit, store, "--shard", f"{k}/3")) for k in range(3)]
    assert [c.wait(timeout=600) for c in children] == [0, 0, 0]
    attrs = extract.split_attrs(str(store), "train")
    assert attrs["complete"] is True
    features, labels = _arrays(store)
    np.testing.assert_array_equal(features, reference[0])
    np.testing.assert_array_equal(labels, reference[1])


def test_shards_own_disjoint_chunk_ranges():
    parts = [extract.shard_chunks(23, (k, 3)) for k in range(3)]
    assert sorted(sum(parts, [])) == list(range(23))
    assert all(p == list(range(p[0], p[-1] + 1)) for p in parts)
    with pytest.raises(ValueError, match="0 <= k < n"):
        extract.shard_chunks(23, (3, 3))


def test_ray_extraction_on_a_local_cluster_equals_one_run(tmp_path, reference, vit):
    pytest.importorskip("ray")
    store = tmp_path / "ray.zarr"
    script = textwrap.dedent(f"""
        import ray
        from dpprobe.pipelines import cli
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        code = cli.main({json.dumps(['extract', *vit, '--out', str(store), '--ray',
                                     '--ray-shards', '3'])})
        ray.shutdown()
        raise SystemExit(code)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    features, labels = _arrays(store)
    np.testing.assert_array_equal(features, reference[0])
    np.testing.assert_array_equal(labels, reference[1])


def _digits_subset(n=40):
    split = extract.open_source("digits")["train"]
    return extract.ImageSplit("digits-subset", "train", split.labels[:n], split.class_names,
                              "subset", array=split.array[:n])


def test_views_have_the_right_shape_and_differ(tmp_path):
    backbone = extract.create_backbone("scatternet", resize=16, device="cpu")
    split = _digits_subset()
    store = str(tmp_path / "views.zarr")
    extract.extract_split(split, backbone, store, views=4, augment=("flip", "crop"),
                          dtype="float32", progress=False, batch_size=8)
    features, labels, attrs = extract.load_split(store, "train")
    assert features.shape == (40, 4, 81 * 4 * 4)
    assert attrs["preprocessing"]["views"] == 4
    assert attrs["preprocessing"]["augment"] == ["crop", "flip"]
    different = [not np.allclose(features[i, 0], features[i, 1]) for i in range(40)]
    assert np.mean(different) > 0.9
    # Augmentation is a function of (seed, row, view): a second run is identical.
    again = str(tmp_path / "again.zarr")
    extract.extract_split(split, backbone, again, views=4, augment=("flip", "crop"),
                          dtype="float32", progress=False, batch_size=5)
    np.testing.assert_array_equal(extract.load_split(again, "train")[0], features)
    # The test split is never augmented.
    test_split = extract.ImageSplit("digits-subset", "test", split.labels, split.class_names,
                                    "subset", array=split.array)
    extract.extract_split(test_split, backbone, store, views=4, augment=("flip", "crop"),
                          dtype="float32", progress=False)
    assert extract.load_split(store, "test")[0].shape == (40, 81 * 4 * 4)


def test_one_view_without_augmentation_equals_plain_extraction(tmp_path):
    backbone = extract.create_backbone("scatternet", device="cpu")
    split = _digits_subset()
    plain, single = str(tmp_path / "plain.zarr"), str(tmp_path / "single.zarr")
    extract.extract_split(split, backbone, plain, dtype="float32", progress=False)
    extract.extract_split(split, backbone, single, views=1, dtype="float32", progress=False)
    a, b = extract.load_split(plain, "train")[0], extract.load_split(single, "train")[0]
    assert b.shape == (40, 1, a.shape[1])
    np.testing.assert_array_equal(b[:, 0], a)


def test_augmentations_are_real_flips_and_crops():
    from PIL import Image

    image = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8))
    outs = {np.asarray(extract.augment_image(image, ("flip",), 0, 0, v)).tobytes()
            for v in range(16)}
    assert outs == {np.asarray(image).tobytes(), np.asarray(image)[:, ::-1].tobytes()}
    crops = [np.asarray(extract.augment_image(image, ("crop",), 0, 0, v)) for v in range(16)]
    assert all(c.shape == (8, 8) for c in crops) and len({c.tobytes() for c in crops}) > 3


def test_torch_dataset_through_the_python_api(tmp_path):
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.full((1, 8, 8), i / 12.0), i % 3

    with pytest.raises(ValueError, match="num_classes=K"):  # the class set is declared
        extract.from_torch_dataset(Squares(), name="squares")
    split = extract.from_torch_dataset(Squares(), name="squares", num_classes=3)
    assert split.labels.tolist() == [i % 3 for i in range(12)]
    backbone = extract.create_backbone("scatternet", device="cpu")
    store = str(tmp_path / "t.zarr")
    extract.extract_split(split, backbone, store, dtype="float32", progress=False)
    features, labels, attrs = extract.load_split(store, "train")
    assert features.shape == (12, 81 * 2 * 2) and attrs["dataset"]["name"] == "squares"
    assert attrs["dataset"]["fingerprint"].startswith("labels-only:")
