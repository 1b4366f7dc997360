"""Checking a feature store against what it recorded: every chunk's sha256, shapes, dtypes,
NaN/Inf, label range, completeness and the dataset fingerprint.

`verify_store` checks a whole store and lists every problem it finds (`dpprobe verify`);
`check_chunk_sums` is the sha256 check that every read of a split makes (`extract.read`),
raising `DamagedStoreError` at the first damaged chunk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np

from dpprobe.extract.sources import open_source, parse_data_spec
from dpprobe.extract.store import (
    FORMAT,
    check_chunk_files,
    chunk_checksum,
    identity_differences,
    store_summary,
)
from dpprobe.extract.zarr_io import (
    DamagedStoreError,
    StorePath,
    is_local,
    open_group,
    open_root,
    split_names,
)

__all__ = ["VerifyReport", "check_chunk_sums", "source_fingerprints", "verify_store"]


def check_chunk_sums(where: str, sums: np.ndarray, features: np.ndarray, labels: np.ndarray,
                     rows: int, *, start: int = 0) -> None:
    """Check rows `start:start + len(features)` of a split, whole chunks of `rows` rows each,
    against the sha256 recorded for each chunk when it was written (`sums`, one row of 32 bytes
    per chunk); raise `DamagedStoreError` naming the first chunk that differs.

    Several chunks are hashed in threads (hashlib releases the GIL on large buffers).
    """
    offsets = range(0, features.shape[0], rows)

    def differs(offset: int) -> bool:
        chunk = (start + offset) // rows
        return bytes(sums[chunk]) != chunk_checksum(features[offset:offset + rows],
                                                     labels[offset:offset + rows])

    if len(offsets) == 1:
        found = [differs(0)]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            found = pool.map(differs, offsets)
    for offset, wrong in zip(offsets, found, strict=True):
        if wrong:
            first = start + offset
            raise DamagedStoreError(
                f"{where}/features: chunk {first // rows} (rows {first}:"
                f"{first + min(rows, features.shape[0] - offset)}) differs from the sha256 "
                "recorded when it was written; the store is damaged (run `dpprobe verify`)")


@dataclasses.dataclass
class VerifyReport:
    """What `verify_store` found: `problems` is empty for a sound store."""

    problems: list[str]
    splits: dict[str, dict]

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        """What `dpprobe verify` prints: each split, each problem, and the verdict."""
        lines = [f"{split}: {_split_check(info)}" for split, info in self.splits.items()]
        lines += [f"PROBLEM {problem}" for problem in self.problems]
        lines.append("OK" if self.ok else f"{len(self.problems)} problem(s)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """`dpprobe verify --json`: the verdict, the problems and each split's findings."""
        return {"ok": self.ok, "problems": list(self.problems), "splits": self.splits}


def _split_check(info: dict) -> str:
    """'1438 examples, complete; 1 chunk checked, none bad' (what `verify_store` saw)."""
    parts = [f"{info.get('num_examples')} examples, "
             + ("complete" if info.get("complete") else "INCOMPLETE")]
    if "chunks_checked" in info:
        checked, bad = info["chunks_checked"], info.get("bad_chunks", 0)
        parts.append(f"{checked} chunk{'s' * (checked != 1)} checked, "
                     + (f"{bad} bad" if bad else "none bad"))
    parts += [f"{key.replace('_', ' ')} {value}" for key, value in info.items()
              if key not in ("num_examples", "complete", "chunks_checked", "bad_chunks")]
    return "; ".join(parts)


