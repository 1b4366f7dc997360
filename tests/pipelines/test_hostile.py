"""Hostile inputs (issue 10): every bad input is one line on stderr, exit status 2, naming the
culprit, with no traceback; and the user's files are byte-identical afterwards, an existing
store unchanged when a command is refused, nothing half-written.

Each case runs in a fresh copy of a small world: an image folder of PNGs (`imgs/train`,
`imgs/test`), precomputed embeddings `emb.npz` / `emb_test.npz`, and the store `emb.zarr`
built from them with `--backbone none`. The CLI runs in-process (`cli.main`) unless the case
needs a process of its own (closed pipe, concurrent writer, SIGKILL). The world and the
table's helpers are tests/hostile_world.py; the table is tests/hostile_extract_cases.py and
tests/hostile_command_cases.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpprobe.pipelines import cli
from tests.hostile_command_cases import COMMAND_CASES
from tests.hostile_extract_cases import EXTRACT_CASES
from tests.hostile_world import (
    CLASSES,
    NPZ,
    TRAIN_CHUNK,
    Case,
    assert_one_line_error,
    build_world,
    extract_images,
    extract_npz,
    feats,
    png,
    probe,
    random_init_train,
    rm_file,
    savez,
    snapshot,
    start_holder,
    unchanged,
    write,
)

CASES = EXTRACT_CASES + COMMAND_CASES


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, world: Path, capsys, monkeypatch):
    if case.setup is not None:
        case.setup(world)
    for name in case.hide:
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    capsys.readouterr()
    before = snapshot(world)
    argv = case.argv(world) if callable(case.argv) else case.argv
    start = time.perf_counter()
    code = cli.main(list(argv))
    elapsed = time.perf_counter() - start
    captured = capsys.readouterr()
    assert_one_line_error(captured.err, code, case, captured.out)
    if case.timeout is not None:
        assert elapsed < case.timeout, f"took {elapsed:.1f} s"
    (case.post or unchanged)(world, before, snapshot(world))


def test_the_table_is_large_enough():
    assert len(CASES) >= 80
    assert len({c.id for c in CASES}) == len(CASES)


# ----------------------------------------------------------------------------------------------
# Cases that need their own process, or a look at what was written
# ----------------------------------------------------------------------------------------------


def _run(argv, cwd, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "dpprobe.pipelines.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, **kwargs)


def test_info_into_a_closed_pipe_is_quiet(world):
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-m", "dpprobe.pipelines.cli", "info", "emb.zarr"],
                             cwd=world, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # like `dpprobe info STORE | head -0`
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 141, err
    assert err == "", err


def test_concurrent_overwrite_is_refused_then_a_killed_writers_lock_is_stale(world, capsys):
    before = snapshot(world)
    holder = start_holder(world)
    try:
        code = cli.main(extract_npz("npz:emb_test.npz", "--overwrite", out="emb.zarr"))
        err = capsys.readouterr().err
        assert code == 2 and f"emb.zarr/train is being written by pid {holder.pid}" in err, err
        assert len(err.strip().splitlines()) == 1
        # A second writer of the same job (a resume) is refused as well.
        assert cli.main(extract_npz(NPZ, "--rows-per-chunk", "16", out="emb.zarr")) == 2
        assert snapshot(world) == before
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    # The killed writer left its lock file: stale, so the next writer takes the split.
    assert (world / "emb.zarr/.dpprobe-train.lock").exists()
    assert cli.main(extract_npz("npz:emb_test.npz", "--overwrite", "--rows-per-chunk", "16",
                                out="emb.zarr")) == 0
    assert "pid" in (world / "emb.zarr/.dpprobe-train.lock").read_text()


def test_a_refused_extraction_leaves_no_half_created_store(world, capsys):
    savez(world / "big.npz", features=feats(value=1e6), labels=np.zeros(20, int),
          class_names=CLASSES)
    (world / "empty").mkdir()
    for out in ("fresh.zarr", "empty"):
        assert cli.main(extract_npz("npz:big.npz", out=out)) == 2
    assert not (world / "fresh.zarr").exists()
    assert os.listdir(world / "empty") == []


def test_nan_test_rows_never_count_as_correct(world, capsys):
    """NaN features in a store's test split (checksums made to match) score as wrong."""
    import zarr

    from dpprobe import extract

    group = zarr.open_group(str(world / "emb.zarr"), mode="r+")
    test = group["test"]
    features = np.asarray(test["features"][:]).copy()
    labels = np.asarray(test["labels"][:])
    features[:10] = np.nan
    rows = test["features"].chunks[0]
    test["features"][:] = features
    for chunk, start in enumerate(range(0, len(labels), rows)):
        test["chunk_sha256"][chunk] = np.frombuffer(extract.chunk_checksum(
            features[start:start + rows], labels[start:start + rows]), np.uint8)
    assert cli.main(probe("--epsilons", "inf", "--out", "r.json", "--steps", "5",
                          "--optimizer", "sgd", "--lr", "1")) == 0
    runs = json.loads((world / "r.json").read_text())["runs"]
    assert all(run["test_accuracy"] <= 20 / 30 + 1e-9 for run in runs), runs


