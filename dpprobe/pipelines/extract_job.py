"""The extract job: a frozen backbone over a data source into a feature store, locally, as one
shard of a multi-process job, or as Ray tasks."""

from __future__ import annotations

import dataclasses
from typing import Any

from dpprobe import checks, extract, options, preflight
from dpprobe.extract.job import extract_splits, extract_with_ray, report_line
from dpprobe.messages import log
from dpprobe.options import Choices, integer, num_classes_option, option

__all__ = ["ExtractConfig", "run_extract", "run_extract_ray"]


# `dpprobe extract`'s parser texts (help, description, epilog).
TEXTS = dict(
    help="run a frozen backbone over a dataset into a Zarr feature store",
    description="Embed a dataset with a frozen backbone and write STORE/{train,test}. "
    "Rerunning an interrupted command resumes from the last complete chunk.",
    epilog="Data specs: fashion-mnist, digits, npz:PATH (images, labels), "
    "imagefolder:PATH (one folder per class), cifar10:PATH, cifar100:PATH. "
    "Backbones: any timm model name (optionally .tag), scatternet, or none (npz:PATH "
    "holding features and labels).",
)


@dataclasses.dataclass(frozen=True)
class ExtractConfig:
    """What `run_extract` does; `dpprobe extract --help` explains each option.

    Sources with their own splits (fashion-mnist, digits, cifar) write both unless `split`
    names one; single-split sources (npz, imagefolder) write the split named by `split`
    (default "train") into a new or existing store. `shard=(k, n)` extracts one shard;
    `ray=True` runs the shards as Ray tasks (see `run_extract_ray`). `num_classes` declares
    the class count of a source without class names (an npz without `class_names`).
    """

    backbone: str = option(help="timm model name (e.g. vit_base_patch16_224.augreg_in21k), "
                           "'scatternet', or 'none' for precomputed embeddings")
    data: str | Any = option(help="data spec (see below)")  # or a torch Dataset (Python API)
    out: str = option(help="output Zarr store path")
    split: str | None = option(
        None, choices=("train", "test", "all"),
        help="split to write: for npz/imagefolder the name given to the data (default train); "
        "for multi-split sources, restrict to one (default all)")
    data_dir: str | None = option(
        None, help="directory of Fashion-MNIST's gzipped IDX files "
        "(default /usr/share/datasets/fashion-mnist)")
    weights: str | None = option(
        None, help="local .safetensors/.pth weights file for the timm model (no hub)")
    random_init: bool = option(False, action="store_true",
                               help="random weights (seeded by --seed); for tests only")
    seed: int = option(0, type=integer, help="seed of --random-init (default %(default)s)")
    resize: int | None = option(
        None, type=integer, help="resize the short side to R before cropping (Mehta et al.: "
        "384); without --crop, the model's input side is cropped, or the whole R x R image "
        "where R is smaller")
    crop: int | None = option(None, type=integer,
                              help="center-crop to S x S (Mehta et al.: 256); ViTs adapt their "
                              "position embeddings")
    batch_size: int = option(256, type=integer,
                             help="images per forward pass (default %(default)s)")
    dtype: str = option("float16", choices=Choices("dpprobe.extract.store", "FEATURE_DTYPES"),
                        help="feature dtype in the store (default %(default)s)")
    device: str | None = option(None, help="torch device (default: cuda if available)")
    rows_per_chunk: int | None = option(None, type=integer,
                                        help="rows per Zarr chunk (default: ~8 MiB chunks)")
    overwrite: bool = option(False, action="store_true",
                             help="replace an existing split written by a different job")
    progress: bool = option(True, "--quiet", action="store_false", help="no progress bar")
    num_workers: int | None = option(
        None, "--workers", type=integer, help="DataLoader worker processes (default: none on "
        "CPU, where the backbone uses every core; up to 8 on GPU)")
    amp: str | None = option("auto", choices=("auto", "off", "bf16", "fp16"),
                             help="autocast: auto = bf16 on CUDA, off on CPU (default auto)")
    channels_last: bool = option(False, action="store_true", help="channels_last memory format")
    compile: bool = option(False, action="store_true", help="torch.compile the backbone")
    shard: tuple[int, int] | None = option(
        None, type=options.shard, metavar="K/N",
        help="extract only shard K of N (a chunk-aligned slice of rows) into the same store, "
        "e.g. one process per GPU or a SLURM array task")
    views: int | None = option(
        None, type=integer, help="store K augmented views per example, shape (N, K, d), for "
        "augmentation multiplicity in the probe (train split only)")
    augment: tuple[str, ...] = option((), type=options.names, help=(
        f"augmentations of the views, from {','.join(options.AUGMENTATIONS)} (De et al.)"))
    augment_seed: int = option(0, type=integer,
                               help="seed of the augmentations (default %(default)s)")
    ray: bool = option(False, action="store_true",
                       help="run the shards as Ray tasks (one per GPU) on a Ray cluster")
    ray_address: str | None = option(
        None, help="Ray cluster address (default: RAY_ADDRESS, or a local cluster)")
    ray_shards: int | None = option(
        None, type=integer, help="number of shards with --ray (default: one per GPU, else per CPU)")
    num_classes: int | None = num_classes_option()

    def __post_init__(self):
        checks.freeze(self, augment=tuple(self.augment),
                   shard=None if self.shard is None else tuple(self.shard))
        checks.check_int("seed", self.seed, 0)
        checks.check_int("augment_seed", self.augment_seed, 0)
        checks.check_int("batch_size", self.batch_size)
        checks.check_optional_ints(self, ("resize", "crop", "rows_per_chunk", "views",
                                          "ray_shards", "num_classes"))
        checks.check_optional_ints(self, ("num_workers",), 0)
        if self.shard is not None:
            index, count = self.shard
            if not (count >= 1 and 0 <= index < count):
                raise checks.ConfigError("shard", f"K/N needs 0 <= K < N, got {index}/{count}")
        if self.views is not None and self.views > 1 and not self.augment:
            raise ValueError(f"`views={self.views}` without `augment` would store identical "
                             "views; add `augment=flip,crop`")
        if self.augment and self.views is None:
            raise ValueError("`augment` needs `views=K` (K augmented views per example)")
        if self.ray and self.shard is not None:
            raise ValueError("`ray` launches the shards itself; drop `shard`")
        if (self.ray_shards is not None or self.ray_address) and not self.ray:
            raise ValueError("`ray_shards`/`ray_address` need `ray=True`")
        if self.weights is not None and self.random_init:
            raise ValueError("`weights` and `random_init` exclude each other")


