"""Checks a job makes before any long work: its output paths, its store's consistency, its
devices, optional packages.

dpprobe never deletes or changes a file it did not create, and never loses a finished job to an
output path it cannot write: every output path is checked when the job starts. An output may
be a new path, or an existing file that dpprobe wrote (results JSON, runs CSV, accuracy plot,
probe npz), which it replaces atomically; anything else (a folder, a device or fifo, the
user's own data) is refused, as is a path whose folder cannot be created or written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
import zipfile

from dpprobe import extract
from dpprobe import model as dpmodel
from dpprobe.model.format import safetensors_metadata
from dpprobe.model_files import probe_model_name
from dpprobe.timings import timings_path

__all__ = [
    "PNG_SOFTWARE",
    "check_demo_job",
    "check_output_paths",
    "check_probe_job",
    "check_timings_file",
    "check_tune_job",
    "require_module",
]

# Written into the PNG plots' metadata, so that a later run recognizes its own plot.
PNG_SOFTWARE = "dpprobe"


def require_module(module: str, option: str, install: str) -> None:
    """Refuse an option (a quoted field, "`ray=True`") whose optional package is missing, with
    the command that installs it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"{option} needs the optional package {module!r}: {install}")


def check_output_paths(**paths: str | os.PathLike | None) -> None:
    """Refuse output paths that cannot be written, before the job runs.

    Keyword names are the config fields (`out=path, csv=csv`), named in the errors; None is
    skipped.
    """
    for name, path in paths.items():
        if path is not None:
            _check_output_file(f"`{name}`", os.fspath(path))


def check_timings_file(out: str | os.PathLike | None) -> None:
    """The owner's timing file that a job writes beside its results file `out`
    (`dpprobe.timings`); nothing when there is no `out`."""
    if out is not None:
        _check_output_file("the timing file beside `out`:", os.fspath(timings_path(out)))


def _check_output_file(option: str, path: str) -> None:
    if path == "" or path.endswith(os.sep):
        raise ValueError(f"{option} {path!r} is not a file path")
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a folder; give a file path")
    if os.path.lexists(path):
        if not os.path.isfile(path) or os.path.islink(path):
            raise ValueError(f"{option} {path} exists and is not a regular file; dpprobe "
                             "replaces only files it wrote")
        if os.path.getsize(path) and not _written_by_dpprobe(path):
            raise ValueError(f"{option} {path} exists and was not written by dpprobe; choose "
                             "another path (dpprobe never replaces a file it did not create)")
    _check_folder_writable(option, os.path.dirname(path) or ".")


def _check_folder_writable(option: str, folder: str) -> None:
    """The folder exists and takes a new file, or its nearest existing ancestor is a folder
    that does (the job creates the missing folders). Tried with a real file: permissions,
    read-only mounts and root all answer truly."""
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        raise ValueError(f"{option}: {existing} is not a folder, so {folder} cannot be created")
    try:
        fd, probe_file = tempfile.mkstemp(prefix=".dpprobe-write-test-", dir=existing)
    except OSError as err:
        raise ValueError(f"{option}: folder {existing} is not writable ({err.strerror})") from err
    os.close(fd)
    os.remove(probe_file)


def _written_by_dpprobe(path: str) -> bool:
    """Whether an existing file is one of dpprobe's outputs (by content, not by name)."""
    with open(path, "rb") as f:
        head = f.read(8)
    with contextlib.suppress(Exception):
        if head.startswith(b"\x89PNG"):
            from PIL import Image  # imported when a PNG is found, not at the CLI's start

            with Image.open(path) as image:
                return image.info.get("Software") == PNG_SOFTWARE
        if head.startswith(b"PK"):  # an old probe npz, or a `dpprobe export --format torch`
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                return sorted(names) == ["b.npy", "w.npy"] or any(
                    n.endswith("dpprobe_export.json") for n in names)
        if dpmodel_file(path):
            return True
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 16)
        if text.lstrip().startswith("{"):
            with open(path, encoding="utf-8") as f:
                return "dpprobe_version" in json.load(f)
        header = text.splitlines()[0].split(",") if text else []
        return ("epsilon" in header and "test_accuracy" in header) or header[:3] == [
            "id", "prediction", "probability"]
    return False


def dpmodel_file(path: str) -> bool:
    """A model file (`dpmodel.format`), a timm state dict or an ONNX model that dpprobe wrote."""
    if dpmodel.is_model_file(path):
        return True
    if "dpprobe_export" in safetensors_metadata(path):
        return True
    if path.endswith(".onnx"):
        import onnx  # optional (dpprobe[onnx])

        proto = onnx.load(path, load_external_data=False)
        return any(p.key == "dpprobe_export" for p in proto.metadata_props)
    return False


def check_store_splits_agree(store) -> None:
    """Refuse a local store whose train and test splits come from different jobs (backbone,
    weights, preprocessing, feature dim, class list). Reads only the splits' metadata; other
    damage is found when the store is read."""
    attrs = {split: extract.local_split_attrs(store, split) for split in ("train", "test")}
    if all(attrs.values()):
        differ = extract.store.identity_differences(attrs["train"], attrs["test"])
        if differ:
            raise ValueError(f"{store}: train and test were extracted with a different "
                             f"{', '.join(differ)}; one store holds one job (re-extract one "
                             "split, or use another store)")


def check_probe_job(config) -> None:
    """What `run_probe` can check before reading its store (its `ProbeConfig` has checked the
    values): outputs, that the store's splits agree, that the devices are present."""
    check_output_paths(out=config.out, csv=config.csv, plot=config.plot,
                       diagnostics=config.diagnostics)
    check_timings_file(config.out)
    if config.save_model:
        check_model_folder(config)
    check_store_splits_agree(config.store)
    if config.devices is not None and config.devices > 1:
        import jax  # imported when devices are asked for, not at the CLI's start

        present = jax.local_device_count()
        if config.devices > present:
            raise ValueError(f"`devices={config.devices}`, but only {present} local device(s) "
                             "are present (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_"
                             "count=N makes N)")


def check_model_folder(config) -> None:
    """`probe --save-model DIR`: a folder (or a new path), and every model file it will hold
    writable (a file there that dpprobe did not write is refused)."""
    folder = os.fspath(config.save_model)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise ValueError(f"`save_model` {folder} is an existing file; give a folder")
    for epsilon in config.epsilons:
        for steps in config.steps or (None,):
            for rate in config.learning_rates or (None,):
                name = probe_model_name(config, epsilon, steps, rate)
                check_output_paths(save_model=os.path.join(folder, name))


def check_tune_job(config) -> None:
    """What `run_tune` can check before its search: the output paths, the store's splits."""
    check_output_paths(out=config.out, save_model=config.save_model)
    check_timings_file(config.out)
    check_store_splits_agree(config.store)


def check_demo_job(out_dir) -> None:
    """What `run_demo` can check before its extraction: the output folder."""
    out_dir = os.fspath(out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"`out_dir` {out_dir} is an existing file; the demo needs a folder")
    _check_folder_writable("`out_dir`", out_dir)
    check_output_paths(out_dir=os.path.join(out_dir, "results.json"))
