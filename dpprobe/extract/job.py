"""The extract job's work: a frozen backbone over a data source into a feature store, every
split at once, as one shard of each, or as Ray tasks (one per shard). The command
(`dpprobe.pipelines.extract_job`) checks its output path and reports."""

from __future__ import annotations

import dataclasses
import os

from dpprobe import extract
from dpprobe.messages import log

__all__ = ["extract_splits", "extract_with_ray", "report_line"]


def extract_splits(config, *, shard=None, only_create: bool = False) -> list:
    """The calls into `extract`: open the data and the backbone, then extract every split (or
    create it, empty) and return their reports.

    Args:
      config: the job's `ExtractConfig`.
      shard: (k, n): extract the k-th of n chunk-aligned shards of each split; None: all.
      only_create: create the splits, empty (Ray's driver, before its tasks).

    Returns:
      One `ExtractReport` per split.
    """
    precomputed = config.backbone == "none"
    if isinstance(config.data, str):
        splits = extract.open_source(config.data, split=config.split, data_dir=config.data_dir,
                                     precomputed=precomputed, num_classes=config.num_classes)
    else:  # a torch Dataset (Python API)
        if precomputed:
            raise ValueError("`backbone=none` reads an npz of features, not a torch Dataset")
        name = config.split if config.split not in (None, "all") else "train"
        splits = {name: extract.from_torch_dataset(config.data, split=name,
                                                   num_classes=config.num_classes)}
    model = None
    if not precomputed:
        model = extract.create_backbone(
            config.backbone, weights=config.weights, random_init=config.random_init,
            seed=config.seed, resize=config.resize, crop=config.crop, device=config.device,
            mode=extract.image_mode_of(splits.values()) if config.backbone == "scatternet"
            else None,
        )
    return [
        extract.extract_split(
            data_split, model, config.out, split_name=name, batch_size=config.batch_size,
            dtype=config.dtype, rows_per_chunk=config.rows_per_chunk,
            overwrite=config.overwrite, progress=config.progress and not only_create,
            num_workers=config.num_workers, amp=config.amp,
            channels_last=config.channels_last, compile=config.compile, shard=shard,
            views=config.views, augment=config.augment, augment_seed=config.augment_seed,
            create_only=only_create,
        )
        for name, data_split in splits.items()
    ]


def _ray_shard(config, shard: tuple[int, int]) -> list:
    """One Ray task: extract one shard of every split (re-opening data and backbone there)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return extract_splits(dataclasses.replace(config, progress=False, overwrite=False),
                          shard=shard)


def extract_with_ray(config) -> list:
    """Extract with one Ray task per shard (one per GPU when the cluster has GPUs): the driver
    creates the store's splits, every task fills its chunk-aligned shard of each split, and the
    driver marks complete what is complete (`dpprobe.pipelines.extract_job.run_extract_ray`).

    Args:
      config: the job's `ExtractConfig` (`ray_address`, `ray_shards`, ...).

    Returns:
      One `ExtractReport` per split.
    """
    import ray  # optional (dpprobe[ray]), imported when Ray runs the job

    if not ray.is_initialized():
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    shards = config.ray_shards or max(1, gpus or int(resources.get("CPU", 1)))
    log(f"ray: {shards} shards on {resources}", not config.progress)
    # 1. Create every split (and validate the job) once, on the driver.
    created = extract_splits(config, shard=None, only_create=True)
    # 2. One task per shard.
    task = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1)(_ray_shard)
    results = ray.get([task.remote(config, (k, shards)) for k in range(shards)])
    # 3. Mark complete what is complete (the last shard usually already did); no need to load
    #    the data or the backbone again for that.
    reports = []
    for report in created:
        written = sum(r.chunks_written for shard in results for r in shard
                      if r.split == report.split)
        complete = extract.finalize_split(config.out, report.split)
        reports.append(dataclasses.replace(report, chunks_written=written, complete=complete))
    return reports


def report_line(out: str, report, dtype: str) -> str:
    """How one split's extraction ended, in plain words: written, resumed, or already there.

    Args:
      out: the store's path.
      report: the split's `ExtractReport`.
      dtype: the store's feature dtype.

    Returns:
      One line.
    """
    shard, done = report.shard, report.num_chunks - report.chunks_written
    chunks = f"{report.num_chunks} chunk{'s' if report.num_chunks != 1 else ''}"
    if report.chunks_written == 0 and report.complete:
        work = (f"{'all' if report.num_chunks > 1 else 'its'} {chunks} already extracted by an "
                "earlier run; reused, nothing to do")
    elif report.resumed and done:
        work = (f"resumed: {done} of {chunks} already extracted, {report.chunks_written} "
                "written now")
    else:
        work = f"{report.chunks_written}/{chunks} written"
    state = "complete" if report.complete else "INCOMPLETE"
    if shard is not None and not report.complete:
        state = "shard done; the split completes when every shard has run"
    return (f"{out}/{report.split}: {report.num_examples} x {report.feature_shape} ({dtype}), "
            f"{work}{f' by shard {shard[0]}/{shard[1]}' if shard else ''}, {state}")
