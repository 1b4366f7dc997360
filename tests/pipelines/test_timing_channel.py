"""Nothing published depends on a record through time (issue 47): a publishing job on D and on
D with one record changed so that it is slow to read (a large image; a store whose extraction
took longer) exits 0, prints the same and writes the same files but for DP outputs; no
published file holds a duration, a rate or a time of the run; the owner's timing file beside
the results has them (`dpprobe.timings`)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpprobe import model as dpmodel
from dpprobe.model import read_model_file
from dpprobe.pipelines import cli
from tests.pipelines.test_finetune_job import ALLOWED as FINETUNE_ALLOWED
from tests.pipelines.test_finetune_job import MODEL_ALLOWED as FINETUNE_MODEL_ALLOWED
from tests.pipelines.test_finetune_job import non_dp_leaves
from tests.test_privacy import ALLOWED, MODEL_ALLOWED

CLASSES = ("a", "b", "c", "d")
SLOW_ROW = 7  # the record made slow in D'

# A record's decoding and resizing cost grows with its pixels (the issue measured 4.6-6.7 s for
# one 39.6 MP JPEG in a folder of 500 images). The tests' cost model: 200,000 pixels a second,
# so the 512 x 512 image costs 1.3 s and a 16 x 16 one about 1 ms: slow, deterministic, fast.
PIXELS_PER_SECOND = 200_000
LARGE_SIDE = 512
# The store's record that is slow to extract (it stands in for a large image): its chunk takes
# this much longer, so D''s store is completed at least this much later than D's.
EXTRACT_DELAY = 1.1

# The audit's DP outputs: functions of its noised probes (README, `dpprobe audit`).
AUDIT_ALLOWED = [*ALLOWED, r"bounds\..*", r"claim_refuted", r"histogram\..*", r"tradeoff\..*"]
RESULTS_ALLOWED = {"finetune": FINETUNE_ALLOWED, "probe": ALLOWED, "tune": ALLOWED,
                   "audit": AUDIT_ALLOWED}
MODELS_ALLOWED = {"finetune": FINETUNE_MODEL_ALLOWED, "probe": MODEL_ALLOWED,
                  "tune": MODEL_ALLOWED}
CSV_DP_OUTPUTS = {"test_accuracy", "test_top5_accuracy"}

# A time of the run, as a key (a duration, a rate, a timestamp) or as printed text.
TIME_KEY = re.compile(r"seconds|per_second|created|completed|started|finished|timestamp|"
                      r"elapsed|duration", re.IGNORECASE)
TIME_TEXT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d|\w/s\b|\bseconds\b|\d s\b")

STORE_JOBS = {
    "probe": ["probe", "emb.zarr", "--epsilons", "1,4", "--seeds", "2", "--optimizer",
              "momentum", "--steps", "5", "--lr", "0.5", "--delta", "1e-4",
              "--out", "probe/results.json", "--csv", "probe/runs.csv", "--plot",
              "probe/accuracy.png", "--save-model", "probe/models", "--quiet"],
    "tune": ["tune", "emb.zarr", "--epsilon", "2", "--final-steps", "5", "--delta", "1e-4",
             "--out", "tune/results.json", "--save-model", "tune/tuned.safetensors",
             "--quiet"],
    "audit": ["audit", "emb.zarr", "--epsilon", "2", "--runs", "20", "--rows", "60",
              "--out", "audit/results.json", "--quiet"],
}
FINETUNE = ["finetune", "--model", "cnn", "--batch-size", "20", "--steps", "2",
            "--physical-batch-size", "16", "--lr", "0.5", "--epsilon", "2", "--delta", "1e-3",
            "--data", "imagefolder:imgs/train", "--test-data", "imagefolder:imgs/test",
            "--crop", "16", "--out", "finetune", "--quiet"]


@dataclasses.dataclass
class Run:
    """One job's exit status, what it printed, the files it published (by path in its output
    folder) and its owner's timing file (None if it wrote none)."""

    code: int
    out: str
    err: str
    files: dict[str, Path]
    owner: Path | None

    @property
    def timings(self) -> dict | None:
        return None if self.owner is None else json.loads(self.owner.read_text())


def _run(argv: list[str], folder: Path) -> Run:
    """`dpprobe ARGV` in this process, its stdout and stderr captured; `folder`: its outputs."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
             if p.is_file()}
    owners = [files.pop(name) for name in list(files) if name.endswith(".timings.json")]
    assert len(owners) <= 1, owners
    return Run(code, out.getvalue(), err.getvalue(), files, owners[0] if owners else None)


def _image_folder(root: Path, slow: bool) -> None:
    """imgs/{train,test}/CLASS/NN.png, 16 x 16 RGB; in D' (`slow`) train's SLOW_ROW is a
    LARGE_SIDE x LARGE_SIDE image (under the caps: a valid record, just slow to read)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 40), ("test", 20)):
        for row in range(count):
            folder = root / "imgs" / split / CLASSES[row % 4]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            if slow and split == "train" and row == SLOW_ROW:
                scale = LARGE_SIDE // 16
                pixels = np.kron(pixels, np.ones((scale, scale, 1), np.uint8))
            Image.fromarray(pixels).save(folder / f"{row:02d}.png")