def verify_store(store: StorePath, *, splits: Sequence[str] = ("train", "test"),
                 fingerprints: dict[str, str] | None = None,
                 progress: Callable[[str, int, int], object] | None = None) -> VerifyReport:
    """Check a store: splits present and complete, shapes, NaN/Inf, label range, checksums.

    Args:
      store: store path.
      splits: the splits that must be present.
      fingerprints: optional {split: dataset fingerprint} recomputed from the source data;
        each must equal the one recorded at extraction.
      progress: optional callable(split, chunk, num_chunks) for a progress display.
    """
    problems: list[str] = []
    summary: dict = {}
    try:
        root = open_root(store, "r")
        if dict(root.attrs).get("format") != FORMAT:
            return VerifyReport([f"{store} is not a dpprobe feature store"], {})
        present = split_names(root, store)
    except (FileNotFoundError, DamagedStoreError) as err:
        return VerifyReport([str(err)], {})
    identities = {}
    for split in splits:
        if split not in present:
            problems.append(f"{split}: missing split")
            continue
        try:
            group = open_group(root, store, split)
        except DamagedStoreError as err:
            problems.append(f"{split}: {err}")
            continue
        attrs = dict(group.attrs)
        identities[split] = attrs
        info = {"num_examples": attrs.get("num_examples"), "complete": attrs.get("complete")}
        summary[split] = info
        try:
            features, labels = group["features"], group["labels"]
            done = np.asarray(group["chunks_done"][:])
            sums = np.asarray(group["chunk_sha256"][:])
        except Exception as err:  # noqa: BLE001 - any read failure is a finding
            problems.append(f"{split}: arrays unreadable ({type(err).__name__}: {err})")
            continue
        num = attrs.get("num_examples")
        if features.shape != (num, *attrs.get("feature_shape", [])):
            problems.append(f"{split}: features shape {features.shape} != recorded "
                            f"({num}, {attrs.get('feature_shape')})")
        if labels.shape != (num,):
            problems.append(f"{split}: labels shape {labels.shape} != ({num},)")
        if str(features.dtype) != attrs.get("dtype"):
            problems.append(f"{split}: dtype {features.dtype} != recorded {attrs.get('dtype')}")
        if not attrs.get("complete"):
            problems.append(f"{split}: incomplete ({int(done.sum())}/{done.size} chunks done)")
        elif not done.all():
            problems.append(f"{split}: marked complete but chunks {np.flatnonzero(done == 0)} "
                            "are not done")
        rows = attrs.get("rows_per_chunk") or features.chunks[0]
        if is_local(store) and attrs.get("complete"):
            try:
                check_chunk_files(group, store, split)
            except DamagedStoreError as err:
                problems.append(f"{split}: {err}")
        num_classes = attrs.get("num_classes")
        bad_chunks = 0
        for chunk in np.flatnonzero(done):
            start, stop = chunk * rows, min((chunk + 1) * rows, features.shape[0])
            if progress:
                progress(split, int(chunk), done.size)
            try:
                block = np.asarray(features[start:stop])
                block_labels = np.asarray(labels[start:stop])
            except Exception as err:  # noqa: BLE001
                problems.append(f"{split}: chunk {chunk} (rows {start}:{stop}) unreadable "
                                f"({type(err).__name__})")
                bad_chunks += 1
                continue
            if not np.isfinite(block).all():
                problems.append(f"{split}: chunk {chunk} (rows {start}:{stop}) has NaN/Inf")
                bad_chunks += 1
            if num_classes and block_labels.size and (
                    block_labels.min() < 0 or block_labels.max() >= num_classes):
                problems.append(f"{split}: chunk {chunk} has labels outside [0, {num_classes})")
                bad_chunks += 1
            if bytes(sums[chunk]) != chunk_checksum(block, block_labels):
                problems.append(f"{split}: chunk {chunk} (rows {start}:{stop}) is corrupted "
                                "(sha256 mismatch)")
                bad_chunks += 1
        info["chunks_checked"] = int(done.sum())
        class_names = attrs.get("class_names", (attrs.get("dataset") or {}).get("class_names"))
        if class_names is not None and num_classes is not None and len(class_names) != num_classes:
            problems.append(f"{split}: {len(class_names)} class names but num_classes="
                            f"{num_classes}")
        info["bad_chunks"] = bad_chunks
        if fingerprints and split in fingerprints:
            recorded = attrs.get("dataset", {}).get("fingerprint")
            if recorded != fingerprints[split]:
                problems.append(f"{split}: dataset fingerprint {recorded} != source data "
                                f"{fingerprints[split]}")
    if len(identities) == 2:
        differ = identity_differences(identities["train"], identities["test"])
        if differ:
            problems.append(f"train and test differ in {', '.join(differ)}: one store must hold "
                            "one job (same backbone, weights, preprocessing, class list)")
    return VerifyReport(problems, summary)


def source_fingerprints(store, data: str, *, data_dir=None) -> tuple[dict, list[str]]:
    """The fingerprints of a data spec's splits, as `verify_store(fingerprints=...)` takes
    them: a source with its own splits split by split; a single-split source (npz,
    imagefolder) for the split it was extracted into (the one that recorded this spec, else
    the one whose fingerprint it matches).

    Args:
      store: the feature store.
      data: the data spec the store was extracted from.
      data_dir: where named datasets are cached.

    Returns:
      ({split: fingerprint of the source data it should hold}, the problems found).
    """
    recorded = store_summary(store)["splits"]
    precomputed = any((a.get("backbone") or {}).get("name") == "none" for a in recorded.values())
    kind, _ = parse_data_spec(data)
    num_classes = next((len(a["class_names"]) for a in recorded.values()
                        if a.get("class_names") and kind == "npz"), None)
    splits = open_source(data, data_dir=data_dir, split=None,
                                 precomputed=precomputed, num_classes=num_classes)
    if kind not in ("npz", "imagefolder"):
        return {name: one.fingerprint for name, one in splits.items()}, []
    (one,) = splits.values()
    spec_match = [n for n, a in recorded.items() if (a.get("dataset") or {}).get("spec") == data]
    print_match = [n for n, a in recorded.items()
                   if (a.get("dataset") or {}).get("fingerprint") == one.fingerprint]
    target = (print_match or spec_match or [None])[0]
    if target is None:
        return {}, [f"--data {data} matches no split of the store (its fingerprint "
                    f"{one.fingerprint} is recorded by none of {sorted(recorded)})"]
    return {target: one.fingerprint}, []
