"""Hostile input for `dpprobe finetune` (issue 26): every case ends with exit status 2 and one
line naming the culprit, or a correct result (a publishing job nulls a bad record by the public
per-record rule, `extract.defects`, and completes); never a traceback or a hang; the user's
files byte-identical afterwards; nothing half-written that blocks the obvious retry.

The world: an image folder of PNGs (`imgs/train`, `imgs/test`), RGB image arrays
`train.npz` / `test.npz`, a Hugging Face folder `hf` (when `datasets` is installed). Runs are
tiny (the CNN at 16 px, 2 steps). The full disk, SIGKILL and concurrent cases run the CLI in
processes of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dpprobe.pipelines import cli
from tests.hostile_helpers import (
    assert_refused_untouched,
    bad_images,
    child,
    finish,
    kept_or_new,
    odd_images,
    one_line,
    run_case,
)
from tests.hostile_world import assert_one_line_error, png, snapshot, write

CLASSES = ["ant", "bee", "cat"]
FT = ["finetune", "--model", "cnn", "--batch-size", "16", "--steps", "2",
      "--physical-batch-size", "16", "--epsilon", "3", "--quiet"]
NPZ = ["--data", "npz:train.npz", "--test-data", "npz:test.npz"]
FOLDER = ["--data", "imagefolder:imgs/train", "--test-data", "imagefolder:imgs/test", "--crop",
          "16"]


def add_to_folder(world: Path, images: dict[str, bytes], split="train") -> None:
    for i, (name, data) in enumerate(sorted(images.items())):
        write(world / "imgs" / split / CLASSES[i % 3] / name, data)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile_finetune")
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for name in CLASSES:
            for i in range(count):
                png(root / "imgs" / split / name / f"{i}.png", rng)
    for name, rows in (("train.npz", 40), ("test.npz", 6)):  # RGB, as the folder: one compile
        np.savez(root / name, images=rng.integers(0, 256, (rows, 16, 16, 3), np.uint8),
                 labels=np.arange(rows) % 3, class_names=np.array(CLASSES))
    return root


# ----------------------------------------------------------------------------------------------
# The table: in-process cases


@dataclasses.dataclass
class Case:
    id: str
    argv: list[str]
    match: str | None  # the one line's regex; None: a correct result (exit 0)
    setup: Callable[[Path], None] | None = None
    num_train: int | None = None  # a correct result: N, every record counted (nulls included)


def _float_npz(world):
    """Float images with NaN and Inf pixels and out-of-range values, labels outside the class
    set and negative: each such record is nulled, N unchanged."""
    images = np.random.default_rng(2).random((40, 16, 16, 3)).astype(np.float32)
    images[3, 2, 2], images[4, 0, 0], images[5, 1, 1], images[9] = np.nan, np.inf, -np.inf, 7.0
    labels = np.arange(40) % 3
    labels[6], labels[7] = 7, -3
    np.savez(world / "train.npz", images=images, labels=labels, class_names=np.array(CLASSES))


def _one_class(world):
    for split in ("train", "test"):
        for name in CLASSES[1:]:
            shutil.rmtree(world / "imgs" / split / name)


def _hf(world, train_images: dict[str, bytes]):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=CLASSES)})
    good = [(world / "imgs/test" / c / f"{i}.png").read_bytes() for c in CLASSES for i in (0, 1)]

    def dataset(images):
        return datasets.Dataset.from_dict(
            {"image": [{"bytes": b, "path": None} for b in images],
             "label": [i % 3 for i in range(len(images))]}, features=features)

    train = good + list(train_images.values())
    datasets.DatasetDict(train=dataset(train), test=dataset(good)).save_to_disk(str(world / "hf"))


def _hf_hostile(world):
    rng = np.random.default_rng(4)
    _hf(world, odd_images(rng) | bad_images((world / "imgs/train/ant/0.png").read_bytes()))


def _finished_run(world):
    assert cli.main([*FT, *NPZ, "--out", "run"]) == 0


def _foreign_checkpoint(world):
    write(world / "mine/checkpoint/notes.txt", "the user's own checkpoint notes")


def _odd_folder(world):
    add_to_folder(world, odd_images(np.random.default_rng(3)))


def _bad_folder(world):
    add_to_folder(world, bad_images((world / "imgs/train/ant/0.png").read_bytes()))


def _null_test_record(world):
    write(world / "imgs/test/bee/corrupt.png", os.urandom(100))


CASES = [
    # --- a publishing job: a bad record is a null record, the run completes -------------------
    Case("modes-and-sizes-in-a-folder", [*FT, *FOLDER, "--out", "run"], None, _odd_folder, 18),
    Case("corrupt-truncated-and-bomb-images", [*FT, *FOLDER, "--out", "run"], None, _bad_folder,
         16),
    Case("nan-inf-pixels-and-labels-outside-the-classes", [*FT, *NPZ, "--out", "run"], None,
         _float_npz, 40),
    Case("hf-modes-sizes-corrupt-and-bombs", [*FT, "--data", "hf:hf", "--crop", "16", "--out",
                                              "run"], None, _hf_hostile, 16),
    # --- structural faults: refused, naming them ----------------------------------------------
    Case("empty-folder", [*FT, "--data", "imagefolder:empty", "--test-data",
                          "imagefolder:imgs/test", "--crop", "16"],
         r"empty has no class sub-folders", lambda w: (w / "empty").mkdir()),
    Case("one-class-folder", [*FT, *FOLDER], r"a classifier needs at least 2 classes, "
         "imagefolder:imgs/train declares 1", _one_class),
    Case("npz-without-rows", [*FT, "--data", "npz:none.npz", "--test-data", "npz:test.npz"],
         r"none.npz: images have shape \(0, 16, 16\)",
         lambda w: np.savez(w / "none.npz", images=np.zeros((0, 16, 16), np.uint8),
                            labels=np.zeros(0, int), class_names=np.array(CLASSES))),
    Case("unreadable-test-image", [*FT, *FOLDER], r"the test split \(public\) holds records .* "
         r"imgs/test", _null_test_record),
    Case("image-files-without-a-size", [*FT, "--data", "imagefolder:imgs/train", "--test-data",
                                        "imagefolder:imgs/test"], r"give the model's input size"),
    # --- --out ---------------------------------------------------------------------------------
    Case("out-is-the-npz-data", [*FT, *NPZ, "--out", "train.npz"], r"--out train.npz is the data "
         "train.npz"),
    Case("out-is-the-image-folder", [*FT, *FOLDER, "--out", "imgs/train"],
         r"--out imgs/train is the data imgs/train"),
    Case("out-inside-the-image-folder", [*FT, *FOLDER, "--out", "imgs/train/run"],
         r"--out imgs/train/run is inside the data imgs/train"),
    Case("out-inside-the-hf-folder", [*FT, "--data", "hf:hf", "--crop", "16", "--out", "hf/run"],
         r"--out hf/run is inside the data hf", lambda w: _hf(w, {})),
    Case("out-is-the-model-file", [*FT, *NPZ, "--out", "run/model.safetensors"],
         r"run/model.safetensors is not a folder", _finished_run),
    Case("out-holds-a-run-with-other-options", [*FT, *NPZ, "--steps", "3", "--out", "run"],
         r"run holds a finished finetune run with other options \(differs in: steps\)",
         _finished_run),
    Case("out-holds-a-foreign-checkpoint-folder", [*FT, *NPZ, "--out", "mine"],
         r"mine/checkpoint holds notes.txt, which dpprobe did not write", _foreign_checkpoint),
    Case("out-read-only", [*FT, *NPZ, "--out", "/proc/dpprobe-run"],
         r"--out: folder /proc is not writable"),
    Case("out-under-a-regular-file", [*FT, *NPZ, "--out", "test.npz/run"],
         r"--out test.npz/run is inside the data test.npz"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_finetune(case: Case, world: Path, capsys):
    code, err, before, after = run_case(case, world, capsys)
    if case.match is None:
        assert code == 0 and "Traceback" not in err, err
        results = json.loads((world / "run/results.json").read_text())
        assert results["data"]["num_train"] == case.num_train
        from dpprobe import model as dpmodel

        assert dpmodel.load_model(world / "run/model.safetensors").class_names == CLASSES[
            :results["data"]["num_classes"]]
        assert not (world / "run/checkpoint").exists()
        kept_or_new(before, after, "run/")
        return
    assert_refused_untouched(err, code, _Expect(case.match), before, after)


@dataclasses.dataclass
class _Expect:
    match: str
    code: int = 2


def test_a_second_run_is_refused_while_one_holds_the_out_folder(world, capsys):
    """The lock on --out is taken before the data is read: a run that holds it (here the test
    itself, as another process would) makes the next one refuse at once, naming it."""
    import fcntl

    (world / "run").mkdir()
    with open(world / "run/.dpprobe-finetune.lock", "w") as held:
        held.write("pid 4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        before = snapshot(world)
        assert cli.main([*FT, *NPZ, "--out", "run"]) == 2
        assert_one_line_error(capsys.readouterr().err, 2, _Expect(
            r"--out run is being written by pid 4242 \(another finetune run\)"))
        assert snapshot(world) == before
    assert cli.main([*FT, *NPZ, "--out", "run"]) == 0  # released: the retry runs


def test_a_refused_run_leaves_no_out_folder(world, capsys):
    assert cli.main([*FT, "--data", "npz:none.npz", "--test-data", "npz:test.npz", "--out",
                     "fresh"]) == 2
    assert not (world / "fresh").exists()


# ----------------------------------------------------------------------------------------------
# In processes of their own: a full disk, SIGKILL and a resume, two runs at once


def test_a_full_disk_is_one_line_and_the_retry_completes(world):
    """`ulimit -f`: a checkpoint, then the model file, cannot be written: one line naming it,
    nothing of the user's changed, no temporary file left; the retry completes."""
    before = snapshot(world)
    argv = [*FT, *NPZ, "--out", "run"]
    for every, size, match in (
            (1, 200_000, r"run/checkpoint: no room for a checkpoint of \d+ bytes \(File too "
                         r"large\)"),
            (100, 30_000, r"run/model.safetensors: File too large")):
        code, err = finish(child([*argv, "--checkpoint-every", str(every)], world,
                                 file_size=size))
        assert code == 2, err[-3000:]
        one_line(err, match)
        kept_or_new(before, snapshot(world), "run/")
        assert sorted(p.name for p in (world / "run").iterdir()) == [
            ".dpprobe-finetune.lock", "checkpoint"]  # nothing half-written
    assert cli.main([*argv, "--checkpoint-every", "100"]) == 0
    assert json.loads((world / "run/results.json").read_text())["privacy"]["plan"]["steps"] == 2