@pytest.fixture(scope="module")
def finetune_runs(tmp_path_factory) -> tuple[Run, Run]:
    """`finetune` on an image folder D and on D with one image replaced by a large one, every
    image costing time in proportion to its pixels (PIXELS_PER_SECOND)."""
    import dpprobe.finetune.images  # noqa: F401 (loads the submodule)
    from dpprobe import finetune

    resize_and_crop = finetune.images.resize_and_crop

    def costly(image, *args, **kwargs):
        time.sleep(image.width * image.height / PIXELS_PER_SECOND)
        return resize_and_crop(image, *args, **kwargs)

    root, runs = tmp_path_factory.mktemp("timing_finetune"), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune.images, "resize_and_crop", costly)
        # A first run compiles the step, so that D's time and D''s differ by the record alone.
        for name, slow in (("compile", False), ("D", False), ("D_slow_record", True)):
            _image_folder(root / name, slow)
            patch.chdir(root / name)
            runs.append(_run(FINETUNE, root / name / "finetune"))
    return runs[1], runs[2]


def _store(directory: Path, features, labels) -> None:
    """emb.zarr from npz files in `directory` (the same relative paths for D and D')."""
    rng = np.random.default_rng(1)
    names = np.array(CLASSES)
    np.savez(directory / "emb.npz", features=features, labels=labels, class_names=names)
    np.savez(directory / "test.npz", features=rng.normal(size=(80, 16)).astype(np.float32),
             labels=rng.integers(0, 4, 80), class_names=names)
    for split, source in (("train", "emb.npz"), ("test", "test.npz")):
        assert cli.main(["extract", "--backbone", "none", "--data", f"npz:{source}",
                         "--split", split, "--out", "emb.zarr", "--dtype", "float32",
                         "--quiet"]) == 0


@pytest.fixture(scope="module")
def store_runs(tmp_path_factory) -> dict[str, tuple[Run, Run]]:
    """`probe`, `tune` and `audit` on a store of D and on one of D with row SLOW_ROW changed,
    whose extraction took EXTRACT_DELAY longer (the chunk holding the changed row)."""
    from dpprobe.extract.writer import SplitWriter

    write_chunk = SplitWriter.write_chunk

    def costly(self, chunk, features, labels):
        if np.abs(features).max() > 100:  # the changed record (every other is N(0, 1))
            time.sleep(EXTRACT_DELAY)
        return write_chunk(self, chunk, features, labels)

    rng = np.random.default_rng(0)
    features = rng.normal(size=(240, 16)).astype(np.float32)
    labels = rng.integers(0, 4, size=240)
    changed = features.copy()
    changed[SLOW_ROW] *= 1e3
    root, runs = tmp_path_factory.mktemp("timing_stores"), {job: [] for job in STORE_JOBS}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SplitWriter, "write_chunk", costly)
        for name, train in (("D", features), ("D_slow_record", changed)):
            (root / name).mkdir()
            patch.chdir(root / name)
            _store(root / name, train, labels)
            for job, argv in STORE_JOBS.items():
                runs[job].append(_run(argv, root / name / job))
    return {job: (d, d_slow) for job, (d, d_slow) in runs.items()}


def _pair(job: str, request) -> tuple[Run, Run]:
    if job == "finetune":
        return request.getfixturevalue("finetune_runs")
    return request.getfixturevalue("store_runs")[job]


def _masked(text: str, job: str) -> str:
    """Printed text with the DP outputs masked: finetune prints its accuracies; the reports of
    probe, tune and audit print DP outputs among public numbers, so every number is masked
    (their values are compared in the results files), signs included. Runs of spaces collapse to
    one: a table pads its columns to the width of the numbers in them, DP outputs included."""
    if job == "finetune":
        text = re.sub(r"\d+\.\d+%", "ACC%", text)
    else:
        text = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "#", text)
    return re.sub(r" +", " ", text)


def _csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in CSV_DP_OUTPUTS}
                for row in csv.DictReader(f)]