def run_extract(config: ExtractConfig | None = None, /, **options) -> list:
    """Extract embeddings of a data source into the feature store `config.out`.

    Takes an `ExtractConfig`, or its fields as keywords. `out` must be a new path or a dpprobe
    store: anything else is refused before any work. `data` is a data spec or, from Python,
    any torch `Dataset` of (image, label) pairs (`extract.from_torch_dataset`; its `classes`,
    or `num_classes`, declare the class list; `split` names its split). Returns one
    `ExtractReport` per split; with progress on, each also says how it ended.
    """
    config = checks.make_config(ExtractConfig, config, None, **options)
    extract.check_out_path(config.out)
    if config.ray:
        preflight.require_module("ray", "`ray=True`", "pip install ray==2.60.0")
        reports = run_extract_ray(config)
    else:
        reports = extract_splits(config, shard=config.shard)
    for report in reports:
        log(report_line(config.out, report, config.dtype), quiet=not config.progress)
    return reports


def run_extract_ray(config: ExtractConfig | None = None, /, **options) -> list:
    """Extract with one Ray task per shard (one per GPU when the cluster has GPUs).

    The driver creates the store's splits first (so shards never race to create them), then
    every task fills its chunk-aligned shard of each split in the same store, a shared
    filesystem path or fsspec URL that every node can reach. Finished chunks are never
    redone, so rerunning after a failure resumes. `config.ray_address` names the cluster and
    `config.ray_shards` the number of shards (default: one per GPU, else per CPU).
    """
    return extract_with_ray(checks.make_config(ExtractConfig, config, None, **options))
