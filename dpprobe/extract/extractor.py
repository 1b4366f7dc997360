"""Run a frozen backbone once over a split and write the embeddings to the feature store.

The pipeline: a torch DataLoader (worker processes decode and preprocess, pinned memory) feeds
the backbone (AMP autocast on GPU, optional channels_last and torch.compile); finished row
chunks go to a writer thread, so Zarr compression and I/O overlap with compute. Only chunks not
yet marked done (and owned by this shard) are extracted, so a killed run resumes where it
stopped, and separate processes can fill one store.

Augmented views (`views=K`, `augment=("flip", "crop")`) are a pure function of
(augment_seed, row, view), so resumed and sharded runs reproduce them exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import queue
import sys
import threading
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from dpprobe.extract.backbones import Backbone, input_mismatch
from dpprobe.extract.data_check import check_one_size
from dpprobe.extract.sources import ImageSplit, PrecomputedSplit
from dpprobe.extract.store import mark_failed, shard_chunks
from dpprobe.extract.writer import SplitWriter

__all__ = ["AUGMENTATIONS", "ExtractReport", "augment_image", "embed_images", "extract_split"]

AUGMENTATIONS = ("flip", "crop")


@dataclasses.dataclass
class ExtractReport:
    split: str
    num_examples: int
    feature_shape: tuple[int, ...]
    chunks_written: int
    num_chunks: int
    complete: bool
    resumed: bool
    shard: tuple[int, int] | None = None


def _view_generator(seed: int, row: int, view: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{row}:{view}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def augment_image(image, augment: Sequence[str], seed: int, row: int, view: int):
    """A random (flip, crop) of a PIL image, determined by (seed, row, view) alone.

    "crop" pads by 1/8 of the short side (4 px at 32 px, reflect) and crops back at a random
    offset, as in De et al. (2022); "flip" mirrors horizontally with probability 1/2.
    """
    import torchvision.transforms.functional as TF

    generator = _view_generator(seed, row, view)
    if "crop" in augment:
        width, height = image.size
        pad = max(1, round(min(width, height) / 8))
        padded = TF.pad(image, pad, padding_mode="reflect")
        top, left = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=generator))
        image = TF.crop(padded, top, left, height, width)
    if "flip" in augment and torch.rand((), generator=generator) < 0.5:
        image = TF.hflip(image)
    return image


class _Rows(torch.utils.data.Dataset):
    """Preprocessed (views of) the given rows of a split, for a DataLoader."""

    def __init__(self, split: ImageSplit, rows: np.ndarray, transform, views: int | None,
                 augment: Sequence[str], seed: int):
        self.split, self.rows, self.transform = split, rows, transform
        self.views, self.augment, self.seed = views, tuple(augment), seed
        self.shape = tuple(transform(split.images([0])[0]).shape)  # every image must match

    def _tensor(self, image, row: int):
        tensor = self.transform(image)
        if tuple(tensor.shape) != self.shape:
            raise ValueError(input_mismatch(
                self.shape, tuple(tensor.shape),
                f"image {self.split.describe(row)} ({image.size[0]}x{image.size[1]} {image.mode})"))
        return tensor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        row = int(self.rows[i])
        image = self.split.images([row])[0]
        if self.views is None:
            return self._tensor(image, row), row
        tensors = [self._tensor(augment_image(image, self.augment, self.seed, row, v)
                                if self.augment else image, row) for v in range(self.views)]
        return torch.stack(tensors), row


def embed_images(backbone: Backbone, split: ImageSplit, indices) -> np.ndarray:
    """Embeddings (len(indices), d) float32 of the given images of a split (no augmentation)."""
    batch = torch.stack([backbone.transform(image) for image in split.images(indices)])
    return backbone.forward(batch).cpu().numpy()


def _autocast(device: torch.device, amp: str):
    if amp == "off":
        return torch.autocast(device.type, enabled=False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return torch.autocast(device.type, dtype=dtype)


def _resolve_amp(amp: str | None, device: torch.device) -> str:
    if amp in (None, "auto"):
        return "bf16" if device.type == "cuda" else "off"
    if amp not in ("off", "bf16", "fp16"):
        raise ValueError(f"amp must be auto, off, bf16 or fp16, got {amp!r}")
    return amp


def _default_workers(device: torch.device) -> int:
    if "jax" in sys.modules:
        # DataLoader workers are forked, and forking a process in which JAX's thread pools run
        # can deadlock: preprocess in this process instead (pass num_workers to override).
        return 0
    if device.type == "cuda":
        return min(8, os.cpu_count() or 1)
    # On CPU the backbone's intra-op threads already use every core: a worker process only
    # competes with them (measured: 0.87 of the bare forward with 1 worker, 0.93 with none).
    return 0


class _Writer:
    """A background thread that writes finished chunks; errors surface in the caller."""

    def __init__(self, writer: SplitWriter, depth: int = 2):
        self.writer, self.queue = writer, queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.writer.write_chunk(*item)
                except BaseException as err:  # re-raised by submit/close
                    self.error = err

    def submit(self, chunk: int, features: np.ndarray, labels: np.ndarray) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((chunk, features, labels))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def extract_split(
    split: ImageSplit | PrecomputedSplit,
    backbone: Backbone | None,
    store,
    *,
    split_name: str | None = None,
    batch_size: int = 256,
    dtype: str = "float16",
    rows_per_chunk: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    num_workers: int | None = None,
    amp: str | None = "auto",
    channels_last: bool = False,
    compile: bool = False,
    shard: tuple[int, int] | None = None,
    views: int | None = None,
    augment: Sequence[str] = (),
    augment_seed: int = 0,
    create_only: bool = False,
) -> ExtractReport:
    """Embed every example of `split` and write it to `store/split_name`, resumably.

    Chunks already marked done by an earlier (interrupted) run of the same job are skipped;
    the split is marked complete only after its last chunk is written (by whichever shard
    finishes last).

    Args:
      split: images (with a backbone) or precomputed embeddings (backbone None).
      backbone: the frozen feature extractor, or None for `PrecomputedSplit`.
      store: the Zarr store path (or fsspec URL).
      split_name: "train" or "test" (default: the split's own name).
      batch_size: examples per forward pass (with views, each example brings K images).
      dtype: feature dtype in the store, "float16" (default) or "float32".
      rows_per_chunk: chunk height (default: chosen from rows x d, ~8 MiB per chunk).
      overwrite: replace an existing split written by a different job (not with `shard`).
      progress: show a progress bar.
      num_workers: DataLoader worker processes (default: none on CPU, up to 8 on GPU).
      amp: autocast "auto" (bf16 on CUDA, off on CPU), "bf16", "fp16" or "off".
      channels_last, compile: speed knobs (channels_last memory format, torch.compile).
      shard: (k, n) to extract only shard k of n (a contiguous run of chunks).
      views: store K views per example, shape (N, K, d) (None: plain (N, d)).
      augment: augmentations of the views ("flip", "crop"); never for the test split.
      augment_seed: seed of the augmentations.
      create_only: create (or validate) the split and write nothing, so that shards launched
        afterwards never race to create it.
    """
    name = split_name or split.split
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shard is not None and overwrite:
        raise ValueError("`overwrite` with `shard` would let shards erase each other; "
                         "delete the split first, then launch the shards")
    unknown = set(augment) - set(AUGMENTATIONS)
    if unknown:
        raise ValueError(f"unknown augmentations {sorted(unknown)}; use {AUGMENTATIONS}")
    if views is not None and views < 1:
        raise ValueError(f"views must be >= 1, got {views}")
    if augment and views is None:
        raise ValueError("augmentations need `views=K` (K augmented views per example)")
    if views is not None and views > 1 and not augment:
        raise ValueError(f"`views={views}` without `augment` would store {views} identical "
                         "views; add `augment=flip,crop`")
    if name == "test":  # the test split is never augmented
        views, augment = None, ()
    if isinstance(split, PrecomputedSplit):
        if backbone is not None:
            raise ValueError("precomputed embeddings take no backbone (--backbone none)")
        if views is not None:
            raise ValueError("precomputed embeddings cannot be given views")
        feature_shape = tuple(split.features.shape[1:])
        if dtype == "float16":
            _check_float16_range(split)
        backbone_provenance = {"name": "none", "weights_source": "precomputed embeddings"}
        preprocessing = {"kind": "none (precomputed)"}
    else:
        if backbone is None:
            raise ValueError("images need a backbone")
        check_one_size(split, backbone.preprocessing)
        dim = _first_embedding_dim(backbone, split)
        feature_shape = (dim,) if views is None else (views, dim)
        amp = _resolve_amp(amp, backbone.device)
        backbone_provenance = backbone.provenance
        preprocessing = backbone.preprocessing | {
            "views": views, "augment": sorted(augment), "augment_seed": augment_seed if augment
            else None, "amp": amp,
        }
    writer = SplitWriter(
        store,
        name,
        num_rows=len(split),
        feature_shape=feature_shape,
        dtype=dtype,
        provenance={
            "backbone": backbone_provenance,
            "preprocessing": preprocessing,
            "dataset": split.provenance(),
        },
        rows_per_chunk=rows_per_chunk,
        overwrite=overwrite,
        shard=shard is not None,
    )
    try:
        pending, complete = _fill(writer, split, backbone, name, shard, create_only, progress,
                                  batch_size=batch_size, num_workers=num_workers, amp=amp,
                                  channels_last=channels_last, compile=compile, views=views,
                                  augment=augment, seed=augment_seed)
    except BaseException as err:
        if isinstance(err, Exception):  # a record or the backbone failed, not an interrupt
            with contextlib.suppress(Exception):  # the error itself matters more than its mark
                mark_failed(writer.group, err)
        writer.abandon()  # removes a split it created only if no chunk of it is finished
        raise
    writer.close()
    return ExtractReport(
        split=name,
        num_examples=len(split),
        feature_shape=feature_shape,
        chunks_written=len(pending),
        num_chunks=writer.num_chunks,
        complete=complete,
        resumed=writer.resumed,
        shard=shard,
    )


def _check_float16_range(split: PrecomputedSplit) -> None:
    largest = float(np.abs(split.features).max()) if split.features.size else 0.0
    if largest > float(np.finfo(np.float16).max):
        raise ValueError(f"{split.dataset}: features reach |x| = {largest:.4g}, beyond float16 "
                         "(65504); extract with `dtype=float32`")


def _first_embedding_dim(backbone: Backbone, split: ImageSplit) -> int:
    """The embedding size, from image 0; a backbone that cannot take the preprocessed image
    size (e.g. a crop smaller than a ViT's patch) is refused with the size it got."""
    image = split.images([0])[0]
    tensor = backbone.transform(image)
    try:
        return int(backbone.forward(tensor[None].contiguous()).shape[1])
    except (RuntimeError, AssertionError) as err:  # timm asserts on patch-size mismatches
        raise ValueError(
            f"backbone {backbone.name} cannot embed images preprocessed to "
            f"{tuple(tensor.shape)} (--resize/--crop): {str(err).strip().splitlines()[0]}"
        ) from err


def _fill(writer, split, backbone, name, shard, create_only, progress, **options):
    """Extract the chunks this process owns; returns (chunks written, split complete)."""
    owned = set(shard_chunks(writer.num_chunks, shard))
    pending = [] if create_only else [c for c in writer.pending_chunks() if c in owned]
    total = int(sum(np.subtract(*writer.chunk_rows(c)[::-1]) for c in pending))
    bar = tqdm(total=total, unit="ex", desc=f"extract {name}" + (
        f" shard {shard[0]}/{shard[1]}" if shard else ""), disable=not progress,
        file=sys.stderr, dynamic_ncols=True)
    with bar:
        if isinstance(split, PrecomputedSplit):
            for chunk in pending:
                start, stop = writer.chunk_rows(chunk)
                writer.write_chunk(chunk, split.features[start:stop], split.labels[start:stop])
                bar.update(stop - start)
        elif pending:
            _run_backbone(split, backbone, writer, pending, bar, **options)
    return pending, False if create_only else writer.finalize()


def _run_backbone(split, backbone, writer, pending, bar, *, batch_size, num_workers, amp,
                  channels_last, compile, views, augment, seed):
    """DataLoader -> backbone -> chunk buffers -> writer thread."""
    device = backbone.device
    module = backbone.module
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    if compile:
        module = torch.compile(module)
    rows = np.concatenate([np.arange(*writer.chunk_rows(c)) for c in pending])
    # Batches never straddle chunks and start at fixed offsets within their chunk, so a
    # resumed or sharded run computes every chunk with exactly the same batches (bitwise the
    # same features) as one uninterrupted run.
    batches, position = [], 0
    for chunk in pending:
        start, stop = writer.chunk_rows(chunk)
        for offset in range(0, stop - start, batch_size):
            size = min(batch_size, stop - start - offset)
            batches.append(list(range(position + offset, position + offset + size)))
        position += stop - start
    workers = _default_workers(device) if num_workers is None else num_workers
    loader = torch.utils.data.DataLoader(
        _Rows(split, rows, backbone.transform, views, augment, seed),
        batch_sampler=batches,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
        prefetch_factor=4 if workers else None,
    )
    buffers: dict[int, np.ndarray] = {}  # chunk -> its rows' features, filled batch by batch
    remaining = {}  # chunk -> rows still to come
    for chunk in pending:
        start, stop = writer.chunk_rows(chunk)
        remaining[chunk] = stop - start
    background = _Writer(writer)
    try:
        with torch.inference_mode(), _autocast(device, amp):
            for images, batch_rows in loader:
                shape = images.shape
                flat = images.reshape(-1, *shape[-3:]).to(device, non_blocking=True)
                if channels_last:
                    flat = flat.contiguous(memory_format=torch.channels_last)
                out = module(flat)
                out = out.reshape(out.shape[0], -1).float()
                if views is not None:
                    out = out.reshape(shape[0], views, -1)
                out = out.cpu().numpy()
                batch_rows = batch_rows.numpy()
                chunk = int(batch_rows[0]) // writer.rows_per_chunk  # batches never straddle
                start, stop = writer.chunk_rows(chunk)
                if chunk not in buffers:
                    buffers[chunk] = np.empty((stop - start, *out.shape[1:]), np.float32)
                buffers[chunk][batch_rows - start] = out
                remaining[chunk] -= len(batch_rows)
                if remaining[chunk] == 0:
                    background.submit(chunk, buffers.pop(chunk), split.labels[start:stop])
                bar.update(len(batch_rows))
    finally:
        background.close()
