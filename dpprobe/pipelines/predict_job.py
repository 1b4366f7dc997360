"""The predict job: a released model (`dpmodel`) applied to a store split, a data spec or image
files, streamed chunk by chunk into a CSV (one row per input), with the accuracy when the input
has labels.

open the model -> open the input (checked against the model before anything is written) ->
stream: chunk -> logits (the job's own evaluation function) -> CSV rows -> accuracy.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
import os
import sys

import numpy as np

from dpprobe import checks, preflight
from dpprobe import model as dpmodel
from dpprobe.files import atomic_writer
from dpprobe.messages import log
from dpprobe.model import inputs as predict_inputs
from dpprobe.options import integer, option

__all__ = ["PredictConfig", "predict_line", "run_predict"]


@dataclasses.dataclass(frozen=True)
class PredictConfig:
    """What `run_predict` does; `dpprobe predict --help` explains each option.

    Attributes:
      model: a model file (probe --save-model, tune --save-model, finetune --out).
      data: one store path, one data spec as for `extract` (digits, fashion-mnist, npz:PATH,
        imagefolder:PATH, ...), or image files / a folder of images (no labels).
      split: the store's or the source's split (default test).
      out: the CSV (default: stdout).
      top_k: also write the k best classes and their probabilities (default 1: the prediction).
      weights: a copy of the backbone's weights file, where the recorded path is not on this
        machine (its sha256 must be the recorded one).
      data_dir: Fashion-MNIST's folder, as for `extract`.
    """

    model: str = option(help="a dpprobe model file")
    data: tuple[str, ...] = option(
        nargs="+", metavar="SPEC", help="a feature store, a data spec as for extract (digits, "
        "fashion-mnist, npz:PATH, imagefolder:PATH, ...), or image files / folders of images")
    split: str = option("test", help="the split of a store or data spec (default %(default)s)")
    out: str | None = option(None, help="write the CSV here (default: stdout)")
    top_k: int = option(1, type=integer, metavar="K", help="also write the K best classes and "
                        "their probabilities (default %(default)s)")
    weights: str | None = option(
        None, help="a copy of the backbone's weights file, where the recorded path is not on "
        "this machine (its sha256 must match the record)")
    data_dir: str | None = option(None, help="directory of Fashion-MNIST's gzipped IDX files")
    quiet: bool = option(False, action="store_true", help="no progress bar")

    def __post_init__(self):
        data = (self.data,) if isinstance(self.data, str | os.PathLike) else tuple(self.data)
        if not data:
            raise checks.ConfigError("data", "give a store, a data spec or image files")
        checks.freeze(self, model=os.fspath(self.model), data=tuple(os.fspath(d) for d in data))
        checks.check_int("top_k", self.top_k)


def run_predict(config: PredictConfig | str, /, **options) -> dict:
    """Predict with a model file: `run_predict(PredictConfig(...))` or
    `run_predict(model, data=..., ...)`. Writes the CSV (to `out`, else stdout) and returns
    {"rows", "accuracy" (None without labels), "top_k_accuracy", ...}."""
    config = checks.make_config(PredictConfig, config, "model", **options)
    model = dpmodel.load_model(config.model)
    model.weights = config.weights
    source = predict_inputs.open_input(config, model)
    if source.images and model.kind == "linear":  # torch and the backbone load: seconds
        log(f"predict: {source.num_rows} input(s) of {source.describe} through "
            f"{config.model}'s backbone", quiet=config.quiet)
    if config.out:
        preflight.check_output_paths(out=config.out)
        _refuse_overwriting(config.out, (config.model, *source.paths))
    top_k = min(config.top_k, len(model.class_names))
    columns = ["id", "prediction", "probability"] + (["label"] if source.has_labels else [])
    for k in range(2, top_k + 1):
        columns += [f"top{k}", f"top{k}_probability"]
    counts = {"rows": 0, "top1": 0, "topk": 0}
    if config.out:
        with atomic_writer(config.out) as binary:
            text = io.TextIOWrapper(binary, encoding="utf-8", newline="")
            _write_rows(text, model, source, columns, top_k, counts, config.quiet)
            text.flush()
            text.detach()
    else:
        _write_rows(sys.stdout, model, source, columns, top_k, counts, config.quiet)
    rows = counts["rows"]
    result = {"model": config.model, "data": source.describe, "rows": rows,
              "accuracy": counts["top1"] / rows if source.has_labels and rows else None,
              "top_k": top_k,
              "top_k_accuracy": counts["topk"] / rows if source.has_labels and rows else None,
              "reported": (model.document.get("training") or {}).get("reported"),
              "out": config.out}
    return result


def _write_rows(stream, model, source, columns, top_k: int, counts: dict,
                quiet: bool) -> None:
    from tqdm.auto import tqdm  # imported when rows are written, not at the CLI's start

    writer = csv.writer(stream)
    names = np.asarray(model.class_names, dtype=object)
    pending = collections.deque()  # (ids, labels) of chunks read but not yet predicted

    # The bar counts the rows the model has taken in (embedded, for images): its logits come
    # out in evaluation blocks of many chunks, at the end for a few hundred images. It opens
    # once the first chunk went through (the input fits the model: a refusal is one line).
    bar = None

    def batches():
        nonlocal bar
        for batch, ids, labels in source.chunks:
            pending.append((np.asarray(ids, dtype=object), labels))
            yield batch
            if bar is None:
                bar = tqdm(total=source.num_rows, unit="row", desc="predict", disable=quiet,
                           file=sys.stderr, dynamic_ncols=True)
            bar.update(len(ids))  # the model asked for the next chunk: this one is taken in

    header = False
    try:
        for logits in model.iter_logits(batches()):
            if not header:  # the first block went through: the input fits the model
                writer.writerow(columns)
                header = True
            ids, labels = _take(pending, len(logits))
            probabilities = model.probabilities(logits)
            order = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
            best = np.argmax(logits, axis=-1)
            for i in range(len(logits)):
                row = [ids[i], names[best[i]], f"{probabilities[i, best[i]]:.6g}"]
                if labels is not None:
                    row.append(names[labels[i]])
                for k in range(1, top_k):
                    row += [names[order[i, k]], f"{probabilities[i, order[i, k]]:.6g}"]
                writer.writerow(row)
            if labels is not None:
                counts["top1"] += int(np.sum(best == labels))
                counts["topk"] += int(np.sum((order == labels[:, None]).any(axis=1)))
            counts["rows"] += len(logits)
    finally:
        if bar is not None:
            bar.close()
    if not header:
        writer.writerow(columns)


def _take(pending: collections.deque, count: int):
    """The ids and labels of the next `count` rows of the chunks read."""
    ids, labels = [], []
    while count:
        chunk_ids, chunk_labels = pending[0]
        take = min(count, len(chunk_ids))
        ids.append(chunk_ids[:take])
        labels.append(None if chunk_labels is None else chunk_labels[:take])
        if take == len(chunk_ids):
            pending.popleft()
        else:
            pending[0] = (chunk_ids[take:], None if chunk_labels is None
                          else chunk_labels[take:])
        count -= take
    return np.concatenate(ids), (None if labels[0] is None else np.concatenate(labels))


def _refuse_overwriting(out: str, inputs) -> None:
    """`out` must not be the model or any input (or inside an input folder)."""
    target = os.path.realpath(out)
    for path in inputs:
        real = os.path.realpath(path)
        if target == real or target.startswith(real.rstrip(os.sep) + os.sep):
            raise ValueError(f"`out` {out} would overwrite {path}; choose another path")


def predict_line(result: dict) -> str:
    """One line after `dpprobe predict`: rows, accuracy when labelled, what the job reported."""
    text = f"predicted {result['rows']} rows of {result['data']}"
    if result["accuracy"] is not None:
        text += f": accuracy {100 * result['accuracy']:.2f}%"
        if result["top_k"] > 1:
            text += f", top-{result['top_k']} {100 * result['top_k_accuracy']:.2f}%"
        reported = result.get("reported") or {}
        if reported.get("test_accuracy") is not None:
            text += (f" (the training job reported {100 * reported['test_accuracy']:.2f}% on "
                     "its test split)")
    return text + (f"; wrote {result['out']}" if result.get("out") else "")
