"""The predict job: a released model (`dpmodel`) applied to a store split, a data spec or image
files, streamed chunk by chunk into a CSV (one row per input), with the accuracy when the input
has labels.

open the model -> open the input (checked against the model before anything is written) ->
stream: chunk -> logits (the job's own evaluation function) -> CSV rows -> accuracy.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys

from dpprobe import checks, preflight
from dpprobe import model as dpmodel
from dpprobe.files import atomic_writer
from dpprobe.messages import log
from dpprobe.model import inputs as predict_inputs
from dpprobe.model import predictions
from dpprobe.options import integer, option

__all__ = ["PredictConfig", "predict_line", "run_predict"]


# `dpprobe predict`'s parser texts (help, description, epilog).
TEXTS = dict(
    help="apply a model file to a store, a data spec or image files; write a CSV",
    description="One CSV row per input: id, prediction (class name), probability, label "
    "(when known) and the top-k. Prints the accuracy when the input has labels. A model "
    "on features given images runs its recorded backbone (weights sha256-checked).",
)


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
            predictions.write_rows(text, model, source, columns, top_k, counts, config.quiet)
            text.flush()
            text.detach()
    else:
        predictions.write_rows(sys.stdout, model, source, columns, top_k, counts, config.quiet)
    rows = counts["rows"]
    result = {"model": config.model, "data": source.describe, "rows": rows,
              "accuracy": counts["top1"] / rows if source.has_labels and rows else None,
              "top_k": top_k,
              "top_k_accuracy": counts["topk"] / rows if source.has_labels and rows else None,
              "reported": (model.document.get("training") or {}).get("reported"),
              "out": config.out}
    return result


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
