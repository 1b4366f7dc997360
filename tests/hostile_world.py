"""The world of the hostile-input table (tests/pipelines/test_hostile.py) and what its cases use:
the world itself (an image folder of PNGs, `emb.npz` / `emb_test.npz` and the store `emb.zarr`
built from them with `--backbone none`), the hostile modifications a case makes to it, the
case record, and the check every case ends with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from dpprobe.pipelines import cli

CLASSES = np.array(["ant", "bee", "cat"])
NPZ = "npz:emb.npz"


# ----------------------------------------------------------------------------------------------
# The world
# ----------------------------------------------------------------------------------------------


def png(path: Path, rng, size=(16, 16), mode="RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


def extract_npz_split(data: str, out: str, split: str, *extra: str) -> int:
    return cli.main(["extract", "--backbone", "none", "--data", data, "--split", split,
                     "--out", out, "--rows-per-chunk", "16", "--quiet", *extra])


def build_world(root: Path) -> Path:
    """The world under `root`: PNGs in imgs/{train,test}/<class>/, emb.npz and
    emb_test.npz, and emb.zarr extracted from them (train and test)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 3), ("test", 2)):
        for name in CLASSES:
            for i in range(count):
                png(root / "imgs" / split / str(name) / f"{i}.png", rng)
    for name, rows in (("emb.npz", 60), ("emb_test.npz", 30)):
        np.savez(root / name, features=rng.normal(size=(rows, 8)).astype(np.float32),
                 labels=np.arange(rows) % 3, class_names=CLASSES)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert extract_npz_split(NPZ, "emb.zarr", "train") == 0
        assert extract_npz_split("npz:emb_test.npz", "emb.zarr", "test") == 0
    finally:
        os.chdir(cwd)
    return root



def snapshot(root: Path) -> dict[str, str]:
    """Every file (sha256) and folder under root; dpprobe's lock files aside."""
    found = {}
    for base, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(base, name), root) + "/"] = "dir"
        for name in files:
            if name.startswith(".dpprobe-") and name.endswith(".lock"):
                continue
            path = os.path.join(base, name)
            if os.path.islink(path) or not os.path.isfile(path):
                found[os.path.relpath(path, root)] = "special"
                continue
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


# ----------------------------------------------------------------------------------------------
# Hostile modifications
# ----------------------------------------------------------------------------------------------


def write(path, data: bytes | str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def savez(path, **arrays) -> None:
    np.savez(path, **arrays)


def edit_json(path, change: Callable[[dict], None]) -> None:
    meta = json.loads(Path(path).read_text())
    change(meta)
    Path(path).write_text(json.dumps(meta))


def feats(rows=20, dim=8, value=None):
    x = np.random.default_rng(1).normal(size=(rows, dim)).astype(np.float32)
    if value is not None:
        x[3, 2] = value
    return x


def holder_script() -> str:
    """A process that opens emb.zarr/train as a writer (the same job: it resumes) and waits."""
    return (
        "import sys, time\nfrom dpprobe import extract\n"
        "a = extract.split_attrs('emb.zarr', 'train')\n"
        "w = extract.SplitWriter('emb.zarr', 'train', num_rows=a['num_examples'], "
        "feature_shape=tuple(a['feature_shape']), dtype=a['dtype'], provenance={k: a[k] for k in "
        "('backbone', 'preprocessing', 'dataset')}, rows_per_chunk=a['rows_per_chunk'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )


def start_holder(world: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", holder_script()], cwd=world, env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    id: str
    argv: list[str] | Callable[[Path], list[str]]
    match: str  # regex the one-line message must match (names the culprit)
    code: int = 2
    setup: Callable[[Path], None] | None = None
    # After the command: check the world (default: byte-identical to before it ran).
    post: Callable[[Path, dict, dict], None] | None = None
    hide: tuple[str, ...] = ()  # optional packages to make missing
    timeout: float | None = None  # seconds the command may take


def unchanged(world, before, after):
    assert after == before, diff(before, after)


def diff(before, after) -> str:
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return f"changed: {changed[:10]}"


def store_accepts_retry(argv: list[str]):
    """Refused, nothing changed, and then the suggested retry works."""

    def post(world, before, after):
        unchanged(world, before, after)
        assert cli.main(argv) == 0

    return post


def probe(*extra: str) -> list[str]:
    return ["probe", "emb.zarr", "--quiet", "--epsilons", "1", "--seeds", "1", *extra]


def tune(*extra: str) -> list[str]:
    return ["tune", "emb.zarr", "--quiet", "--epsilon", "2", "--trials", "1",
            "--steps-choices", "2", *extra]


def extract_npz(data: str = NPZ, *extra: str, out: str = "new.zarr") -> list[str]:
    return ["extract", "--backbone", "none", "--data", data, "--out", out, "--quiet", *extra]


def extract_images(data: str = "imagefolder:imgs/train", *extra: str,
                   out: str = "img.zarr") -> list[str]:
    return ["extract", "--backbone", "scatternet", "--data", data, "--out", out, "--quiet",
            "--device", "cpu", *extra]


def timm_extract(*extra: str, data="imagefolder:imgs/train", out="img.zarr") -> list[str]:
    return ["extract", "--backbone", "test_resnet", "--data", data, "--out", out, "--quiet",
            "--device", "cpu", *extra]


def random_init_train(world):
    assert cli.main(timm_extract("--random-init", "--seed", "0")) == 0


def rm_file(path):
    def setup(world):
        os.remove(path)

    return setup


TRAIN_CHUNK = "emb.zarr/train/features/c/1/0"


def relabel_test(world):
    """A store edited by hand so that its test split declares other classes."""
    edit_json(world / "emb.zarr/test/zarr.json",
              lambda m: m["attributes"].__setitem__("class_names", ["x", "y", "z"]))


def save_weights(path: Path, name: str) -> None:
    import safetensors.torch
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=0)
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(path))


def assert_one_line_error(err: str, code: int, case: Case, out: str = "") -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == case.code, f"exit status {code}, stderr: {err}"
    assert "Traceback" not in err, err
    if case.code == 1:  # verify: its findings go to stdout, one PROBLEM line each
        assert re.search(case.match, out), out
        return
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    assert lines[0].startswith("dpprobe"), lines[0]
    assert re.search(case.match, lines[0]), f"{case.match!r} not in {lines[0]!r}"
