"""Hostile inputs (issue 10): every bad input is one line on stderr, exit status 2, naming the
culprit, with no traceback; and the user's files are byte-identical afterwards, an existing
store unchanged when a command is refused, nothing half-written.

Each case runs in a fresh copy of a small world: an image folder of PNGs (`imgs/train`,
`imgs/test`), precomputed embeddings `emb.npz` / `emb_test.npz`, and the store `emb.zarr`
built from them with `--backbone none`. The CLI runs in-process (`cli.main`) unless the case
needs a process of its own (closed pipe, concurrent writer, SIGKILL).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import cli

CLASSES = np.array(["ant", "bee", "cat"])
NPZ = "npz:emb.npz"


# ----------------------------------------------------------------------------------------------
# The world
# ----------------------------------------------------------------------------------------------


def _png(path: Path, rng, size=(16, 16), mode="RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


def _extract_npz(data: str, out: str, split: str, *extra: str) -> int:
    return cli.main(["extract", "--backbone", "none", "--data", data, "--split", split,
                     "--out", out, "--rows-per-chunk", "16", "--quiet", *extra])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    rng = np.random.default_rng(0)
    for split, count in (("train", 3), ("test", 2)):
        for name in CLASSES:
            for i in range(count):
                _png(root / "imgs" / split / str(name) / f"{i}.png", rng)
    for name, rows in (("emb.npz", 60), ("emb_test.npz", 30)):
        np.savez(root / name, features=rng.normal(size=(rows, 8)).astype(np.float32),
                 labels=np.arange(rows) % 3, class_names=CLASSES)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert _extract_npz(NPZ, "emb.zarr", "train") == 0
        assert _extract_npz("npz:emb_test.npz", "emb.zarr", "test") == 0
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
        "import sys, time, extract\n"
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
    assert after == before, _diff(before, after)


def _diff(before, after) -> str:
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


def _random_init_train(world):
    assert cli.main(timm_extract("--random-init", "--seed", "0")) == 0


def _rm(path):
    def setup(world):
        os.remove(path)

    return setup


TRAIN_CHUNK = "emb.zarr/train/features/c/1/0"


def _relabel_test(world):
    """A store edited by hand so that its test split declares other classes."""
    edit_json(world / "emb.zarr/test/zarr.json",
              lambda m: m["attributes"].__setitem__("class_names", ["x", "y", "z"]))


CASES = [
    # --- --out of extract: a new path or a dpprobe store, nothing else (invariant 1) ---------
    Case("extract-out-is-the-image-folder-root", extract_npz(out="imgs"), r"--out imgs .*not a "
         "dpprobe feature store"),
    Case("extract-out-is-a-class-folder", extract_npz(out="imgs/train"),
         r"imgs/train .*not a dpprobe"),
    Case("extract-out-is-a-regular-file", extract_npz(out="emb.npz"),
         r"--out emb.npz is an existing file"),
    Case("extract-out-is-a-foreign-zarr-store", extract_npz(out="foreign.zarr"),
         r"foreign.zarr is a Zarr store not written by dpprobe",
         setup=lambda w: write(w / "foreign.zarr/zarr.json",
                               '{"zarr_format": 3, "node_type": "group", "attributes": {}}')),
    Case("extract-out-under-a-regular-file", extract_npz(out="emb.npz/store.zarr"),
         r"emb.npz/store.zarr: cannot create it"),
    Case("extract-out-in-a-read-only-folder", extract_npz(out="/proc/dpprobe-test.zarr"),
         r"/proc/dpprobe-test.zarr: cannot create it"),
    Case("extract-overwrite-into-a-data-folder", extract_npz(NPZ, "--overwrite", out="imgs"),
         r"--out imgs .*not a dpprobe"),
    Case("extract-overwrite-a-foreign-split", extract_npz(NPZ, "--overwrite", out="emb.zarr"),
         r"emb.zarr/train was not written by dpprobe",
         setup=lambda w: edit_json(w / "emb.zarr/train/zarr.json",
                                   lambda m: m["attributes"].pop("format"))),
    Case("extract-s3-url-without-s3fs", extract_npz(out="s3://bucket/emb.zarr"),
         r"s3:// URLs need the s3fs package; install it with `pip install s3fs`"),
    Case("extract-gs-url-without-gcsfs", extract_npz(out="gs://bucket/emb.zarr"),
         r"pip install gcsfs"),
    Case("extract-ray-without-ray", extract_npz(NPZ, "--ray"), r"--ray needs .*pip install",
         hide=("ray",)),
    # --- one store = one consistent job (invariant 2) ----------------------------------------
    Case("extract-train-other-job-without-overwrite",
         extract_npz("npz:emb_test.npz", "--split", "train", "--rows-per-chunk", "16",
                     out="emb.zarr"), r"emb.zarr/train was written by a different job"),
    Case("extract-test-with-another-class-list",
         extract_npz("npz:other_classes.npz", "--split", "test", "--overwrite", out="emb.zarr"),
         r"emb.zarr/train was extracted with a different class_names",
         setup=lambda w: savez(w / "other_classes.npz", features=feats(), labels=np.zeros(20, int),
                               class_names=np.array(["x", "y", "z"]))),
    Case("extract-test-with-another-feature-dim",
         extract_npz("npz:wide.npz", "--split", "test", "--overwrite", out="emb.zarr"),
         r"different feature_dim",
         setup=lambda w: savez(w / "wide.npz", features=feats(dim=9), labels=np.zeros(20, int),
                               class_names=CLASSES)),
    Case("extract-test-with-another-backbone",
         extract_images("imagefolder:imgs/test", "--split", "test", out="emb.zarr"),
         r"emb.zarr/train was extracted with a different backbone"),
    Case("extract-seed1-train-next-to-seed0-train",
         timm_extract("--random-init", "--seed", "1"), r"img.zarr/train was written by a "
         "different job", setup=_random_init_train),
    Case("extract-seed1-test-next-to-seed0-train",
         timm_extract("--random-init", "--seed", "1", "--split", "test",
                      data="imagefolder:imgs/test"),
         r"img.zarr/train was extracted with a different backbone", setup=_random_init_train),
    # --- one writer per split (invariant 3): see also test_concurrent_writer_* below ----------
    Case("extract-shard-with-overwrite", extract_npz(NPZ, "--shard", "0/2", "--overwrite",
                                                      out="emb.zarr"), r"--overwrite with --shard"),
    Case("extract-shard-out-of-range", extract_npz(NPZ, "--shard", "3/2"), r"--shard.*0 <= K < N"),
    Case("extract-ray-with-shard", extract_npz(NPZ, "--ray", "--shard", "0/2"),
         r"--ray launches the shards itself"),
    # --- damaged inputs: npz ------------------------------------------------------------------
    Case("npz-is-an-npy-file", extract_npz("npz:emb.npy"), r"emb.npy is a single .npy array",
         setup=lambda w: np.save(w / "emb.npy", feats())),
    Case("npz-random-bytes", extract_npz("npz:junk.npz"), r"junk.npz is not a readable .npz",
         setup=lambda w: write(w / "junk.npz", os.urandom(300))),
    Case("npz-zero-bytes", extract_npz("npz:empty.npz"), r"empty.npz is not a readable .npz",
         setup=lambda w: write(w / "empty.npz", b"")),
    Case("npz-truncated", extract_npz("npz:cut.npz"), r"cut.npz",
         setup=lambda w: write(w / "cut.npz", (w / "emb.npz").read_bytes()[:500])),
    Case("npz-missing", extract_npz("npz:nowhere.npz"), r"nowhere.npz does not exist"),
    Case("npz-is-a-folder", extract_npz("npz:imgs"), r"npz:imgs is not a file"),
    Case("npz-without-labels", extract_npz("npz:nolabels.npz"), r"nolabels.npz lacks arrays "
         r"\['labels'\]", setup=lambda w: savez(w / "nolabels.npz", features=feats())),
    Case("npz-features-of-width-0", extract_npz("npz:zero.npz"), r"zero.npz: features have "
         r"shape \(50, 0\)", setup=lambda w: savez(w / "zero.npz", features=np.zeros((50, 0)),
                                                  labels=np.zeros(50, int), class_names=CLASSES)),
    Case("npz-no-rows", extract_npz("npz:norows.npz"), r"norows.npz: features have shape",
         setup=lambda w: savez(w / "norows.npz", features=np.zeros((0, 4)),
                               labels=np.zeros(0, int), class_names=CLASSES)),
    Case("npz-features-1d", extract_npz("npz:flat.npz"), r"flat.npz: features must be float",
         setup=lambda w: savez(w / "flat.npz", features=np.zeros(20), labels=np.zeros(20, int),
                               class_names=CLASSES)),
    Case("npz-features-integer", extract_npz("npz:ints.npz"), r"ints.npz: features must be "
         "float", setup=lambda w: savez(w / "ints.npz", features=np.zeros((20, 4), int),
                                        labels=np.zeros(20, int), class_names=CLASSES)),
    Case("npz-object-arrays", extract_npz("npz:obj.npz"), r"obj.npz",
         setup=lambda w: savez(w / "obj.npz", features=np.array([None] * 20, object),
                               labels=np.zeros(20, int))),
    Case("npz-nan-features", extract_npz("npz:nan.npz"), r"nan.npz: features contain NaN or Inf "
         r"\(1 rows, the first is row 3\)",
         setup=lambda w: savez(w / "nan.npz", features=feats(value=np.nan),
                               labels=np.zeros(20, int), class_names=CLASSES)),
    Case("npz-nan-in-test-features", extract_npz("npz:nan.npz", "--split", "test"),
         r"nan.npz: features contain NaN",
         setup=lambda w: savez(w / "nan.npz", features=feats(value=np.nan),
                               labels=np.zeros(20, int), class_names=CLASSES)),
    Case("npz-inf-features", extract_npz("npz:inf.npz"), r"inf.npz: features contain NaN or Inf",
         setup=lambda w: savez(w / "inf.npz", features=feats(value=-np.inf),
                               labels=np.zeros(20, int), class_names=CLASSES)),
    Case("npz-float16-overflow-then-float32", extract_npz("npz:big.npz"),
         r"beyond float16 \(65504\); extract with --dtype float32",
         setup=lambda w: savez(w / "big.npz", features=feats(value=1e6),
                               labels=np.zeros(20, int), class_names=CLASSES),
         post=store_accepts_retry(extract_npz("npz:big.npz", "--dtype", "float32"))),
    Case("npz-float16-overflow-into-existing-store",
         extract_npz("npz:big.npz", "--split", "test", "--overwrite", out="emb.zarr"),
         r"beyond float16", setup=lambda w: savez(w / "big.npz", features=feats(value=1e6),
                                                  labels=np.zeros(20, int), class_names=CLASSES)),
    Case("npz-label-outside-class-names", extract_npz("npz:label5.npz"),
         r"label5.npz: labels must lie in \[0, 3\)",
         setup=lambda w: savez(w / "label5.npz", features=feats(),
                               labels=np.r_[np.zeros(19, int), 5], class_names=CLASSES)),
    Case("npz-without-class-names-nor-num-classes", extract_npz("npz:nonames.npz"),
         r"nonames.npz has no class_names: declare the classes with --num-classes K",
         setup=lambda w: savez(w / "nonames.npz", features=feats(), labels=np.zeros(20, int))),
    Case("npz-label-outside-num-classes", extract_npz("npz:nonames.npz", "--num-classes", "2"),
         r"nonames.npz: labels must lie in \[0, 2\)",
         setup=lambda w: savez(w / "nonames.npz", features=feats(),
                               labels=np.arange(20) % 3)),
    Case("npz-num-classes-disagrees-with-names", extract_npz(NPZ, "--num-classes", "4"),
         r"--num-classes 4 disagrees with npz:emb.npz"),
    Case("npz-num-classes-zero", extract_npz(NPZ, "--num-classes", "0"),
         r"--num-classes: must be >= 1"),
    Case("npz-negative-labels", extract_npz("npz:neg.npz"), r"neg.npz: labels must be "
         "non-negative integers", setup=lambda w: savez(
             w / "neg.npz", features=feats(), labels=-np.ones(20, int), class_names=CLASSES)),
    Case("npz-float-labels", extract_npz("npz:flabels.npz"), r"flabels.npz: labels must be "
         "non-negative integers", setup=lambda w: savez(
             w / "flabels.npz", features=feats(), labels=np.zeros(20), class_names=CLASSES)),
    Case("npz-label-count-mismatch", extract_npz("npz:short.npz"), r"short.npz: labels must be "
         r"\(N,\) with N=20", setup=lambda w: savez(
             w / "short.npz", features=feats(), labels=np.zeros(7, int), class_names=CLASSES)),
    Case("npz-empty-class-names", extract_npz("npz:nonames0.npz"), r"class_names must be a "
         "non-empty", setup=lambda w: savez(w / "nonames0.npz", features=feats(),
                                            labels=np.zeros(20, int), class_names=np.array([]))),
    Case("npz-images-for-backbone-none", extract_npz("npz:imgs.npz"), r"imgs.npz lacks arrays "
         r"\['features'\]", setup=lambda w: savez(
             w / "imgs.npz", images=np.zeros((4, 8, 8), np.uint8), labels=np.zeros(4, int))),
    Case("backbone-none-with-an-image-folder",
         ["extract", "--backbone", "none", "--data", "imagefolder:imgs/train", "--out", "x.zarr"],
         r"--backbone none needs an npz:PATH source"),
    # --- damaged inputs: images and datasets -------------------------------------------------
    Case("image-random-bytes", extract_images(), r"imgs/train/bee/bad.png is not a readable image",
         setup=lambda w: write(w / "imgs/train/bee/bad.png", os.urandom(200))),
    Case("image-zero-bytes", extract_images(), r"imgs/train/bee/empty.jpg is not a readable image",
         setup=lambda w: write(w / "imgs/train/bee/empty.jpg", b"")),
    Case("image-text-as-jpg", extract_images(), r"imgs/train/cat/notes.jpg is not a readable",
         setup=lambda w: write(w / "imgs/train/cat/notes.jpg", "hello, these are my notes\n")),
    Case("image-truncated-png", extract_images(), r"imgs/train/ant/0.png",
         setup=lambda w: write(w / "imgs/train/ant/0.png",
                               (w / "imgs/train/ant/0.png").read_bytes()[:-60])),
    Case("image-folder-with-an-empty-class", extract_images(), r"class folder imgs/train/dog "
         "holds no images", setup=lambda w: (w / "imgs/train/dog").mkdir()),
    Case("image-folder-of-non-images", extract_images(), r"class folder imgs/train/notes holds "
         "no images", setup=lambda w: write(w / "imgs/train/notes/a.txt", "text")),
    Case("image-folder-without-classes", extract_images("imagefolder:imgs/train/ant"),
         r"imgs/train/ant has no class sub-folders"),
    Case("image-folder-missing", extract_images("imagefolder:nowhere"),
         r"image folder nowhere does not exist"),
    Case("scatternet-mixed-sizes", extract_images(), r"imgs/train/cat/big.png \(32x32 RGB\).* "
         r"--resize R --crop S", setup=lambda w: _png(w / "imgs/train/cat/big.png",
                                                       np.random.default_rng(2), size=(32, 32))),
    Case("scatternet-1x1-image", extract_images(), r"imgs/train/cat/tiny.png \(1x1 RGB\)",
         setup=lambda w: _png(w / "imgs/train/cat/tiny.png", np.random.default_rng(2),
                              size=(1, 1))),
    Case("scatternet-grayscale-among-rgb", extract_images(), r"imgs/train/cat/gray.png \(16x16 "
         r"L\)", setup=lambda w: _png(w / "imgs/train/cat/gray.png", np.random.default_rng(2),
                                      mode="L")),
    Case("cifar10-random-byte-batches", ["extract", "--backbone", "none", "--data",
                                         "cifar10:cifar", "--out", "c.zarr"],
         r"--backbone none needs an npz", setup=lambda w: write(w / "cifar/data_batch_1", b"x")),
    Case("cifar10-random-bytes", extract_images("cifar10:cifar"),
         r"cifar/data_batch_1 is not a readable CIFAR pickle",
         setup=lambda w: [write(w / f"cifar/data_batch_{i}", os.urandom(100)) for i in range(1, 6)]
         + [write(w / "cifar/test_batch", os.urandom(100))]),
    Case("cifar10-wrong-dict", extract_images("cifar10:cifar"),
         r"cifar/data_batch_1 is not a CIFAR batch",
         setup=lambda w: [write(w / f"cifar/data_batch_{i}", pickle.dumps({"a": 1}))
                          for i in range(1, 6)] + [write(w / "cifar/test_batch", b"")]),
    Case("cifar10-missing-batch", extract_images("cifar10:cifar"),
         r"CIFAR batch cifar/data_batch_1 is missing", setup=lambda w: (w / "cifar").mkdir()),
    Case("cifar10-missing-folder", extract_images("cifar10:nowhere"),
         r"CIFAR directory nowhere does not exist"),
    Case("fashion-mnist-garbage-files", extract_images("fashion-mnist", "--data-dir", "fm"),
         r"fm/train-images-idx3-ubyte.gz is not a readable gzipped IDX file",
         setup=lambda w: [write(w / f"fm/{n}.gz", os.urandom(64)) for n in (
             "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")]),
    Case("fashion-mnist-wrong-content", extract_images("fashion-mnist", "--data-dir", "fm"),
         r"fm/train-images-idx3-ubyte.gz: sha256 .* not Fashion-MNIST",
         setup=lambda w: [write(w / f"fm/{n}.gz", gzip.compress(b"\0\0\x08\x01\0\0\0\x01x"))
                          for n in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]),
    Case("fashion-mnist-missing-folder", extract_images("fashion-mnist", "--data-dir", "nowhere"),
         r"Fashion-MNIST file nowhere/train-images-idx3-ubyte.gz is missing"),
    Case("unknown-data-source", extract_images("mnist"), r"unknown data source 'mnist'"),
    Case("npz-source-without-path", extract_images("npz"), r"data source 'npz' needs a path"),
    # --- backbones and weights ---------------------------------------------------------------
    Case("weights-garbage-safetensors", timm_extract("--weights", "garbage.safetensors"),
         r"--weights garbage.safetensors: could not load it into 'test_resnet'",
         setup=lambda w: write(w / "garbage.safetensors", b"\0garbage" * 10)),
    Case("weights-of-another-architecture", timm_extract("--weights", "vit.safetensors"),
         r"--weights vit.safetensors does not fit 'test_resnet'.*nothing was loaded",
         setup=lambda w: _save_weights(w / "vit.safetensors", "test_vit")),
    Case("weights-wrong-suffix", timm_extract("--weights", "emb.npz"),
         r"weights must be .safetensors or .pth, got emb.npz"),
    Case("weights-missing", timm_extract("--weights", "nowhere.pth"),
         r"weights file nowhere.pth does not exist"),
    Case("weights-and-random-init", timm_extract("--weights", "x.pth", "--random-init"),
         r"--weights and --random-init exclude each other"),
    Case("unknown-timm-model", ["extract", "--backbone", "no_such_net", "--data",
                                "imagefolder:imgs/train", "--out", "x.zarr", "--random-init"],
         r"unknown timm model 'no_such_net'"),
    Case("vit-crop-smaller-than-a-patch", ["extract", "--backbone", "test_vit", "--random-init",
                                           "--crop", "8", "--data", "imagefolder:imgs/train",
                                           "--out", "x.zarr", "--device", "cpu", "--quiet"],
         r"test_vit.*8"),
    Case("crop-larger-than-resize", timm_extract("--random-init", "--resize", "32", "--crop", "64"),
         r"crop \(64\) cannot exceed resize \(32\)"),
    Case("scatternet-with-weights", extract_images("imagefolder:imgs/train", "--weights", "w.pth"),
         r"scatternet has no weights"),
    # --- extract options ---------------------------------------------------------------------
    Case("rows-per-chunk-negative", extract_npz(NPZ, "--rows-per-chunk=-5"),
         r"--rows-per-chunk: must be >= 1, got -5"),
    Case("rows-per-chunk-zero", extract_npz(NPZ, "--rows-per-chunk", "0"),
         r"--rows-per-chunk: must be >= 1, got 0"),
    Case("batch-size-zero", extract_images("imagefolder:imgs/train", "--batch-size", "0"),
         r"--batch-size: must be >= 1, got 0"),
    Case("resize-zero", extract_images("imagefolder:imgs/train", "--resize", "0"),
         r"--resize: must be >= 1, got 0"),
    Case("workers-negative", extract_images("imagefolder:imgs/train", "--workers", "-1"),
         r"--workers: must be >= 0, got -1"),
    Case("views-without-augment", extract_images("imagefolder:imgs/train", "--views", "2"),
         r"--views 2 without --augment would store identical views"),
    Case("views-zero", extract_images("imagefolder:imgs/train", "--views", "0"),
         r"--views: must be >= 1, got 0"),
    Case("augment-without-views", extract_images("imagefolder:imgs/train", "--augment", "flip"),
         r"--augment needs --views K"),
    Case("augment-unknown", extract_images("imagefolder:imgs/train", "--views", "2", "--augment",
                                           "rotate"), r"unknown augmentations \['rotate'\]"),
    Case("ray-shards-without-ray", extract_npz(NPZ, "--ray-shards", "2"),
         r"--ray-shards/--ray-address need --ray"),
    Case("dtype-unknown", extract_npz(NPZ, "--dtype", "int8"), r"--dtype: invalid choice"),
    Case("split-unknown", extract_npz(NPZ, "--split", "valid"), r"--split: invalid choice"),
    # --- damaged stores (invariant 4) ----------------------------------------------------------
    Case("store-train-chunk-truncated", probe(), r"emb.zarr/train/features: chunk 1 \(rows "
         r"16:32\)", setup=lambda w: write(
             w / TRAIN_CHUNK, (w / TRAIN_CHUNK).read_bytes()[:40])),
    Case("store-train-chunk-random-bytes", probe(), r"emb.zarr/train/features: chunk 1",
         setup=lambda w: write(w / TRAIN_CHUNK, os.urandom(len((w / TRAIN_CHUNK).read_bytes())))),
    Case("store-train-chunk-deleted", probe(), r"emb.zarr/train/features: chunk 1 \(file c/1/0\) "
         "is missing", setup=_rm(TRAIN_CHUNK)),
    Case("store-train-chunk-deleted-streamed", probe("--stream"),
         r"emb.zarr/train/features: chunk 1 \(file c/1/0\) is missing", setup=_rm(TRAIN_CHUNK)),
    Case("store-test-labels-chunk-deleted", probe(), r"emb.zarr/test/labels: chunk 0 \(file c/0\) "
         "is missing", setup=_rm("emb.zarr/test/labels/c/0")),
    Case("store-chunk-not-marked-done", probe(), r"emb.zarr/train.* chunk 2",
         setup=_rm("emb.zarr/train/chunks_done/c/2")),
    Case("store-chunk-swapped", probe(), r"emb.zarr/train/features: chunk 1 .*sha256",
         setup=lambda w: write(w / TRAIN_CHUNK,
                               (w / "emb.zarr/train/features/c/0/0").read_bytes())),
    Case("store-train-zarr-json-truncated", probe(), r"emb.zarr/train/zarr.json",
         setup=lambda w: write(w / "emb.zarr/train/zarr.json",
                               (w / "emb.zarr/train/zarr.json").read_bytes()[:50])),
    Case("store-features-zarr-json-lies-about-shape", probe(),
         r"emb.zarr/train/features/zarr.json says .*\(64, 8\).*altered",
         setup=lambda w: edit_json(w / "emb.zarr/train/features/zarr.json",
                                   lambda m: m.__setitem__("shape", [64, 8]))),
    Case("store-features-zarr-json-deleted", probe(), r"emb.zarr/train/features: array metadata",
         setup=_rm("emb.zarr/train/features/zarr.json")),
    Case("store-root-zarr-json-deleted", probe(), r"emb.zarr",
         setup=_rm("emb.zarr/zarr.json")),
    Case("store-incomplete-split", probe(), r"emb.zarr/train is incomplete",
         setup=lambda w: edit_json(w / "emb.zarr/train/zarr.json",
                                   lambda m: m["attributes"].__setitem__("complete", False))),
    Case("store-missing", ["probe", "nowhere.zarr", "--quiet"], r"no feature store at nowhere"),
    Case("store-is-a-data-folder", ["probe", "imgs", "--quiet"], r"imgs"),
    Case("store-without-test-split", probe(), r"emb.zarr has no 'test' split",
         setup=lambda w: shutil.rmtree(w / "emb.zarr/test")),
    Case("store-s3-without-s3fs", ["probe", "s3://bucket/x.zarr", "--quiet"],
         r"pip install s3fs"),
    Case("store-http-without-backend", ["info", "http://example.invalid/x.zarr"],
         r"http:// URLs need the aiohttp package", hide=("aiohttp",)),
    Case("info-on-damaged-metadata", ["info", "emb.zarr"], r"emb.zarr/train/zarr.json",
         setup=lambda w: write(w / "emb.zarr/train/zarr.json", "{not json")),
    Case("info-on-a-data-folder", ["info", "imgs"], r"imgs is not a dpprobe feature store"),
    Case("store-splits-disagree-on-classes", probe(), r"emb.zarr: train and test were extracted "
         "with a different class_names", setup=_relabel_test),
    Case("tune-on-splits-that-disagree", tune(), r"train and test .*different class_names",
         setup=_relabel_test),
    Case("verify-splits-that-disagree", ["verify", "emb.zarr", "--quiet"],
         r"PROBLEM train and test differ in class_names", code=1,
         setup=_relabel_test),
    Case("verify-deleted-chunk", ["verify", "emb.zarr", "--quiet"],
         r"PROBLEM train: .*features: chunk 1 \(file c/1/0\) is missing", code=1,
         setup=_rm(TRAIN_CHUNK)),
    # --- probe options -------------------------------------------------------------------------
    Case("probe-steps-overflow", probe("--steps", "3000000000"),
         r"--steps: each must be in \[1, 10000000\], got 3000000000"),
    Case("probe-steps-zero", probe("--steps", "0"), r"--steps: each must be in \[1,"),
    Case("probe-steps-negative", probe("--steps=-2"), r"--steps: each must be in"),
    Case("probe-steps-empty", probe("--steps", ","), r"--steps: expected at least one integer"),
    Case("probe-epsilons-empty", ["probe", "emb.zarr", "--epsilons", ""],
         r"--epsilons: expected at least one number"),
    Case("probe-epsilons-nan", probe("--epsilons", "nan"), r"--epsilons: nan is not a value"),
    Case("probe-epsilon-negative", ["probe", "emb.zarr", "--epsilons=-1", "--quiet"],
         r"epsilon must be > 0"),
    Case("probe-epsilon-1e300", ["probe", "emb.zarr", "--epsilons", "1e300", "--quiet"],
         r"epsilon=1e\+300 .*beyond what the accountants resolve", timeout=20),
    Case("probe-epsilon-1e-300", ["probe", "emb.zarr", "--epsilons", "1e-300", "--quiet"],
         r"epsilon=1e-300 .*beyond what the accountants resolve", timeout=20),
    Case("probe-epsilon-1e300-poisson", ["probe", "emb.zarr", "--epsilons", "1e300", "-q", "0.5",
                                         "--quiet"], r"epsilon=1e\+300", timeout=20),
    Case("probe-delta-zero", probe("--delta", "0"), r"--delta: must be in \(0, 1\), got 0"),
    Case("probe-delta-one", probe("--delta", "1"), r"--delta: must be in \(0, 1\), got 1"),
    Case("probe-devices-beyond-present", probe("--devices", "64"),
         r"--devices 64, but only \d+ local device"),
    Case("probe-devices-zero", probe("--devices", "0"), r"--devices: must be >= 1, got 0"),
    Case("probe-groups-without-normalize-group", probe("--normalize", "l2", "--groups", "5"),
         r"--groups 5 needs --normalize group"),
    Case("probe-groups-alone-not-dividing-d", probe("--groups", "5"),  # alone: group norm
         r"groups must divide the feature dim 8, got 5"),
    Case("probe-groups-zero", probe("--normalize", "group", "--groups", "0"),
         r"--groups: must be >= 1, got 0"),
    Case("probe-bias-init-nan", probe("--bias-init", "nan"), r"--bias-init: expected a finite"),
    Case("probe-bias-init-inf", probe("--bias-init", "inf"), r"--bias-init: expected a finite"),
    Case("probe-seeds-zero", probe("--seeds", "0"), r"--seeds: must be >= 1, got 0"),
    Case("probe-seeds-huge", probe("--seeds", "100000000"), r"the sweep has 100000000 runs"),
    Case("probe-clip-norm-zero", probe("--clip-norm", "0"), r"--clip-norm: must be > 0, got 0"),
    Case("probe-clip-norm-inf", probe("--clip-norm", "inf"), r"--clip-norm: expected a finite"),
    Case("probe-q-zero", probe("-q", "0"), r"--sampling-probability/-q: must be in \(0, 1\]"),
    Case("probe-q-above-one", probe("-q", "1.5"), r"must be in \(0, 1\], got 1.5"),
    Case("probe-physical-batch-zero", probe("--physical-batch-size", "0"),
         r"--physical-batch-size: must be >= 1"),
    Case("probe-lr-zero", probe("--lr", "0"), r"--lr: expected finite numbers > 0"),
    Case("probe-lr-nan", probe("--lr", "nan"), r"--lr: nan is not a value"),
    Case("probe-unknown-optimizer", probe("--optimizer", "rmsprop"), r"--optimizer: invalid"),
    Case("probe-out-is-a-folder", probe("--out", "imgs"), r"--out imgs is a folder"),
    Case("probe-csv-is-a-folder", probe("--csv", "imgs/train"), r"--csv imgs/train is a folder"),
    Case("probe-out-under-a-regular-file", probe("--out", "emb.npz/results.json"),
         r"--out: emb.npz is not a folder"),
    Case("probe-out-read-only-folder", probe("--out", "/proc/results.json"),
         r"--out: folder /proc is not writable"),
    Case("probe-csv-read-only-folder", probe("--csv", "/proc/runs.csv"),
         r"--csv: folder /proc is not writable"),
    Case("probe-out-is-the-users-data", probe("--out", "emb.npz"),
         r"--out emb.npz exists and was not written by dpprobe"),
    Case("probe-plot-is-the-users-image", probe("--plot", "imgs/train/ant/0.png"),
         r"--plot imgs/train/ant/0.png exists and was not written by dpprobe"),
    Case("probe-out-is-a-fifo", probe("--out", "pipe"), r"--out pipe exists and is not a regular",
         setup=lambda w: os.mkfifo(w / "pipe")),
    # --- tune ----------------------------------------------------------------------------------
    Case("tune-steps-choices-negative", tune("--steps-choices=-3,5"),
         r"--steps-choices: each must be in \[1, 10000000\], got -3"),
    Case("tune-final-steps-zero", tune("--final-steps", "0"), r"--final-steps: must be in \[1,"),
    Case("tune-model-read-only-folder", tune("--model", "/proc/probe.npz"),
         r"--save-model: folder /proc is not writable"),
    Case("tune-model-under-a-regular-file", tune("--model", "emb.npz/probe.npz"),
         r"--save-model: emb.npz is not a folder"),
    Case("tune-out-is-a-folder", tune("--out", "imgs"), r"--out imgs is a folder"),
    Case("tune-epsilon-zero", ["tune", "emb.zarr", "--epsilon", "0"], r"--epsilon: must be > 0"),
    Case("tune-trials-zero", tune("--trials", "0"), r"--trials: must be >= 1"),
    Case("tune-validation-fraction", tune("--validation-fraction", "1.5"),
         r"--validation-fraction: must be in \(0, 1\)"),
    Case("tune-r-min-above-r-max", tune("--r-min", "10", "--r-max", "5"),
         r"--r-min/--r-max: the low end \(10\) must be below the high end \(5\)"),
    # tune: --groups alone means --normalize group (its normalization defaults to the backbone's)
    Case("tune-groups-not-dividing", tune("--groups", "3"),
         r"groups must divide the feature dim 8, got 3"),
    # --- account (no hangs, invariant 6) -------------------------------------------------------
    Case("account-epsilon-1000-q-half", ["account", "--epsilon", "1000", "-q", "0.5"],
         r"epsilon=1000 with q=0.5 .*below 0.3", timeout=10),
    Case("account-epsilon-100-q-half", ["account", "--epsilon", "100", "-q", "0.5"],
         r"epsilon=100 with q=0.5", timeout=10),
    Case("account-epsilon-1e300-q-half", ["account", "--epsilon", "1e300", "-q", "0.5"],
         r"epsilon=1e\+300", timeout=10),
    Case("account-epsilon-1e-300", ["account", "--epsilon", "1e-300"], r"epsilon=1e-300",
         timeout=10),
    Case("account-tiny-sigma-q-half", ["account", "--noise-multiplier", "0.01", "-q", "0.5"],
         r"noise multiplier 0.01 with q=0.5 is below 0.3", timeout=10),
    Case("account-sigma-negative", ["account", "--noise-multiplier=-1"],
         r"--noise-multiplier/--sigma: must be >= 0"),
    Case("account-steps-zero", ["account", "--epsilon", "1", "--steps", "0"],
         r"--steps: must be in \[1, 10000000\], got 0"),
    Case("account-q-zero", ["account", "--epsilon", "1", "-q", "0"], r"must be in \(0, 1\]"),
    Case("account-delta-zero", ["account", "--epsilon", "1", "--delta", "0"],
         r"--delta: must be in \(0, 1\)"),
    Case("account-nothing", ["account"], r"one of the arguments --epsilon"),
    # --- demo ----------------------------------------------------------------------------------
    Case("demo-out-is-a-regular-file", ["demo", "--out", "emb.npz", "--quiet"],
         r"--out emb.npz is an existing file"),
    Case("demo-seeds-zero", ["demo", "--seeds", "0", "--out", "d", "--quiet"],
         r"--seeds: must be >= 1, got 0"),
    Case("demo-out-under-a-regular-file", ["demo", "--out", "emb.npz/demo", "--quiet"],
         r"--out: emb.npz is not a folder"),
    # --- the CLI itself ------------------------------------------------------------------------
    Case("unknown-command", ["frobnicate"], r"invalid choice: 'frobnicate'"),
    Case("unknown-option", ["info", "emb.zarr", "--colour"], r"unrecognized arguments: --colour"),
]


def _save_weights(path: Path, name: str) -> None:
    import safetensors.torch
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=0)
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(path))


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


def test_the_table_is_large_enough():
    assert len(CASES) >= 80
    assert len({c.id for c in CASES}) == len(CASES)


# ----------------------------------------------------------------------------------------------
# Cases that need their own process, or a look at what was written
# ----------------------------------------------------------------------------------------------


def _run(argv, cwd, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, **kwargs)


def test_info_into_a_closed_pipe_is_quiet(world):
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "info", "emb.zarr"],
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

    import extract

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
    from probe import evaluate

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
    from pipelines.plots import accuracy_error_bars

    bars = accuracy_error_bars([99.0, 2.0, 50.0], [5.0, 5.0, 5.0])
    np.testing.assert_allclose(bars, [[5.0, 2.0, 5.0], [1.0, 5.0, 5.0]])


def test_verify_data_checks_the_split_the_data_belongs_to(world, capsys):
    assert cli.main(extract_images("imagefolder:imgs/train", "--split", "train")) == 0
    assert cli.main(extract_images("imagefolder:imgs/test", "--split", "test")) == 0
    capsys.readouterr()
    assert cli.main(["verify", "img.zarr", "--data", "imagefolder:imgs/test", "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out
    _png(world / "imgs/test/ant/9.png", np.random.default_rng(5))
    assert cli.main(["verify", "img.zarr", "--data", "imagefolder:imgs/test", "--quiet"]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and "PROBLEM test: dataset fingerprint" in problems[0], problems
    # Data that belongs to neither split is said so.
    assert cli.main(["verify", "img.zarr", "--data", "imagefolder:imgs/train/../test",
                     "--quiet"]) == 1
    assert "matches no split" in capsys.readouterr().out


def test_info_shows_the_random_init_seed(world, capsys):
    _random_init_train(world)
    capsys.readouterr()
    assert cli.main(["info", "img.zarr"]) == 0
    assert "random-init, seed 0" in capsys.readouterr().out


def test_the_readme_example_for_embeddings_works_as_written(world, capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    match = re.search(r"`(dpprobe extract --backbone none [^`]*)`", readme)
    assert match, "the README's 'Already have embeddings?' example"
    argv = match.group(1).split()[1:]
    assert "--out" in argv
    assert cli.main(argv + ["--quiet"]) == 0


def test_hidden_folders_are_not_classes(world, capsys):
    _png(world / "imgs/train/.ipynb_checkpoints/0.png", np.random.default_rng(3))
    _png(world / "imgs/train/ant/.thumbs/0.png", np.random.default_rng(3))
    assert cli.main(extract_images("imagefolder:imgs/train")) == 0
    import extract

    attrs = extract.split_attrs("img.zarr", "train")
    assert attrs["class_names"] == ["ant", "bee", "cat"] and attrs["num_examples"] == 9


@pytest.mark.parametrize("argv,setup,match", [
    (["account", "--epsilon", "1000", "-q", "0.5"], None, r"epsilon=1000 with q=0.5"),
    # A fresh `dpprobe probe` process reads the store while it imports JAX.
    (probe(), _rm(TRAIN_CHUNK), r"emb.zarr/train/features: chunk 1 \(file c/1/0\) is missing"),
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