def _leaks(job: str, name: str, d: Path, d_slow: Path) -> list[str]:
    """The non-DP differences between one published file of the two runs."""
    if name.endswith(".json"):
        return non_dp_leaves(json.loads(d.read_text()), json.loads(d_slow.read_text()),
                             RESULTS_ALLOWED[job])
    if name.endswith(".safetensors"):  # the arrays are DP outputs; the description is not
        return non_dp_leaves(read_model_file(d)[1], read_model_file(d_slow)[1],
                             MODELS_ALLOWED[job])
    if name.endswith(".csv"):
        return [] if _csv_rows(d) == _csv_rows(d_slow) else ["the rows' public columns"]
    if name.endswith(".png"):  # the curves are DP outputs; the metadata is not
        with Image.open(d) as one, Image.open(d_slow) as other:
            return [] if one.info == other.info else [f"PNG metadata {one.info, other.info}"]
    return [] if d.read_bytes() == d_slow.read_bytes() else ["its bytes"]


@pytest.mark.parametrize("job", ["finetune", "probe", "tune", "audit"])
def test_a_slow_record_changes_nothing_published_but_dp_outputs(job, request):
    d, d_slow = _pair(job, request)
    assert d.code == 0 and d_slow.code == 0, d.err + d_slow.err
    assert _masked(d.out, job) == _masked(d_slow.out, job)
    assert d.err == d_slow.err
    assert d.files.keys() == d_slow.files.keys()
    for name in d.files:
        leaked = _leaks(job, name, d.files[name], d_slow.files[name])
        assert not leaked, f"{job}: {name}: non-DP differences between D and D': {leaked}"


def _keys(document, path=""):
    if isinstance(document, dict):
        for key, value in document.items():
            yield f"{path}.{key}" if path else key
            yield from _keys(value, f"{path}.{key}" if path else key)
    elif isinstance(document, list):
        for value in document:
            yield from _keys(value, f"{path}[*]")


@pytest.mark.parametrize("job", ["finetune", "probe", "tune", "audit"])
def test_no_published_file_holds_a_time_of_the_run(job, request):
    for run in _pair(job, request):
        assert not TIME_TEXT.search(run.out + run.err), run.out + run.err
        for name, path in run.files.items():
            if name.endswith(".safetensors"):
                document = read_model_file(path)[1]
            elif name.endswith(".json"):
                document = json.loads(path.read_text())
            else:
                text = (str(Image.open(path).info) if name.endswith(".png")
                        else path.read_text())
                assert not TIME_TEXT.search(text), f"{name}: {text[:400]}"
                continue
            timed = [k for k in _keys(document) if TIME_KEY.search(k.rsplit(".", 1)[-1])]
            assert not timed, f"{job}: {name} holds {timed}"
            assert not TIME_TEXT.search(json.dumps(document)), name


@pytest.mark.parametrize("job", ["finetune", "probe", "tune", "audit"])
def test_the_owners_timing_file_holds_what_the_results_do_not(job, request):
    d, d_slow = _pair(job, request)
    for run in (d, d_slow):
        assert run.owner is not None, f"{job} wrote no timing file beside its results"
        assert run.owner.name == "results.timings.json"  # beside results.json
        assert run.owner.stat().st_mode & 0o077 == 0  # the owner's only
        timings = run.timings
        assert timings["warning"].startswith("PRIVATE") and timings["job"] == job
        assert timings["wall_seconds"] > 0 and timings["finished"] >= timings["started"]
    if job == "finetune":
        # The channel is real, and it is here: the large record's cost (1.3 s) is in D''s time
        # alone. Half of it is the margin: the runs' own times vary by tenths of a second on a
        # loaded machine (D' once took 0.91 s longer than D, not the 1.0 s this asked).
        cost = LARGE_SIDE**2 / PIXELS_PER_SECOND
        assert d_slow.timings["wall_seconds"] > d.timings["wall_seconds"] + cost / 2
        assert d.timings["compile_seconds"] > 0 and d.timings["images_per_second"] > 0
    if job == "audit":
        assert 0 < d.timings["train_seconds"] <= d.timings["wall_seconds"]


def test_a_model_file_written_with_a_created_time_still_loads(store_runs, tmp_path):
    """Files written before the time was dropped from the header hold `created`: they load and
    predict as before."""
    new = store_runs["probe"][0].files["models/eps1.safetensors"]
    arrays, document = read_model_file(new)
    old = tmp_path / "old.safetensors"
    old.write_bytes(dpmodel.encode_model(arrays, document | {
        "created": "2024-05-01T12:00:00+00:00"}))
    features = np.random.default_rng(2).normal(size=(5, 16)).astype(np.float32)
    np.testing.assert_array_equal(dpmodel.load_model(old).predict_proba(features),
                                  dpmodel.load_model(new).predict_proba(features))


def test_a_folder_in_the_timing_files_place_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                       capsys):
    """The timing file is an output like the results: its path is checked when the job starts,
    so a finished job is never lost to it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.timings.json").mkdir()
    assert cli.main(["probe", "none.zarr", "--epsilons", "1", "--out", "r.json"]) == 2
    err = capsys.readouterr().err
    assert "the timing file beside --out: r.timings.json is a folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.timings.json"]