def test_bias_init_nan_in_the_api_scores_zero(world):
    """Even past the CLI, predictions with NaN logits are never correct."""
    from dpprobe.probe import evaluate

    params = {"w": np.zeros((1, 8, 3), np.float32), "b": np.full((1, 3), np.nan, np.float32)}
    x = np.ones((6, 8), np.float32)
    result = evaluate(params, x, np.arange(6) % 3)
    assert result["top1"][0] == 0 and result["top5"][0] == 0


def test_outputs_honour_the_umask_and_replace_only_dpprobe_files(world, capsys):
    old = os.umask(0o027)
    try:
        argv = probe("--out", "r.json", "--csv", "r.csv", "--plot", "r.png")
        assert cli.main(argv) == 0
        for name in ("r.json", "r.csv", "r.png"):
            assert (world / name).stat().st_mode & 0o777 == 0o640, name
        assert cli.main(argv) == 0  # its own outputs are replaced
    finally:
        os.umask(old)


def test_plot_error_bars_stay_within_0_and_100():
    from dpprobe.plots import accuracy_error_bars

    bars = accuracy_error_bars([99.0, 2.0, 50.0], [5.0, 5.0, 5.0])
    np.testing.assert_allclose(bars, [[5.0, 2.0, 5.0], [1.0, 5.0, 5.0]])


def test_verify_data_checks_the_split_the_data_belongs_to(world, capsys):
    assert cli.main(extract_images("imagefolder:imgs/train", "--split", "train")) == 0
    assert cli.main(extract_images("imagefolder:imgs/test", "--split", "test")) == 0
    capsys.readouterr()
    assert cli.main(["verify", "img.zarr", "--data", "imagefolder:imgs/test", "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out
    png(world / "imgs/test/ant/9.png", np.random.default_rng(5))
    assert cli.main(["verify", "img.zarr", "--data", "imagefolder:imgs/test", "--quiet"]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and "PROBLEM test: dataset fingerprint" in problems[0], problems
    # Data that belongs to neither split is said so.
    assert cli.main(["verify", "img.zarr", "--data", "imagefolder:imgs/train/../test",
                     "--quiet"]) == 1
    assert "matches no split" in capsys.readouterr().out


def test_info_shows_the_random_init_seed(world, capsys):
    random_init_train(world)
    capsys.readouterr()
    assert cli.main(["info", "img.zarr"]) == 0
    assert "random-init, seed 0" in capsys.readouterr().out


def test_the_docs_example_for_embeddings_works_as_written(world, capsys):
    page = (Path(__file__).resolve().parents[2] / "docs" / "your-data.md").read_text()
    match = re.search(r"`(dpprobe extract --backbone none [^`]*)`", page)
    assert match, "the docs' embeddings example (docs/your-data.md)"
    argv = match.group(1).split()[1:]
    assert "--out" in argv
    assert cli.main(argv + ["--quiet"]) == 0


def test_hidden_folders_are_not_classes(world, capsys):
    png(world / "imgs/train/.ipynb_checkpoints/0.png", np.random.default_rng(3))
    png(world / "imgs/train/ant/.thumbs/0.png", np.random.default_rng(3))
    assert cli.main(extract_images("imagefolder:imgs/train")) == 0
    from dpprobe import extract

    attrs = extract.split_attrs("img.zarr", "train")
    assert attrs["class_names"] == ["ant", "bee", "cat"] and attrs["num_examples"] == 9


@pytest.mark.parametrize("argv,setup,match", [
    (["account", "--epsilon", "1000", "-q", "0.5"], None, r"epsilon=1000 with q=0.5"),
    # A fresh `dpprobe probe` process reads the store while it imports JAX.
    (probe(), rm_file(TRAIN_CHUNK), r"emb.zarr/train/features: chunk 1 \(file c/1/0\) is missing"),
    (probe(), lambda w: write(w / TRAIN_CHUNK, os.urandom(300)), r"train/features: chunk 1"),
], ids=["account-absurd-epsilon", "probe-deleted-chunk", "probe-random-chunk"])
def test_one_line_in_a_fresh_process(world, argv, setup, match):
    if setup is not None:
        setup(world)
    before = snapshot(world)
    done = _run(argv, world)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(match, lines[0]), done.stderr
    assert snapshot(world) == before