def _model_arrays(path: Path) -> dict:
    from dpprobe.model import read_model_file

    return read_model_file(path)[0]


def test_sigkill_mid_finetune_then_the_rerun_equals_an_uninterrupted_run(world, monkeypatch,
                                                                         capsys):
    """Killed after step 7's update (its last checkpoint: step 6), the same command resumes
    from step 6 and ends with the model an uninterrupted run makes, bit for bit, given the
    same test keys and sampler (the product draws both from OS entropy); the checkpoint with
    other options (--steps) is refused as another run's, in one line. The killed run is a
    process of its own (what is tested is a process that dies); the refused, the resumed and
    the uninterrupted run are the same command in this process."""
    import jax

    from dpprobe import finetune
    from dpprobe.finetune import checkpoint

    argv = [*FT, *NPZ, "--steps", "12", "--checkpoint-every", "3"]
    code, err = finish(child([*argv, "--out", "run"], world, test_keys=True, kill_at=7))
    assert code == -9, err[-3000:]
    assert not (world / "run/results.json").exists()
    assert sorted(p.name for p in (world / "run/checkpoint").iterdir()) == ["3", "6"]
    train = finetune.train_finetune  # the test keys and sampler, in this process (as CHILD's)
    monkeypatch.setattr(finetune, "train_finetune", lambda *a, **k: train(
        *a, **k | {"keys": jax.random.split(jax.random.key(7), 2),
                   "rng": np.random.default_rng(7)}))
    due, asked = checkpoint.Checkpointer.due, set()  # the steps this process trains
    monkeypatch.setattr(checkpoint.Checkpointer, "due",
                        lambda self, step: asked.add(step) or due(self, step))
    steps = argv.index("12")
    assert cli.main([*argv[:steps], "13", *argv[steps + 1:], "--out", "run"]) == 2
    one_line(capsys.readouterr().err, r"holds a checkpoint of another run \(differs in: [^)]*steps")
    assert not asked  # refused before any step
    assert cli.main([*argv, "--out", "run"]) == 0
    assert sorted(asked) == list(range(7, 13))  # resumed after step 6: steps 7 to 12 only
    assert not (world / "run/checkpoint").exists()
    assert json.loads((world / "run/results.json").read_text())["privacy"]["plan"]["steps"] == 12
    asked.clear()
    assert cli.main([*argv, "--out", "whole"]) == 0
    assert sorted(asked) == list(range(1, 13))
    resumed, whole = _model_arrays(world / "run/model.safetensors"), _model_arrays(
        world / "whole/model.safetensors")
    assert sorted(resumed) == sorted(whole)
    for name in whole:
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)


def test_two_runs_on_one_out_at_once(world):
    """Started together: one trains and the other is refused in one line naming it, or (if the
    first was done before the second looked) the second finds the run complete. Either way the
    folder holds one whole run, and the same command then says so and writes nothing."""
    argv = [*FT, *NPZ, "--steps", "30", "--checkpoint-every", "5", "--out", "run"]
    first = child(argv, world)
    deadline = time.monotonic() + 120
    while not (world / "run/.dpprobe-finetune.lock").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = child(argv, world)
    (code1, err1), (code2, err2) = finish(first), finish(second)
    assert code1 == 0, err1[-3000:]
    assert code2 in (0, 2), err2[-3000:]
    if code2 == 2:
        one_line(err2, r"--out run is being written by pid \d+ \(another finetune run\)")
    results = json.loads((world / "run/results.json").read_text())
    assert results["privacy"]["plan"]["steps"] == 30
    assert _model_arrays(world / "run/model.safetensors")
    done = snapshot(world)
    assert cli.main(argv) == 0
    assert snapshot(world) == done  # complete: nothing trained or written again
