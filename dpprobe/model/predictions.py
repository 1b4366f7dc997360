"""Predictions as CSV rows: a model's logits on an input, streamed chunk by chunk (one row
per input: id, prediction, probability, label when known, the top-k), with a progress bar and
the counts that give the accuracy (`dpprobe predict`)."""

from __future__ import annotations

import collections
import csv
import sys

import numpy as np

from dpprobe.extract import open_source
from dpprobe.model.model import load_model

__all__ = ["predict_examples", "take_rows", "write_rows"]


def write_rows(stream, model, source, columns, top_k: int, counts: dict,
               quiet: bool) -> None:
    """Stream the predictions of `model` on `source` as CSV rows into `stream`.

    Args:
      stream: a text stream (a file, stdout).
      model: the `dpprobe.Model`.
      source: the checked input (`model.inputs.open_input`): its chunks of (batch, ids,
        labels), its row count, whether it has labels.
      columns: the CSV header (id, prediction, probability, label when known, top-k pairs).
      top_k: the k of the top-k columns and accuracy.
      counts: {"rows", "top1", "topk"}, added to as rows are written.
      quiet: no progress bar.
    """
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
            ids, labels = take_rows(pending, len(logits))
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


def take_rows(pending: collections.deque, count: int):
    """The ids and labels of the next `count` rows of the chunks read.

    Args:
      pending: the (ids, labels) of the chunks read and not yet predicted, consumed here.
      count: how many rows.

    Returns:
      (ids, labels, or None when the input has none).
    """
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


def predict_examples(model_path: str, data: str, count: int) -> list[dict]:
    """The model's prediction for the first images of a data source's test split (public),
    beside their labels.

    Args:
      model_path: a model file that takes images.
      data: a data spec with a test split (digits, fashion-mnist, ...).
      count: how many images (at most the split's).

    Returns:
      One {"row", "prediction" (class name), "probability", "label"} per image.
    """
    model = load_model(model_path)
    test = open_source(data, split="test")["test"]
    rows = range(min(count, len(test)))
    probabilities = model.predict_proba(test.images(rows))
    return [{"row": row, "prediction": model.class_names[int(np.argmax(p))],
             "probability": float(np.max(p)), "label": test.class_names[int(test.labels[row])]}
            for row, p in zip(rows, probabilities, strict=True)]
