"""The probe job's work on a feature store: its splits' attributes, the reads (in memory,
streamed, or a process's own rows), the sweep's cost, and every run trained and tested with the
driver its config asks for (in memory, streamed, Poisson-sampled, sharded, multi-process). The
command (`dpprobe.pipelines.probe_job`) calibrates, records and writes around it."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os

import numpy as np

from dpprobe import extract, probe
from dpprobe.multihost import processes
from dpprobe.probe import cost

__all__ = ["read_splits", "split_attrs", "sweep_cost", "too_big_for_memory", "train_and_test"]


def sweep_cost(config, train_attrs: dict, num_classes: int, stream: bool):
    """The sweep's estimated cost on this device, from public shapes (`probe.cost`).

    Args:
      config: the job's `ProbeConfig` (its epsilons, learning rates, seeds, devices).
      train_attrs: the train split's attributes.
      num_classes: the declared number of classes.
      stream: whether the train split is streamed from disk.

    Returns:
      `probe.cost.step_cost`'s estimate.
    """
    platform, cores = cost.local_device()
    num_runs = len(config.epsilons) * len(config.learning_rates or [None]) * config.seeds
    return cost.step_cost(int(train_attrs["num_examples"]),
                          math.prod(train_attrs["feature_shape"]), num_classes, num_runs,
                          platform=platform, cores=cores, devices=config.devices or 1,
                          streamed=stream)


def split_attrs(store) -> tuple[dict, dict]:
    """The attributes of the train and test splits (both must be complete).

    Args:
      store: the feature store.

    Returns:
      (train attributes, test attributes).
    """
    local = {split: extract.local_split_attrs(store, split) for split in ("train", "test")}
    if all(local.values()):
        train_attrs, test_attrs = local["train"], local["test"]
    else:  # or the error that says what is wrong
        train_attrs, test_attrs = (dict(extract.open_split(store, s).attrs)
                                   for s in ("train", "test"))
    if train_attrs["feature_shape"][-1] != test_attrs["feature_shape"][-1]:
        raise ValueError(f"train and test feature dims differ: {train_attrs['feature_shape']} "
                         f"vs {test_attrs['feature_shape']}")
    return train_attrs, test_attrs


def read_splits(store, *, stream: bool, test_in_memory: bool, num_examples: int):
    """The store reads of the probe job, read while JAX is imported.

    `import probe` is the first JAX import, so `dpprobe extract` never pays for it; Zarr
    decodes in its own threads meanwhile. A process of a multi-process job reads its own rows.

    Args:
      store: the feature store.
      stream: whether the train split streams from disk (then only its labels are read).
      test_in_memory: whether to read the test split now.
      num_examples: the train split's rows.

    Returns:
      (train features or None when streamed, train labels, test chunks or None when
      streamed).
    """
    if processes.active() and not stream:
        return (*_own_rows(store, num_examples),
                list(extract.iter_split_chunks(store, "test", dtype=None)) if test_in_memory
                else None)
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dpprobe-read") as pool:
        train_read = pool.submit(
            _stored_labels if stream else functools.partial(extract.load_split, dtype=None),
            store, "train",
        )
        # One array, not chunk by chunk: the whole-split read decodes in place (`extract.read`).
        test_read = pool.submit(lambda: [extract.load_split(
            store, "test", dtype=None)[:2]]) if test_in_memory else None
        import dpprobe.probe.train  # noqa: F401  (JAX, loaded while the threads read)

        if stream:
            train_x, train_y = None, train_read.result()
        else:
            train_x, train_y, _ = train_read.result()
        return train_x, train_y, test_read.result() if test_read else None


def train_and_test(config, spec, runs, train_x, train_y, test_chunks, *,
                    stream: bool, num_examples: int, dim: int):
    """The calls into `probe`: train every run with the driver the config asks for, evaluate on
    the test chunks (streamed when None).

    Args:
      config: the job's `ProbeConfig` (store, sampling, devices, quiet).
      spec: the `ProbeSpec`.
      runs: the `RunSpec` of every run.
      train_x, train_y: the train split in memory (features None when streamed).
      test_chunks: the test split's chunks, or None to stream them.
      stream: whether the train split streams from disk.
      num_examples: the train split's rows.
      dim: the feature dimension.

    Returns:
      (the `TrainResult`, the test metrics, the driver's description).
    """
    from dpprobe import dp  # JAX: imported when the job runs, not at the CLI's start

    keys = dp.make_keys(len(runs))
    progress = not config.quiet
    if config.sampling_probability < 1.0:
        driver = ("Poisson-sampled minibatches (masked DP-SGD, physical batch "
                  f"{config.physical_batch_size})")
        flags = probe.PerformanceFlags(physical_batch_size=config.physical_batch_size)
        result = probe.train_probe_poisson(train_x, train_y, runs, keys, spec, flags=flags,
                                           progress=progress)
    elif stream:
        driver = "full batch, streamed from disk"
        rows, flags = None, probe.PerformanceFlags()
        if processes.active():  # this process's rows, every chunk padded to the store's
            rows, flags = _process_rows(num_examples), probe.PerformanceFlags(
                rows_per_chunk=int(extract.open_split(config.store, "train")["features"]
                                   .chunks[0]))
            driver += f", rows split over {processes.count()} processes"
        groups = len(probe.plan_stream(runs, dim, spec.num_classes, budget=flags.memory_budget,
                                       chunk_rows=flags.rows_per_chunk).groups)
        if groups > 1:  # public: the number of runs and the store's shape
            driver += f", runs in {groups} groups (memory budget)"
        result = probe.train_probe_streaming(
            lambda: extract.iter_split_chunks(config.store, "train", dtype=None,
                                              row_range=rows), runs, keys,
            spec, num_examples=num_examples, dim=dim, flags=flags, progress=progress,
        )
    elif processes.active():  # every device of every process; each process holds its rows
        driver = f"full batch, in memory, rows split over {processes.count()} processes"
        result = probe.train_probe(train_x, train_y, runs, keys, spec, progress=progress,
                                   flags=probe.PerformanceFlags(mesh=probe.make_data_mesh()),
                                   num_examples=num_examples)
    else:
        devices = config.devices
        mesh = probe.make_data_mesh(devices) if devices and devices > 1 else None
        driver = "full batch, in memory" + (f", rows sharded over {devices} devices"
                                            if mesh else "")
        result = probe.train_probe(train_x, train_y, runs, keys, spec,
                                   flags=probe.PerformanceFlags(mesh=mesh), progress=progress)
    if test_chunks is None:  # streamed
        test_chunks = extract.iter_split_chunks(config.store, "test", dtype=None)
    metrics = probe.evaluate_chunks(result.params, test_chunks,
                                    normalization=spec.normalization, groups=spec.groups)
    return result, metrics, driver


def _process_rows(num_examples: int) -> tuple[int, int]:
    from dpprobe.dp.distributed import process_rows  # JAX, as above

    return process_rows(num_examples)


def _own_rows(store, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's train rows, padded with null rows (zero features, label -1: they
    contribute nothing) to ceil(N / processes), the same count on every process."""
    chunks = list(extract.iter_split_chunks(store, "train", dtype=None,
                                            row_range=_process_rows(num_examples)))
    features = np.concatenate([c[0] for c in chunks])
    labels = np.concatenate([c[1] for c in chunks]).astype(np.int32)
    padded = -(-num_examples // processes.count())
    return (np.concatenate([features, np.zeros((padded - len(labels), *features.shape[1:]),
                                               features.dtype)]),
            np.concatenate([labels, np.full(padded - len(labels), -1, np.int32)]))


def too_big_for_memory(num_bytes: int) -> bool:
    """Whether `num_bytes` exceed a quarter of this machine's memory (then the split streams).

    Args:
      num_bytes: the split's size.

    Returns:
      True when it should stream (False when the memory size is unknown).
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return False
    return num_bytes > total // 4


def _stored_labels(store, split) -> np.ndarray:
    return np.asarray(extract.open_split(store, split)["labels"][:], np.int32)
